"""Offline acceptance length of EAGLE-3 drafters on a redraft dataset (what serving would accept).

    python -m eval.acceptance CKPT [CKPT ...] --data SHARDS [--steps 7] [--topk 1]
        [--num-draft-tokens N] [--temperature 0] [--split val|all] [--max-samples N]
        [--target PATH] [--batch-tokens N] [--json PATH] [--markdown PATH] [--plot PATH]

CKPT is a training run folder (``OUT/``, its ``latest`` step is used), a ``step-XXXXXXX``
checkpoint, or a foreign SGLang/SpecForge drafter folder (config.json + model.safetensors;
its layer ids are read in SGLang's convention for the dataset's target architecture).

tau is the engine's number: tokens per verify round, 1 + accepted drafts / verify rounds, over the
positions an engine visits when it answers each prompt (start of the answer, accept n, move n + 1,
stop at the end of turn or ``--max-new-tokens``); the rules and the engine source each follows
are in :mod:`eval.engine_walk`. The mean over *every* drafting position is kept as a diagnostic
under its own name (``per_position``): it reads high once acceptance is substantial, because
positions inside accepted runs are easier and engines never draft from them. The drafting maths
is in :mod:`eval.simulate`; this module loads, batches, aggregates and reports.

Exactness comes from the data: the numbers are exact (up to numerics) only when every assistant
token is the target's argmax at the previous position; otherwise the agreeing fraction is
reported and the numbers are called an estimate. :func:`evaluate` is the library entry point (the trainer's periodic
validation can call it); importing this module has no side effects.

Split: by default the held-out validation ids recorded in each checkpoint's redraft.json. With
several checkpoints the intersection of their recorded splits is used, so every checkpoint is
scored on samples none of them trained on; drafters without a record (imported ones) do not
constrain it, and if none has one every sample is used, with a warning.

Temperature > 0 (reported as "expected", per position; there is no engine walk): both engines
draft greedily and by default verify against the target alone, accepting draft d with probability
p_T(d) (vLLM ``v1/sample/rejection_sampler.py``, ``draft_sample_method="greedy"`` -> no draft probs,
``draft_prob = 1``; SGLang ``speculative/eagle_utils.py::eagle_sample`` ->
``tree_speculative_sampling_target_only`` with zero draft probs). ``--rejection-sampling`` gives the
opt-in rule sum_v min(p, q) (vLLM ``draft_sample_method="probabilistic"``, SGLang
``--speculative-use-rejection-sampling``). SGLang verifies greedily on CPU whatever the temperature
(``_verify_uses_greedy``: ``is_cpu``). Approximations: the chain follows the data tokens rather than
a sampled path, and a top-k teacher is the stored top-k renormalised at temperature T (a teacher
from ``last_hidden`` is exact over the full vocabulary).
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

from eval import engine_walk as walk
from eval import simulate as sim
from eval.acceptance_report import format_markdown, format_table, write_plot
from eval.evaluation_inputs import (
    AcceptanceError,
    inspect_checkpoint,
    load_drafter,
    make_batches,
    read_lm_head,
    select_samples,
    target_folder,
    teacher_for_batch,
    teacher_kind,
)
from redraft.core import cli as ending
from redraft.core import options
from redraft.core.atomic import atomic_write_text
from redraft.core.dataset.batch import collate
from redraft.core.dataset.reader import DatasetReader
from redraft.core.layers import ENGINES
from redraft.core.options import option

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- aggregation


@dataclass
class _Group:
    steps: int
    positions: int = 0
    accept_sum: torch.Tensor = field(default=None)  # type: ignore[assignment]
    tree_positions: int = 0
    tree_accepted: float = 0.0
    walk: walk.WalkStats | None = None  # the engine walk (chain, or tree with --topk > 1); None at T > 0

    def __post_init__(self) -> None:
        if self.accept_sum is None:
            self.accept_sum = torch.zeros(self.steps, dtype=torch.float64)

    def summary(self, tree: bool) -> dict[str, Any]:
        mean = (self.accept_sum / max(self.positions, 1)).tolist()
        acc = self.tree_accepted / max(self.tree_positions, 1) if tree else sum(mean)
        out = {"positions": self.positions, "per_position_tau": 1.0 + acc}
        if self.walk is not None:
            out.update(tau=self.walk.tau, accepted_drafts=self.walk.tau - 1.0, rounds=self.walk.rounds)
        else:
            out.update(tau=1.0 + acc, accepted_drafts=acc)
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
    engine: str | None = None  # None: vllm for chains, sglang for trees
    rejection_sampling: bool = False
    max_new_tokens: int = 0

    def check(self) -> None:
        if self.engine is None:
            self.engine = "sglang" if self.topk > 1 else "vllm"
        if self.engine == "vllm" and self.topk > 1:
            raise AcceptanceError("--engine vllm with --topk > 1: vLLM drafts trees from a static "
                                  "speculative_token_tree, not SGLang's dynamic top-k tree simulated here; use "
                                  "--engine sglang")
        if self.engine not in ENGINES:
            raise AcceptanceError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.max_new_tokens < 0:
            raise AcceptanceError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
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


def _evaluation_label(temperature: float, agree: int, counted: int, unverifiable: int) -> tuple[str, str]:
    """(label, note) from the data itself: exact only where every counted assistant token is the target's argmax."""
    if temperature > 0:
        return "expected", (f"expected acceptance per drafting position at temperature {temperature} along the "
                            "data path (no engine walk at T > 0)")
    frac = agree / counted if counted else 0.0
    tail = (f"; {unverifiable} draft(s) past the data's last row counted rejected (the engine verifies them)"
            if unverifiable else "")
    if counted and agree == counted:
        return "exact", (f"exact: all {counted} assistant tokens are the target's argmax at the previous position "
                         f"(its own greedy output){tail}")
    return "estimate", (f"estimate: {agree} of {counted} assistant tokens ({frac:.1%}) are the target's argmax; "
                        f"where the data leaves it, chains are cut (a lower bound there){tail}")


