"""Offline acceptance length of EAGLE-3 drafters on a redraft dataset (what serving would accept).

    python -m eval.acceptance CKPT [CKPT ...] --data SHARDS [--steps 7] [--topk 1]
        [--num-draft-tokens N] [--temperature 0] [--split val|all] [--max-samples N]
        [--target PATH] [--batch-tokens N] [--json PATH] [--markdown PATH] [--plot PATH]

CKPT is a training run folder (``OUT/``, its ``latest`` step is used), a ``step-XXXXXXX``
checkpoint, or a foreign SGLang/SpecForge drafter folder (config.json + model.safetensors;
its layer ids are read in SGLang's convention for the dataset's target architecture).

Numbers follow SGLang's convention: acceptance length tau = accepted drafts + 1 (the bonus token
the target always adds). The maths is in :mod:`eval.simulate`; this module loads, batches,
aggregates and reports. :func:`evaluate` is the library entry point (the trainer's periodic
validation can call it); importing this module has no side effects.

Split: by default the held-out validation ids recorded in each checkpoint's redraft.json. With
several checkpoints the intersection of their recorded splits is used, so every checkpoint is
scored on samples none of them trained on; drafters without a record (imported ones) do not
constrain it, and if none has one every sample is used, with a warning.

Approximations at temperature > 0 (reported as "expected"): the chain follows the data tokens
rather than a sampled path, and a top-k teacher is the stored top-k renormalised at temperature T
(a teacher from ``last_hidden`` is exact over the full vocabulary).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script path: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.atomic import atomic_write_text  # noqa: E402
from core.batching import pack_batches  # noqa: E402
from core.config import ConfigError, parse_args_with_config  # noqa: E402
from core.dataset.batch import collate  # noqa: E402
from core.dataset.reader import DatasetReader  # noqa: E402
from core.drafter.folder import CheckpointError, load_drafter_checkpoint, read_record, resolve_drafter_folder  # noqa: E402
from core.drafter.modeling import Eagle3Drafter  # noqa: E402
from core.plotting import atomic_write_png, pyplot  # noqa: E402
from core.target_weights import read_target_tensor, weight_key_candidates  # noqa: E402
from core.teacher_targets import teacher_from_last_hidden, teacher_from_topk, topk_argmax  # noqa: E402
from eval import simulate as sim  # noqa: E402

log = logging.getLogger(__name__)


class AcceptanceError(ValueError):
    """A checkpoint, dataset or option combination that cannot be evaluated; the message names both sides."""


# ----------------------------------------------------------------------------- checkpoints


def resolve_checkpoint(path: str | Path) -> Path:
    """A drafter folder: ``path`` itself, or a run folder's ``latest`` step (else its newest step-*)."""
    try:
        return resolve_drafter_folder(path)
    except CheckpointError as e:
        raise AcceptanceError(str(e)) from e


def check_fits(cfg: Any, manifest: dict[str, Any], num_aux: int, source: str, data: str) -> None:
    """Refuse a drafter whose target hidden size, vocab or layer ids differ from the dataset's."""
    pairs = [
        ("target hidden size", cfg.target_hidden_size, int(manifest["hidden_size"]), "hidden_size"),
        ("vocab size", cfg.vocab_size, int(manifest["vocab_size"]), "vocab_size"),
        ("aux layer ids", list(cfg.aux_layer_ids), [int(i) for i in manifest.get("aux_layer_ids") or []],
         "aux_layer_ids"),
        ("number of aux layers", cfg.num_aux_layers, num_aux, "aux_hidden width / hidden_size"),
    ]
    problems = [f"{what}: drafter {source} has {mine!r}, dataset {data} has {theirs!r} ({key})"
                for what, mine, theirs, key in pairs if mine != theirs]
    if problems:
        raise AcceptanceError("checkpoint does not fit the data: " + "; ".join(problems))


