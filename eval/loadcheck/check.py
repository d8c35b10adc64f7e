"""The engine-independent procedure: build, sentinel, the engine's full load, then key by key.

An ``Engine`` (``sglang_engine.SGLangEngine``, ``vllm_engine.VLLMEngine``) supplies the engine's own
model class and loader; this module decides what the result means:

1. build the model with the engine's own startup path (a refusal here is the checkpoint's FAIL);
2. fill every parameter with the sentinel and run the engine's full loader: what still holds the
   sentinel was never written, unless the target provides it by design (the engine's rule);
3. load each checkpoint key on its own through the model's ``load_weights`` and record which
   parameter rows it wrote; a key that writes nothing was ignored, unless the engine only takes it
   together with a partner (the MLA ``q_a_proj`` + ``kv_a_proj_with_mqa`` fusion in SGLang), in
   which case the pair is loaded together; two keys writing the same rows is a problem (the later
   one silently wins); what a key wrote must hold the key's own values;
4. the draft->target vocabulary map the engine took must be valid whenever the draft vocabulary is
   not the target's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import traceback
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from eval.loadcheck.folder import DrafterFolder
from eval.loadcheck.probe import (
    KeyUse,
    Report,
    Shard,
    Span,
    describe_unwritten,
    format_spans,
    holds_sentinel,
    nonfinite_keys,
    sentinel_fill,
    sentinel_rows,
    t2d_disagreement,
    vocab_map_problems,
    written_spans,
)

SKIPPED_BY_DESIGN = {"t2d": "both engines drop t2d (only d2t is used)"}


class SetupError(RuntimeError):
    """The engine is missing or its loader cannot be set up here: the check could not run (exit 2)."""


class Engine(Protocol):
    name: str
    version: str

    def build(self) -> torch.nn.Module:
        """The draft model from the engine's own config parsing, registry and startup path."""

    def load_all(self, model: torch.nn.Module) -> None:
        """The engine's full checkpoint load (file iterator, ``load_weights``, post-processing)."""

    def load_keys(self, model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        """``model.load_weights`` on just these tensors."""

    def reset(self, model: torch.nn.Module) -> None:
        """Forget non-parameter state a load sets (SGLang's ``hot_token_id``)."""

    def vocab_map(self, model: torch.nn.Module) -> torch.Tensor | None:
        """The target id of every draft id as the engine holds it after a load; None if it holds none."""

    def vocab_map_required(self, model: torch.nn.Module) -> bool:
        """Whether the engine maps draft ids to target ids at all (draft vocab != target vocab)."""

    def target_vocab(self, model: torch.nn.Module) -> int:
        """The vocabulary the target ids must lie in."""

    def provided_by_target(self, name: str, model: torch.nn.Module) -> str | None:
        """Why parameter ``name`` may stay unwritten (the engine takes it from the target), or None."""

    def shards(self, model: torch.nn.Module) -> dict[str, list[Shard]]:
        """Stacked parameters and the checkpoint tensor each row range comes from."""

    def partners(self, key: str, keys: Sequence[str]) -> list[str]:
        """Keys the engine only consumes together with ``key`` (empty when it takes ``key`` alone)."""

    def cleanup(self) -> None:
        """Remove temporary files."""


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[None]:
    """The engines print pages at import and build; keep them out of the report unless asked."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield
    finally:
        logging.disable(previous)


def _written(model: torch.nn.Module) -> dict[str, list[Span]]:
    out = {}
    for name, p in model.named_parameters():
        found = written_spans(p)
        if found:
            out[name] = found
    return out


def _stack_order(keys: list[str], shards: Sequence[Shard]) -> list[str]:
    """A fused group's keys in the order their shards sit in the stacked parameter."""
    def rank(key: str) -> int:
        for i, s in enumerate(shards):
            if f".{s.label}." in f".{key}":
                return i
        return len(shards)
    return sorted(keys, key=rank)


def _values_problem(model: torch.nn.Module, wrote: dict[str, list[Span]], group: list[str],
                    tensors: dict[str, torch.Tensor], shards: dict[str, list[Shard]], label: str) -> str | None:
    """The rows a key (or fused group, in shard order) wrote must hold its values, in the parameter's dtype."""
    if len(wrote) != 1:
        return None
    (name, found), = wrote.items()
    p = dict(model.named_parameters())[name].detach()
    rows = torch.cat([p[a:b] for a, b in found]) if p.dim() else p.reshape(1)
    want = torch.cat([tensors[k].reshape(-1) for k in _stack_order(group, shards.get(name, []))])
    if rows.numel() != want.numel():
        return None  # a loader that reshapes (none here) cannot be compared element-wise
    if not torch.equal(rows.reshape(-1), want.to(p.dtype)):
        return f"{label} landed in {name} ({format_spans(found, p.shape[0])}) but those rows hold other values"
    return None


def trace_keys(engine: Engine, model: torch.nn.Module, tensors: dict[str, torch.Tensor], report: Report) -> None:
    """Step 3: each key alone (or with its partners), what it wrote, overlaps, values."""
    params = dict(model.named_parameters())
    shards = engine.shards(model)
    dirty = set(params)  # parameters that may hold something other than the sentinel

    def fresh() -> None:
        """Sentinel back into what the last load wrote (the rest still holds it), the engine's state reset."""
        sentinel_fill(params[n] for n in sorted(dirty))
        dirty.clear()
        engine.reset(model)

    done: set[str] = set()
    owner: dict[str, list[tuple[Span, str]]] = {}  # parameter -> (rows, key) already claimed
    for key in sorted(tensors):
        if key in done:
            continue
        use = KeyUse(key)
        report.keys.append(use)
        leaf = key.rsplit(".", 1)[-1]
        group = [key]
        partners = engine.partners(key, list(tensors))
        if leaf in SKIPPED_BY_DESIGN:
            use.by_design = SKIPPED_BY_DESIGN[leaf]
        fresh()
        try:
            engine.load_keys(model, [(key, tensors[key])])
            wrote = _written(model)
            dirty.update(wrote)
            if not wrote and engine.vocab_map(model) is None and partners:
                group = [key, *partners]
                fresh()
                engine.load_keys(model, [(k, tensors[k]) for k in group])
                wrote = _written(model)
                dirty.update(wrote)
        except Exception as e:  # noqa: BLE001 - a key the loader raises on is a rejected key
            dirty.update(params)  # a load that raised half-way may have written anything
            use.problem = f"key {key} rejected: {type(e).__name__}: {e}"[:400]
            report.problems.append(use.problem)
            report.lines.append(f"  REJECTED     {key:<48} {tuple(tensors[key].shape)}  {type(e).__name__}: {e}"[:300])
            continue
        use.wrote = wrote
        use.vocab_map = engine.vocab_map(model) is not None and not wrote
        if len(group) > 1 and wrote:
            use.together_with = group[1:]
            for other in group[1:]:
                done.add(other)
                report.keys.append(KeyUse(other, wrote=wrote, together_with=[key]))
        if use.by_design:
            if wrote or use.vocab_map:
                use.by_design = None  # the engine used it after all: an ordinary key then
            else:
                report.lines.append(f"  SKIPPED      {key:<48} {tuple(tensors[key].shape)}  {SKIPPED_BY_DESIGN[leaf]}")
                continue
        if not wrote and not use.vocab_map:
            use.problem = (f"key {key} ignored ({engine.name}'s load_weights matched no parameter"
                           f"{', not even with ' + ', '.join(partners) if partners else ''})")
            report.problems.append(use.problem)
            report.lines.append(f"  IGNORED      {key:<48} {tuple(tensors[key].shape)}  {engine.name}'s load_weights "
                                "matched no parameter (silently skipped)")
            continue
        label = key if len(group) == 1 else " + ".join(group)
        bad = _values_problem(model, wrote, group, tensors, shards, label)
        if bad:
            report.problems.append(bad)
        for name, found in wrote.items():
            for span in found:
                for other_span, other in owner.get(name, []):
                    if span[0] < other_span[1] and span[1] > other_span[0]:
                        report.problems.append(f"keys {other} and {label} both write {name} "
                                               f"(rows {max(span[0], other_span[0])}..{min(span[1], other_span[1]) - 1}): "
                                               "the later one silently wins")
            owner.setdefault(name, []).extend((s, label) for s in found)
        where = "; ".join(f"{n} {format_spans(s, params[n].shape[0] if params[n].dim() else 1)}"
                          for n, s in wrote.items()) or "the draft->target vocab map"
        report.lines.append(f"  USED         {label:<48} -> {where}")


def run_check(engine: Engine, folder: DrafterFolder, *, verbose: bool = False) -> Report:
    """The whole check of one folder in one engine; raises SetupError when it cannot run."""
    report = Report(engine=engine.name, folder=str(folder.path), architecture=folder.architecture)
    tensors = folder.tensors()
    for key in nonfinite_keys(tensors):
        report.problems.append(f"checkpoint key {key} holds NaN or inf (it would read as never written)")
    try:
        with quiet(verbose):
            try:
                model = engine.build()
            except SetupError:
                raise
            except Exception as e:  # noqa: BLE001 - a config the engine refuses is the checkpoint's FAIL
                if verbose:
                    traceback.print_exc()
                report.version = engine.version
                report.problems.append(f"{engine.name} could not build the draft model: {type(e).__name__}: {e}"[:500])
                return report
            report.version = engine.version
            report.model_class = f"{type(model).__module__.rsplit('.', 1)[-1]}.{type(model).__name__}"
            params = dict(model.named_parameters())
            report.params = len(params)
            shards = engine.shards(model)
            # 2. the engine's full load into sentinel-filled parameters
            sentinel_fill(params.values())
            engine.reset(model)
            aborted = None
            try:
                engine.load_all(model)
            except Exception as e:  # noqa: BLE001 - the engine refusing the checkpoint
                aborted = f"loader raised {type(e).__name__}: {e}"[:400]
                report.problems.append(aborted)
            unwritten = 0
            for name, p in model.named_parameters():
                held = holds_sentinel(p)
                if held is None:
                    report.warnings.append(f"parameter {name} is {p.dtype}: it cannot hold a sentinel, not verified")
                    continue
                if not held:
                    continue
                left = sentinel_rows(p)
                assert left is not None
                why = engine.provided_by_target(name, model) if int(left.sum()) == p.numel() else None
                if why:
                    report.by_design[name] = why
                    report.lines.append(f"  BY DESIGN    {name:<48} {tuple(p.shape)}  {why}")
                    continue
                unwritten += 1
                detail = describe_unwritten(name, p, shards.get(name, []))
                report.lines.append(f"  NOT LOADED   {name:<48} {tuple(p.shape)}  {detail}")
                if aborted is None:
                    report.problems.append(f"parameter {name} not loaded ({detail})")
            if aborted and unwritten:
                report.problems.append(f"{unwritten} parameter(s) left unwritten by the aborted load")
            # 4. the vocab map after the full load
            required = engine.vocab_map_required(model)
            held = engine.vocab_map(model)
            draft_vocab = int(getattr(model.config, "draft_vocab_size", None) or folder.vocab)
            if required and held is None:
                if "d2t" in tensors:
                    report.problems.append("d2t is in the checkpoint but the engine holds no draft->target map")
                else:
                    report.problems.append(f"no d2t although draft_vocab_size ({draft_vocab}) != the target vocab "
                                           f"({engine.target_vocab(model)}): draft ids would be used as target ids")
            elif held is not None:
                report.problems += vocab_map_problems(held, draft_vocab, engine.target_vocab(model))
                if "t2d" in tensors:
                    warn = t2d_disagreement(held, tensors["t2d"])
                    if warn:
                        report.warnings.append(warn)
            # 3. key by key
            trace_keys(engine, model, tensors, report)
    finally:
        engine.cleanup()
    return report