def _sample_rows(res: Any, bsz: int, seq: int, steps: int) -> torch.Tensor:
    """[B, T, K] drafts (target ids) at the simulated positions, -1 elsewhere."""
    full = torch.full((bsz, seq, steps), -1, dtype=torch.int64)
    full[res.sample.cpu(), res.position.cpu()] = res.drafts.cpu().to(torch.int64)
    return full


@torch.no_grad()
def evaluate_drafter(
    drafter: Any, reader: Any, indices: Sequence[int], settings: Settings, *, device: str = "cpu",
    lm_head: torch.Tensor | None = None, progress: bool = True, desc: str = "acceptance",
) -> dict[str, Any]:
    """Simulate ``drafter`` on the samples ``indices`` of ``reader``; returns the metrics dict."""
    from tqdm import tqdm

    settings.check()
    kind = teacher_kind(reader, settings.teacher)
    if kind == "last_hidden" and lm_head is None:
        raise AcceptanceError("teacher 'last_hidden' needs lm_head (evaluate() reads it from the target)")
    k_steps, tree = settings.steps, settings.topk > 1
    greedy = settings.temperature <= 0
    total = _Group(k_steps)
    groups: dict[str, dict[str, _Group]] = {"source": {}, "category": {}}
    reasons = torch.zeros(4, dtype=torch.float64)
    tree_reasons = torch.zeros(4, dtype=torch.float64)
    walk_len = {j: walk.WalkStats(j) for j in range(1, k_steps + 1)} if greedy and not tree else {}
    by_sample_walk: dict[str, dict[str, Any]] = {}  # what the engine counts for each sample's requests
    agree = counted = 0
    tokens = 0
    max_new = settings.max_new_tokens or None
    t0 = time.perf_counter()
    batches = make_batches(indices, reader.lengths, settings.batch_tokens)
    for chunk in tqdm(batches, desc=desc, unit="batch", disable=not progress, leave=False):
        batch = collate([reader.get(i) for i in chunk]).to(device, dtype=next(drafter.parameters()).dtype)
        tokens += batch.num_tokens
        argmax, p = teacher_for_batch(batch, drafter, kind, settings.temperature, lm_head)
        common = dict(input_ids=batch.input_ids, aux_hidden=batch.aux_hidden,
                      attention_mask=batch.attention_mask, loss_mask=batch.loss_mask)
        if not greedy:
            rule = "rejection" if settings.rejection_sampling else "target_only"
            res = sim.simulate_chain_sampled(drafter, teacher_p=p, temperature=settings.temperature,
                                             steps=k_steps, rule=rule, **common)
            step0 = None
        else:
            res, step0 = sim.simulate_chain_greedy(drafter, target_ids=argmax, steps=k_steps, **common)
        tres = None
        bsz, seq = batch.input_ids.shape
        where = sim.drafting_positions(batch.loss_mask, batch.attention_mask)
        if tree:  # every drafting position: the walk visits positions that depend on earlier acceptance
            tres = sim.simulate_tree(drafter, step0, input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                                     target_ids=argmax, positions=where, topk=settings.topk,
                                     num_draft_tokens=settings.num_draft_tokens, steps=k_steps)
            sub = sim.tree_positions(where, settings.tree_positions).cpu()  # the per-position diagnostic's subset
            keep = sub[tres.sample.cpu(), tres.position.cpu()]
            tree_reasons += torch.bincount(tres.reason.cpu()[keep], minlength=4).double()
            tree_acc = torch.full((bsz, seq), -1, dtype=torch.int64)
            tree_acc[tres.sample.cpu(), tres.position.cpu()] = tres.accepted.cpu().to(torch.int64)
        reasons += torch.bincount(res.reason.cpu(), minlength=4).double()
        acc = res.accept_prob.double().cpu()
        rows = res.sample.cpu()
        ids_c, lm_c, am_c = batch.input_ids.cpu(), batch.loss_mask.cpu(), batch.attention_mask.cpu()
        argmax_c = argmax.cpu()
        drafts = _sample_rows(res, bsz, seq, k_steps) if greedy and not tree else None
        for r, idx in enumerate(chunk):
            sel = rows == r
            n = int(sel.sum())
            s = acc[sel].sum(0)
            length = int(am_c[r].sum())
            a_r, c_r = walk.argmax_agreement(ids_c[r, :length], argmax_c[r, :length], lm_c[r, :length])
            agree, counted = agree + a_r, counted + c_r
            w = None
            if tree:
                w = walk.walk_accepted(tree_acc[r, :length], ids_c[r, :length], argmax_c[r, :length],
                                       lm_c[r, :length], k_steps, max_new_tokens=max_new)
            elif greedy:
                w = walk.walk_chain(drafts[r, :length], ids_c[r, :length], argmax_c[r, :length], lm_c[r, :length],
                                    max_new_tokens=max_new)
                for j in range(1, k_steps):
                    walk_len[j] += walk.walk_chain(drafts[r, :length, :j], ids_c[r, :length], argmax_c[r, :length],
                                                   lm_c[r, :length], max_new_tokens=max_new)
                walk_len[k_steps] += w
            if w is not None:
                by_sample_walk[reader.sample_ids[idx]] = {"rounds": w.rounds, "accepted_per_pos": w.accepted_per_pos,
                                                          "output_tokens": w.output_tokens}
            keys = {"source": reader.sources[idx] or "-", "category": reader.categories[idx] or "-"}
            targets = [total] + [groups[g].setdefault(v, _Group(k_steps)) for g, v in keys.items()]
            t_n, t_sum = 0, 0.0
            if tres is not None:
                tsel = (tres.sample.cpu() == r) & keep
                t_n, t_sum = int(tsel.sum()), float(tres.accepted.cpu()[tsel].sum())
            for g in targets:
                g.positions += n
                g.accept_sum += s
                g.tree_positions += t_n
                g.tree_accepted += t_sum
                if w is not None:
                    if g.walk is None:
                        g.walk = walk.WalkStats(k_steps)
                    g.walk += w
    seconds = time.perf_counter() - t0
    out = _summarise(total, groups, reasons, tree_reasons, settings, reader, len(indices), tokens, seconds,
                     walk_len, agree, counted)
    out["by_sample_walk"] = by_sample_walk
    return out