def check_fingerprint(record: dict[str, Any] | None, manifest: dict[str, Any], source: str, data: str) -> None:
    """Refuse a redraft drafter trained on data from another tokenizer or chat template (same shapes, other ids)."""
    recorded = (record or {}).get("dataset") or {}
    problems = [f"{key}: drafter {source} was trained on {recorded[key]!r}, dataset {data} has {manifest[key]!r}"
                for key in ("tokenizer_hash", "chat_template_hash")
                if recorded.get(key) and manifest.get(key) and recorded[key] != manifest[key]]
    if problems:
        raise AcceptanceError("checkpoint does not fit the data: " + "; ".join(problems))


def _target_folder(manifest: dict[str, Any], target: str | Path | None, data: str) -> Path:
    path = Path(target) if target else Path(str((manifest.get("target") or {}).get("path", "")))
    if not path.exists():
        raise AcceptanceError(
            f"target folder {str(path)!r} (from {'--target' if target else data + '/manifest.json target.path'}) "
            "does not exist; the drafter needs the target's input embedding: pass --target PATH"
        )
    return path


def _key_candidates(manifest: dict[str, Any], target: Path, which: str) -> list[str]:
    """Embedding (which='embed') or lm_head keys: the manifest's recorded key first, then the usual names."""
    tinfo = manifest.get("target") or {}
    keys = [tinfo[f"{which}_key"]] if tinfo.get(f"{which}_key") else []
    cfg_file = target / "config.json"
    if cfg_file.is_file():
        embed, head = weight_key_candidates(json.loads(cfg_file.read_text()))
        keys += embed if which == "embed" else head
    return list(dict.fromkeys(keys))