def _summarise(total: _Group, groups: dict[str, dict[str, _Group]], reasons: torch.Tensor,
               tree_reasons: torch.Tensor, settings: Settings, reader: Any, samples: int, tokens: int,
               seconds: float, walk_len: dict[int, walk.WalkStats], agree: int, counted: int) -> dict[str, Any]:
    k_steps, tree = settings.steps, settings.topk > 1
    n = max(total.positions, 1)
    mean = (total.accept_sum / n).tolist()  # P(draft k accepted) over every drafting position
    cond = [mean[0]] + [mean[k] / mean[k - 1] if mean[k - 1] > 0 else 0.0 for k in range(1, k_steps)]
    pp_len = {str(j): 1.0 + sum(mean[:j]) for j in range(1, k_steps + 1)}
    engine_walk = total.walk.summary() if total.walk is not None else None
    label, note = _evaluation_label(settings.temperature, agree, counted,
                                    engine_walk["unverifiable_drafts"] if engine_walk else 0)
    frac = (reasons / max(float(reasons.sum()), 1.0)).tolist()
    per_position = {
        "tau": pp_len[str(k_steps)],
        "accepted_drafts": sum(mean),
        "accept_rate": mean,
        "conditional_accept_rate": cond,
        "tau_per_chain_length": pp_len,
        "positions": total.positions,
    }
    out: dict[str, Any] = {
        "settings": {"steps": k_steps, "topk": settings.topk, "num_draft_tokens": settings.num_draft_tokens,
                     "temperature": settings.temperature, "teacher": teacher_kind(reader, settings.teacher),
                     "tree_positions_per_sample": settings.tree_positions if tree else None,
                     "engine": settings.engine, "rejection_sampling": settings.rejection_sampling,
                     "max_new_tokens": settings.max_new_tokens or None},
        "samples": samples,
        "tokens": tokens,
        "positions": total.positions,
        "engine_walk": engine_walk,
        "per_position": per_position,
        "stop_reasons": {name: frac[code] for code, name in sim.REASONS.items()},
        "data_argmax_agreement": {"agreeing": agree, "counted": counted,
                                  "fraction": agree / counted if counted else 0.0},
        "evaluation": label,
        "evaluation_note": note,
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "positions_per_s": total.positions / max(seconds, 1e-9),
    }
    if engine_walk is not None:
        out["tau_estimator"] = "engine_walk"
        tau, rates = engine_walk["tau"], engine_walk["accept_rate"]
        out["tau_per_chain_length"] = ({str(j): w.tau for j, w in walk_len.items()} if walk_len
                                       else {str(k_steps): tau})
    else:
        out["tau_estimator"] = "per_position_expected"
        tau, rates = per_position["tau"], mean
        out["tau_per_chain_length"] = pp_len
    out["chain_tau"] = walk_len[k_steps].tau if walk_len else per_position["tau"]
    if tree:
        tfrac = (tree_reasons / max(float(tree_reasons.sum()), 1.0)).tolist()
        t_acc = total.tree_accepted / max(total.tree_positions, 1)
        out["tree"] = {"positions": total.tree_positions, "per_position_tau": 1.0 + t_acc,
                       "tau": tau, "engine_walk": engine_walk,
                       "stop_reasons": {name: tfrac[code] for code, name in sim.REASONS.items()}}
        out["chain_tau"] = per_position["tau"]  # trees: the chain is simulated per position only
        out["per_position"]["tree_tau"] = 1.0 + t_acc
    else:
        out["tree"] = None
    out["tau"], out["accepted_drafts"], out["accept_rate"] = tau, tau - 1.0, rates
    if settings.engine == "sglang" and engine_walk is not None:
        out["sglang_request_accept_length"] = engine_walk["sglang_request_accept_length"]
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
    engine: str | None = None,
    rejection_sampling: bool = False,
    max_new_tokens: int = 0,
) -> dict[str, Any]:
    """Load one checkpoint and evaluate it on ``reader`` (its recorded split unless ``indices`` is given)."""
    settings = Settings(steps, topk, num_draft_tokens, temperature, batch_tokens, tree_positions, teacher,
                        engine, rejection_sampling, max_new_tokens)
    settings.check()
    drafter, folder, record = load_drafter(checkpoint_path, reader, target=target, device=device, dtype=dtype)
    if drafter.config.parallel and (settings.topk > 1 or settings.engine != "vllm"):
        raise AcceptanceError(f"{checkpoint_path}: a p-eagle drafter is served by vLLM's parallel drafting only (one "
                              "chain, no tree; SGLang 0.5.23 has none): use --engine vllm and --topk 1")
    if drafter.config.block and (settings.topk > 1 or settings.engine != "vllm"):
        raise AcceptanceError(f"{checkpoint_path}: a dflash drafter is served by vLLM's DFlash proposer only (one "
                              "block, no tree; SGLang 0.5.23 serves DFlash on CUDA, NPU and XPU, not on this CPU): use "
                              "--engine vllm and --topk 1")
    split_desc = "given"
    if indices is None:
        indices, split_desc = select_samples(reader, [record], split, max_samples)
    lm_head = None
    if teacher_kind(reader, teacher) == "last_hidden":
        lm_head = read_lm_head(reader.manifest, target_folder(reader.manifest, target, str(reader.root)), device)
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


# ----------------------------------------------------------------------------- CLI


@dataclass(kw_only=True)
class AcceptanceOptions:
    """The options of python -m eval.acceptance (redraft.core.options: --help, YAML keys and values)."""

    checkpoints: list[str] = option(help="run folder (uses its 'latest'), step-XXXXXXX folder, or SGLang/SpecForge "
                                         "drafter folder; several side by side", group="inputs", positional=True,
                                    metavar="CKPT")
    data: str = option(help="dataset folder written by `python -m extract`", group="inputs")
    split: str = option("val", "val: the held-out ids recorded at training (intersection over checkpoints); all: "
                               "every sample", group="inputs", choices=("val", "all"))
    max_samples: int = option(0, "evaluate only the first N selected samples (0 = all)", group="inputs")
    target: str | None = option(None, "target model folder (for the input embedding / lm_head); default: the "
                                      "manifest's target.path", group="inputs")
    teacher: str = option("auto", "which stored teacher gives the target's argmax/distribution (auto: topk if "
                                  "stored)", group="inputs", choices=("auto", "topk", "last_hidden"))
    steps: int = option(7, "draft steps K (chain length / tree depth)", group="speculation")
    topk: int = option(1, "SGLang --speculative-eagle-topk; 1 = chain", group="speculation")
    num_draft_tokens: int | None = option(None, "SGLang --speculative-num-draft-tokens (tree budget incl. the root); "
                                                "topk 1 forces steps+1", group="speculation")
    temperature: float = option(0.0, "0 = greedy: the engine walk, exact where the data is the target's greedy "
                                     "output; > 0 = expected acceptance per position (target-only verification of "
                                     "greedy drafts)", group="speculation")
    engine: str | None = option(None, "whose rules and counters (default: vllm for chains, sglang for trees): "
                                      "sglang adds its per-request meta_info accept length (completion tokens / "
                                      "verify rounds) and is the only tree rule simulated (SGLang's dynamic top-k "
                                      "tree and draft KV slots)", group="speculation", choices=ENGINES)
    rejection_sampling: bool = option(False, "T > 0: the opt-in speculative-sampling rule sum min(p, q) (vLLM "
                                             "draft_sample_method=probabilistic, SGLang "
                                             "--speculative-use-rejection-sampling) instead of the default "
                                             "target-only rule p_T(draft)", group="speculation")
    max_new_tokens: int = option(0, "the engine's max_tokens: the walk stops after this many answer tokens (0 = at "
                                    "the end of each stored answer)", group="speculation")
    batch_tokens: int = option(8192, "padded tokens (B x T_max) per batch; attention memory grows with B x T^2",
                               group="compute")
    tree_positions: int = option(64, "trees only: the per-position diagnostic uses at most N evenly spaced "
                                     "drafting positions per sample (0 = all); the engine walk uses the positions "
                                     "it visits", group="compute")
    device: str = option("cpu", "cpu or cuda[:i]", group="compute")
    dtype: str = option("fp32", "drafter dtype", group="compute", choices=("fp32", "bf16"))
    json: str | None = option(None, "write all metrics as JSON (a key per checkpoint)", group="output")
    markdown: str | None = option(None, "write the table as Markdown", group="output")
    plot: str | None = option(None, "write a PNG: acceptance per draft position and tau against steps",
                              group="output")
    no_progress: bool = option(False, "hide the progress bar", group="output")