def _load_checked(folder: Path, reader: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    manifest = reader.manifest
    tinfo = manifest.get("target") or {}
    try:
        cfg, state = load_drafter_checkpoint(
            folder, target_architecture=tinfo.get("architecture") or "LlamaForCausalLM",
            target_num_layers=int(manifest["num_layers"]),
        )
    except CheckpointError as e:
        raise AcceptanceError(str(e)) from e
    check_fits(cfg, manifest, reader.num_aux, str(folder), str(reader.root))
    check_fingerprint(read_record(folder), manifest, str(folder), str(reader.root))
    return cfg, state


def inspect_checkpoint(checkpoint: str | Path, reader: Any) -> tuple[Path, dict[str, Any] | None]:
    """(resolved folder, redraft record or None), after checking the drafter fits the data."""
    folder = resolve_checkpoint(checkpoint)
    _load_checked(folder, reader)
    return folder, read_record(folder)


def load_drafter(
    checkpoint: str | Path, reader: Any, *, target: str | Path | None = None, device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Path, dict[str, Any] | None]:
    """(drafter with the target embedding, resolved folder, redraft record or None) checked against the data."""
    folder = resolve_checkpoint(checkpoint)
    manifest = reader.manifest
    cfg, state = _load_checked(folder, reader)
    impl = "sdpa" if str(device).startswith("cuda") else "eager"
    drafter = Eagle3Drafter(cfg, attention_impl=impl)
    drafter.load_serving_state_dict(state)
    tpath = _target_folder(manifest, target, str(reader.root))
    drafter.load_target_embedding(tpath, _key_candidates(manifest, tpath, "embed"))
    drafter.to(device=device, dtype=dtype).eval()
    return drafter, folder, read_record(folder)


# ----------------------------------------------------------------------------- samples


def select_samples(
    reader: Any, records: Sequence[dict[str, Any] | None], split: str, max_samples: int = 0
) -> tuple[list[int], str]:
    """(dataset indices in dataset order, description). See the module docstring for the rules."""
    if split not in ("val", "all"):
        raise AcceptanceError(f"--split must be 'val' or 'all', got {split!r}")
    indices = list(range(len(reader)))
    desc = "all"
    if split == "val":
        recorded = [set(map(str, r["val_ids"])) for r in records if r and r.get("val_ids") is not None]
        if not recorded:
            log.warning("no checkpoint records a validation split (imported drafters?): evaluating on ALL %d "
                        "samples, which may include training data", len(reader))
        else:
            if len(recorded) < len(records):
                log.warning("%d of %d checkpoints record no validation split; using the others' split",
                            len(records) - len(recorded), len(records))
            wanted = set.intersection(*recorded)
            if len(wanted) < max(len(s) for s in recorded):
                log.warning("checkpoints record different validation splits; using their intersection "
                            "(%d ids)", len(wanted))
            present = set(reader.sample_ids)
            missing = wanted - present
            if missing:
                log.warning("%d validation ids are not in %s (another dataset?); skipping them",
                            len(missing), reader.root)
            indices = [i for i, s in enumerate(reader.sample_ids) if s in wanted]
            if not indices:
                raise AcceptanceError(
                    f"the recorded validation split has no sample in {reader.root} (intersection of "
                    f"{len(recorded)} checkpoint split(s)); use --split all"
                )
            desc = "val"
    if max_samples > 0:
        indices = indices[:max_samples]
    return indices, desc


def make_batches(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches whose padded size B * T_max stays within ``batch_tokens`` (one sample at least)."""
    groups = pack_batches([lengths[i] for i in indices], batch_tokens)
    return [[indices[j] for j in group] for group in groups]


# ----------------------------------------------------------------------------- teacher


def teacher_for_batch(
    batch: Any, drafter: Any, kind: str, temperature: float, lm_head: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax [B, T] full vocab, teacher prob on the draft vocab at temperature T [B, T, Vd] or None at T=0)."""
    if kind == "topk":
        ids, lp = batch.topk_ids, batch.topk_logprobs.float()
        argmax = topk_argmax(ids, lp, drafter.config.vocab_size)
        if temperature <= 0:
            return argmax, None
        valid = (ids >= 0) & (ids < drafter.config.vocab_size)
        lp_t = torch.log_softmax(lp.masked_fill(~valid, float("-inf")) / temperature, dim=-1)  # truncated to the top-k
        return argmax, teacher_from_topk(ids, lp_t, drafter.t2d, drafter.d2t).p_on_draft
    if lm_head is None:
        raise AcceptanceError("teacher 'last_hidden' needs the target's lm_head")
    scale = temperature if temperature > 0 else 1.0
    t = teacher_from_last_hidden(batch.last_hidden.float() / scale, lm_head, drafter.t2d)
    return t.target_ids, (t.p_on_draft if temperature > 0 else None)


def _teacher_kind(reader: Any, wanted: str) -> str:
    has_topk, has_last = reader.has_topk, bool(getattr(reader, "has_last_hidden", False))
    if wanted == "auto":
        wanted = "topk" if has_topk else "last_hidden"
    if (wanted == "topk" and not has_topk) or (wanted == "last_hidden" and not has_last):
        raise AcceptanceError(f"teacher {wanted!r} is not stored in {reader.root} (teacher {reader.teacher})")
    return wanted


def _read_lm_head(manifest: dict[str, Any], target: Path, device: str) -> torch.Tensor:
    weight, _ = read_target_tensor(target, _key_candidates(manifest, target, "lm_head"))
    return weight.to(device=device, dtype=torch.float32)


# ----------------------------------------------------------------------------- aggregation


@dataclass
class _Group:
    steps: int
    positions: int = 0
    accept_sum: torch.Tensor = field(default=None)  # type: ignore[assignment]
    tree_positions: int = 0
    tree_accepted: float = 0.0

    def __post_init__(self) -> None:
        if self.accept_sum is None:
            self.accept_sum = torch.zeros(self.steps, dtype=torch.float64)

    def summary(self, tree: bool) -> dict[str, Any]:
        mean = (self.accept_sum / max(self.positions, 1)).tolist()
        acc = self.tree_accepted / max(self.tree_positions, 1) if tree else sum(mean)
        out = {"positions": self.positions, "tau": 1.0 + acc, "accepted_drafts": acc}
        if tree:
            out["tree_positions"] = self.tree_positions
        return out


@dataclass
class Settings:
    steps: int = 7
    topk: int = 1
    num_draft_tokens: int | None = None
    temperature: float = 0.0
    batch_tokens: int = 8192
    tree_positions: int = 64
    teacher: str = "auto"

    def check(self) -> None:
        if self.steps < 1:
            raise AcceptanceError(f"--steps must be >= 1, got {self.steps}")
        if self.topk < 1:
            raise AcceptanceError(f"--topk must be >= 1, got {self.topk}")
        if self.temperature < 0:
            raise AcceptanceError(f"--temperature must be >= 0, got {self.temperature}")
        if self.topk == 1:
            if self.num_draft_tokens not in (None, self.steps + 1):
                log.warning("topk 1: SGLang forces num_draft_tokens = steps + 1 = %d (got %d)",
                            self.steps + 1, self.num_draft_tokens)
            self.num_draft_tokens = self.steps + 1
        else:
            if self.num_draft_tokens is None:
                raise AcceptanceError("--topk > 1 needs --num-draft-tokens (SGLang's tree budget)")
            n_cand = self.topk + (self.steps - 1) * self.topk**2
            if not 2 <= self.num_draft_tokens <= n_cand + 1:
                raise AcceptanceError(
                    f"--num-draft-tokens {self.num_draft_tokens} must be in [2, {n_cand + 1}] for topk "
                    f"{self.topk} and steps {self.steps}"
                )
            if self.temperature > 0:
                raise AcceptanceError("tree drafting (--topk > 1) is simulated at --temperature 0 only")


def _evaluation_label(manifest: dict[str, Any], temperature: float) -> tuple[str, str]:
    gen = manifest.get("generation")
    greedy_data = isinstance(gen, dict) and float(gen.get("temperature", -1)) == 0.0
    if temperature > 0:
        return "expected", (f"expected acceptance at temperature {temperature} (speculative sampling, "
                            "sum of min(p, q)) along the data path")
    if greedy_data:
        return "exact", "exact: the data is the target's own greedy output"
    return "lower_bound", "along the data path (lower bound): chains stop where the data leaves the target's argmax"


@torch.no_grad()
def evaluate_drafter(
    drafter: Any, reader: Any, indices: Sequence[int], settings: Settings, *, device: str = "cpu",
    lm_head: torch.Tensor | None = None, progress: bool = True, desc: str = "acceptance",
) -> dict[str, Any]:
    """Simulate ``drafter`` on the samples ``indices`` of ``reader``; returns the metrics dict."""
    from tqdm import tqdm

    settings.check()
    kind = _teacher_kind(reader, settings.teacher)
    if kind == "last_hidden" and lm_head is None:
        raise AcceptanceError("teacher 'last_hidden' needs lm_head (evaluate() reads it from the target)")
    k_steps, tree = settings.steps, settings.topk > 1
    dtype = next(drafter.parameters()).dtype
    total = _Group(k_steps)
    groups: dict[str, dict[str, _Group]] = {"source": {}, "category": {}}
    reasons = torch.zeros(4, dtype=torch.float64)
    tree_reasons = torch.zeros(4, dtype=torch.float64)
    tokens = 0
    t0 = time.perf_counter()
    batches = make_batches(indices, reader.lengths, settings.batch_tokens)
    for chunk in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
        batch = collate([reader.get(i) for i in chunk]).to(device, dtype)
        tokens += batch.num_tokens
        argmax, p = teacher_for_batch(batch, drafter, kind, settings.temperature, lm_head)
        common = dict(input_ids=batch.input_ids, aux_hidden=batch.aux_hidden,
                      attention_mask=batch.attention_mask, loss_mask=batch.loss_mask)
        if settings.temperature > 0:
            res = sim.simulate_chain_sampled(drafter, teacher_p=p, temperature=settings.temperature,
                                             steps=k_steps, **common)
            step0 = None
        else:
            res, step0 = sim.simulate_chain_greedy(drafter, target_ids=argmax, steps=k_steps, **common)
        tres = None
        if tree:
            where = sim.tree_positions(sim.drafting_positions(batch.loss_mask, batch.attention_mask),
                                       settings.tree_positions)
            tres = sim.simulate_tree(drafter, step0, input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                                     target_ids=argmax, positions=where, topk=settings.topk,
                                     num_draft_tokens=settings.num_draft_tokens, steps=k_steps)
            tree_reasons += torch.bincount(tres.reason.cpu(), minlength=4).double()
        reasons += torch.bincount(res.reason.cpu(), minlength=4).double()
        acc = res.accept_prob.double().cpu()
        rows = res.sample.cpu()
        for r, idx in enumerate(chunk):
            sel = rows == r
            n = int(sel.sum())
            s = acc[sel].sum(0)
            keys = {"source": reader.sources[idx] or "-", "category": reader.categories[idx] or "-"}
            targets = [total] + [groups[g].setdefault(v, _Group(k_steps)) for g, v in keys.items()]
            t_n, t_sum = 0, 0.0
            if tres is not None:
                tsel = tres.sample.cpu() == r
                t_n, t_sum = int(tsel.sum()), float(tres.accepted.cpu()[tsel].sum())
            for g in targets:
                g.positions += n
                g.accept_sum += s
                g.tree_positions += t_n
                g.tree_accepted += t_sum
    seconds = time.perf_counter() - t0
    return _summarise(total, groups, reasons, tree_reasons, settings, reader, len(indices), tokens, seconds)


def _summarise(total: _Group, groups: dict[str, dict[str, _Group]], reasons: torch.Tensor,
               tree_reasons: torch.Tensor, settings: Settings, reader: Any, samples: int, tokens: int,
               seconds: float) -> dict[str, Any]:
    k_steps, tree = settings.steps, settings.topk > 1
    n = max(total.positions, 1)
    mean = (total.accept_sum / n).tolist()  # P(draft k accepted)
    cond = [mean[0]] + [mean[k] / mean[k - 1] if mean[k - 1] > 0 else 0.0 for k in range(1, k_steps)]
    tau_len = {str(j): 1.0 + sum(mean[:j]) for j in range(1, k_steps + 1)}
    label, note = _evaluation_label(reader.manifest, settings.temperature)
    frac = (reasons / max(float(reasons.sum()), 1.0)).tolist()
    out: dict[str, Any] = {
        "settings": {"steps": k_steps, "topk": settings.topk, "num_draft_tokens": settings.num_draft_tokens,
                     "temperature": settings.temperature, "teacher": _teacher_kind(reader, settings.teacher),
                     "tree_positions_per_sample": settings.tree_positions if tree else None},
        "samples": samples,
        "tokens": tokens,
        "positions": total.positions,
        "chain_tau": tau_len[str(k_steps)],
        "chain_accepted_drafts": sum(mean),
        "tau_per_chain_length": tau_len,
        "accept_rate": mean,
        "conditional_accept_rate": cond,
        "stop_reasons": {name: frac[code] for code, name in sim.REASONS.items()},
        "evaluation": label,
        "evaluation_note": note,
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "positions_per_s": total.positions / max(seconds, 1e-9),
    }
    if tree:
        tfrac = (tree_reasons / max(float(tree_reasons.sum()), 1.0)).tolist()
        t_acc = total.tree_accepted / max(total.tree_positions, 1)
        out["tree"] = {"positions": total.tree_positions, "tau": 1.0 + t_acc, "accepted_drafts": t_acc,
                       "stop_reasons": {name: tfrac[code] for code, name in sim.REASONS.items()}}
        out["tau"], out["accepted_drafts"] = 1.0 + t_acc, t_acc
    else:
        out["tree"] = None
        out["tau"], out["accepted_drafts"] = out["chain_tau"], out["chain_accepted_drafts"]
    for g, table in groups.items():
        out[f"by_{g}"] = {k: v.summary(tree) for k, v in sorted(table.items())}
    return out


def evaluate(
    checkpoint_path: str | Path,
    reader: Any,
    *,
    steps: int = 7,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    split: str = "val",
    max_samples: int = 0,
    target: str | Path | None = None,
    batch_tokens: int = 8192,
    tree_positions: int = 64,
    teacher: str = "auto",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    indices: Sequence[int] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Load one checkpoint and evaluate it on ``reader`` (its recorded split unless ``indices`` is given)."""
    settings = Settings(steps, topk, num_draft_tokens, temperature, batch_tokens, tree_positions, teacher)
    settings.check()
    drafter, folder, record = load_drafter(checkpoint_path, reader, target=target, device=device, dtype=dtype)
    split_desc = "given"
    if indices is None:
        indices, split_desc = select_samples(reader, [record], split, max_samples)
    lm_head = None
    if _teacher_kind(reader, teacher) == "last_hidden":
        lm_head = _read_lm_head(reader.manifest, _target_folder(reader.manifest, target, str(reader.root)), device)
    res = evaluate_drafter(drafter, reader, indices, settings, device=device, lm_head=lm_head, progress=progress,
                           desc=folder.name)
    res.update(checkpoint=str(checkpoint_path), resolved=str(folder), split=split_desc,
               step=(record or {}).get("step"))
    return res


# ----------------------------------------------------------------------------- reports


def _names(paths: Sequence[str]) -> list[str]:
    """Unique short column names: the path as given, de-duplicated with #2, #3..."""
    seen: dict[str, int] = {}
    out = []
    for p in paths:
        name = str(p).rstrip("/") or str(p)
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def _rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    first = next(iter(results.values()))
    k_steps = first["settings"]["steps"]
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, fn) -> None:
        rows.append((label, [fn(r) for r in results.values()]))

    mode = "tree" if first["tree"] else "chain"
    add(f"tau ({mode}, accepted + 1)", lambda r: f"{r['tau']:.3f}")
    add("accepted drafts", lambda r: f"{r['accepted_drafts']:.3f}")
    if first["tree"]:
        add(f"chain tau (K={k_steps})", lambda r: f"{r['chain_tau']:.3f}")
    for k in range(k_steps):
        add(f"P(accept) draft {k + 1}", lambda r, k=k: f"{r['accept_rate'][k]:.3f}")
    for j in range(1, k_steps + 1):
        add(f"tau chain length {j}", lambda r, j=j: f"{r['tau_per_chain_length'][str(j)]:.3f}")
    for g in ("source", "category"):
        keys = sorted({k for r in results.values() for k in r[f"by_{g}"]})
        for key in keys:
            add(f"tau {g}={key}", lambda r, g=g, key=key: (
                f"{r[f'by_{g}'][key]['tau']:.3f}" if key in r[f"by_{g}"] else "-"))
    add("positions evaluated", lambda r: str(r["tree"]["positions"] if r["tree"] else r["positions"]))
    add("samples / tokens", lambda r: f"{r['samples']} / {r['tokens']}")
    add("stopped: end / off-path", lambda r: (
        f"{r['stop_reasons']['end']:.3f} / {r['stop_reasons']['off_path']:.3f}"))
    add("evaluation", lambda r: r["evaluation"])
    add("eval tokens/s", lambda r: f"{r['tokens_per_s']:.0f}")
    return rows


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """Plain-text table, one column per checkpoint."""
    rows = _rows(results)
    names = list(results)
    w0 = max(len(label) for label, _ in rows)
    widths = [max(len(n), *(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
    lines = ["  ".join([" " * w0] + [n.rjust(w) for n, w in zip(names, widths, strict=True)])]
    lines.append("  ".join(["-" * w0] + ["-" * w for w in widths]))
    for label, vals in rows:
        lines.append("  ".join([label.ljust(w0)] + [v.rjust(w) for v, w in zip(vals, widths, strict=True)]))
    first = next(iter(results.values()))
    lines.append("")
    lines.append(first["evaluation_note"])
    return "\n".join(lines)


def format_markdown(results: dict[str, dict[str, Any]]) -> str:
    rows = _rows(results)
    names = list(results)
    lines = ["| metric | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    lines += ["| " + label + " | " + " | ".join(vals) + " |" for label, vals in rows]
    first = next(iter(results.values()))
    lines += ["", f"_{first['evaluation_note']}_", ""]
    return "\n".join(lines)


def write_plot(results: dict[str, dict[str, Any]], path: str | Path) -> None:
    """Two panels: acceptance rate per draft position, and tau against chain length; checkpoints side by side."""
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        ks = list(range(1, len(r["accept_rate"]) + 1))
        a.plot(ks, r["accept_rate"], marker="o", label=name)
        b.plot(ks, [r["tau_per_chain_length"][str(k)] for k in ks], marker="o", label=name)
    a.set(xlabel="draft position", ylabel="P(draft accepted)", title="acceptance per draft position", ylim=(0, 1))
    b.set(xlabel="chain length (steps)", ylabel="tau (accepted + 1)", title="tau against steps")
    from matplotlib.ticker import MaxNLocator

    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_png(fig, path)


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.acceptance",
        description="Offline acceptance length (SGLang convention: accepted drafts + 1) of EAGLE-3 drafters "
                    "on a redraft dataset; several checkpoints are shown side by side.",
    )
    p.add_argument("checkpoints", nargs="+", metavar="CKPT",
                   help="run folder (uses its 'latest'), step-XXXXXXX folder, or SGLang/SpecForge drafter folder")
    p.add_argument("--data", required=True, help="dataset folder written by `python -m extract`")
    p.add_argument("--steps", type=int, default=7, help="draft steps K (chain length / tree depth); default 7")
    p.add_argument("--topk", type=int, default=1, help="SGLang --speculative-eagle-topk; 1 = chain (default)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="SGLang --speculative-num-draft-tokens (tree budget incl. the root); topk 1 forces steps+1")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, exact or lower bound; > 0 = expected acceptance via sum min(p, q)")
    p.add_argument("--split", choices=("val", "all"), default="val",
                   help="val (default): the held-out ids recorded at training (intersection over checkpoints); "
                        "all: every sample")
    p.add_argument("--max-samples", type=int, default=0, help="evaluate only the first N selected samples (0 = all)")
    p.add_argument("--target", default=None,
                   help="target model folder (for the input embedding / lm_head); default: the manifest's target.path")
    p.add_argument("--teacher", choices=("auto", "topk", "last_hidden"), default="auto",
                   help="which stored teacher gives the target's argmax/distribution (auto: topk if stored)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens (B x T_max) per batch; attention memory grows with B x T^2")
    p.add_argument("--tree-positions", type=int, default=64,
                   help="trees only: at most N evenly spaced drafting positions per sample (0 = all)")
    p.add_argument("--json", default=None, help="write all metrics as JSON (a key per checkpoint)")
    p.add_argument("--markdown", default=None, help="write the table as Markdown")
    p.add_argument("--plot", default=None, help="write a PNG: acceptance per draft position and tau against steps")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="drafter dtype (fp32 default)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args_with_config(build_parser(), argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(args.steps, args.topk, args.num_draft_tokens, args.temperature, args.batch_tokens,
                        args.tree_positions, args.teacher)
    settings.check()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    reader = DatasetReader(args.data)
    inspected = [inspect_checkpoint(c, reader) for c in args.checkpoints]  # fit errors before any long run
    indices, split = select_samples(reader, [rec for _, rec in inspected], args.split, args.max_samples)
    log.info("evaluating %d checkpoint(s) on %d samples (%s split) of %s", len(inspected), len(indices), split,
             args.data)
    lm_head = None
    if _teacher_kind(reader, args.teacher) == "last_hidden":
        lm_head = _read_lm_head(reader.manifest, _target_folder(reader.manifest, args.target, args.data), args.device)
    results: dict[str, dict[str, Any]] = {}
    for name, ckpt in zip(_names(args.checkpoints), args.checkpoints, strict=True):
        drafter, folder, record = load_drafter(ckpt, reader, target=args.target, device=args.device, dtype=dtype)
        res = evaluate_drafter(drafter, reader, indices, settings, device=args.device, lm_head=lm_head,
                               progress=not args.no_progress, desc=folder.name)
        res.update(checkpoint=str(ckpt), resolved=str(folder), split=split, step=(record or {}).get("step"))
        results[name] = res
        log.info("%s: tau %.3f (%d positions, %.0f tokens/s)", name, res["tau"], res["positions"],
                 res["tokens_per_s"])
        del drafter
    print(format_table(results), flush=True)
    report = {"data": str(args.data), "split": split, "samples": len(indices),
              "settings": next(iter(results.values()))["settings"], "checkpoints": results}
    if args.json:
        atomic_write_text(args.json, json.dumps(report, indent=2, default=_json_default) + "\n")
    if args.markdown:
        atomic_write_text(args.markdown, format_markdown(results))
    if args.plot:
        write_plot(results, args.plot)
    return report


def _json_default(x: Any) -> Any:
    return str(x)


if __name__ == "__main__":
    try:
        main()
    except (AcceptanceError, ConfigError) as e:
        logging.getLogger(__name__).error("%s", e)
        sys.exit(2)