PROG = "python -m eval.acceptance"
DESCRIPTION = ("Offline acceptance length of EAGLE-3 drafters on a redraft dataset, in the engine's convention "
               "(1 + accepted drafts / verify rounds over the positions an engine visits); the mean over every "
               "drafting position is shown as a diagnostic. Several checkpoints side by side.")


def parse_options(argv: Sequence[str] | None) -> AcceptanceOptions:
    """The command line (and its --config YAML) as AcceptanceOptions (redraft.core.options)."""
    return options.parse(AcceptanceOptions, argv, prog=PROG, description=DESCRIPTION, section="eval")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(AcceptanceOptions, prog=PROG, description=DESCRIPTION)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_options(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(args.steps, args.topk, args.num_draft_tokens, args.temperature, args.batch_tokens,
                        args.tree_positions, args.teacher, args.engine, args.rejection_sampling,
                        args.max_new_tokens)
    settings.check()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    reader = DatasetReader(args.data).require_samples()
    inspected = [inspect_checkpoint(c, reader) for c in args.checkpoints]  # fit errors before any long run
    indices, split = select_samples(reader, [rec for _, rec in inspected], args.split, args.max_samples)
    log.info("evaluating %d checkpoint(s) on %d samples (%s split) of %s", len(inspected), len(indices), split,
             args.data)
    lm_head = None
    if teacher_kind(reader, args.teacher) == "last_hidden":
        lm_head = read_lm_head(reader.manifest, target_folder(reader.manifest, args.target, args.data), args.device)
    results: dict[str, dict[str, Any]] = {}
    for name, ckpt in zip(_names(args.checkpoints), args.checkpoints, strict=True):
        drafter, folder, record = load_drafter(ckpt, reader, target=args.target, device=args.device, dtype=dtype)
        res = evaluate_drafter(drafter, reader, indices, settings, device=args.device, lm_head=lm_head,
                               progress=not args.no_progress, desc=folder.name)
        res.update(checkpoint=str(ckpt), resolved=str(folder), split=split, step=(record or {}).get("step"))
        results[name] = res
        log.info("%s: tau %.3f (%s; %d drafting positions, %.0f tokens/s)", name, res["tau"], res["tau_estimator"],
                 res["positions"],
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


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("eval.acceptance"))


if __name__ == "__main__":
    sys.exit(cli())
