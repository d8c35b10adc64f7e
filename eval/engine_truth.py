"""Offline acceptance held against the engine: ``python -m eval.engine_truth CKPT --data DATASET --steps 3``.

Runs ``eval.online`` (vLLM or SGLang: ``--engine``; the dataset's prompt ids, greedy) and ``eval.acceptance``
(the engine walk, by the same engine's rules: SGLang's chain or its top-k tree) on the same samples and fails (exit 1) when tau differs by more than ``--tau-tol`` (relative,
default 2%) or any per-position rate by more than ``--rate-tol`` (absolute, default 0.02). Both
tables and the comparison are printed; ``--json`` keeps everything.

Same tokens on both sides: the offline number walks the stored answers, the engine its own greedy
output. Where they differ (stored answers that were decoded and re-tokenised, or numerics), the
comparison is restricted to the samples whose every answer the engine reproduced token for token,
and the count that differed is printed. Fewer than ``--min-samples`` such samples is a failure, not
a pass on little evidence. The mean over every drafting position (the estimator eval.acceptance
reported before) is shown next to them with its own error, as a diagnostic.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eval import acceptance, online
from eval.acceptance_report import format_table
from eval.engine_walk import POSITION_BUCKETS
from redraft.core import cli as ending
from redraft.core import options
from redraft.core.atomic import atomic_write_text
from redraft.core.config import ConfigError
from redraft.core.options import option

log = logging.getLogger(__name__)


@dataclass
class Tolerances:
    tau_rel: float = 0.02
    rate_abs: float = 0.02
    min_samples: int = 32
    exact_per_request: bool = False  # every compared request: the engine's counts = the walk's, per position
    require_bucket: str | None = None  # a position bucket (engine_walk.POSITION_BUCKETS) the walk must draft in


def compare_requests(by_sample_walk: dict[str, dict[str, Any]], rows: Sequence[dict[str, Any]],
                     same: Sequence[str]) -> dict[str, Any]:
    """Per sample (its requests summed): the engine's verify rounds and accepted tokens per position against the
    walk's."""
    online: dict[str, dict[str, Any]] = {}
    for r in rows:
        sid = str(r["id"]).rsplit("#", 1)[0]
        o = online.setdefault(sid, {"rounds": 0, "accepted_per_pos": [0] * len(r["num_accepted_tokens_per_pos"])})
        o["rounds"] += int(r["num_drafts"])
        o["accepted_per_pos"] = [a + int(b) for a, b in zip(o["accepted_per_pos"], r["num_accepted_tokens_per_pos"],
                                                            strict=True)]
    mismatched = []
    for sid in same:
        off, on = by_sample_walk.get(sid), online.get(sid)
        if off is None or on is None or off["rounds"] != on["rounds"] or \
                list(off["accepted_per_pos"]) != list(on["accepted_per_pos"]):
            mismatched.append({"sample": sid, "offline": off, "online": on})
    return {"compared": len(same), "equal": len(same) - len(mismatched), "mismatched": mismatched}


def compare(off: dict[str, Any], on: dict[str, Any], tol: Tolerances) -> dict[str, Any]:
    """Offline (eval.acceptance result) vs online (eval.online ``same_tokens`` aggregate): errors and verdict."""
    tau_on, tau_off = on["tau"], off["tau"]
    rel = abs(tau_off - tau_on) / tau_on
    rate_err = [abs(a - b) for a, b in zip(off["accept_rate"], on["accept_rate"], strict=True)]
    pp = off["per_position"]
    problems = []
    if rel > tol.tau_rel:
        problems.append(f"tau offline {tau_off:.4f} vs online {tau_on:.4f}: {rel:.2%} > {tol.tau_rel:.0%}")
    for k, e in enumerate(rate_err):
        if e > tol.rate_abs:
            problems.append(f"P(accept) draft {k + 1}: offline {off['accept_rate'][k]:.4f} vs online "
                            f"{on['accept_rate'][k]:.4f} (|diff| {e:.4f} > {tol.rate_abs})")
    return {
        "tau_online": tau_on, "tau_offline": tau_off, "tau_rel_error": rel,
        "rate_online": on["accept_rate"], "rate_offline": off["accept_rate"], "rate_abs_error": rate_err,
        "per_position_tau": pp["tau"], "per_position_rel_error": abs(pp["tau"] - tau_on) / tau_on,
        "per_position_rate": pp["accept_rate"],
        "offline_rounds": off["engine_walk"]["rounds"] if off.get("engine_walk") else None,
        "online_drafts": on["num_drafts"],
        "ok": not problems, "problems": problems,
    }


def bucket_problem(off: dict[str, Any], bucket: str | None) -> str | None:
    """A set meant to reach a position bucket that the walk never drafted in proves nothing about it."""
    if bucket is None:
        return None
    rounds = ((off.get("engine_walk") or {}).get("tau_by_position") or {}).get(bucket, {}).get("rounds")
    return None if rounds else f"no verify round drafted in positions {bucket}: the samples are too short for it"


def lossless_problem(lossless: dict[str, int] | None) -> str | None:
    """The engine's own precondition at T = 0: speculation must not change its greedy output (``eval.online``
    compares the speed requests with and without the drafter); a counter from an engine that breaks it means
    nothing."""
    if not lossless or lossless["equal"] == lossless["of"]:
        return None
    return (f"speculation changed the engine's greedy output: {lossless['of'] - lossless['equal']} of "
            f"{lossless['of']} requests differ from the same engine without the drafter")


def format_comparison(k: int, c: dict[str, Any], same: int, total: int, engine: str = "vllm",
                      shape: str = "chain") -> str:
    rows = [("tau (1 + accepted / verify rounds)", f"{c['tau_online']:.3f}", f"{c['tau_offline']:.3f}",
             f"{c['tau_rel_error']:.2%}")]
    for i, (a, b, e) in enumerate(zip(c["rate_online"], c["rate_offline"], c["rate_abs_error"], strict=True)):
        rows.append((f"P(accept) draft {i + 1}", f"{a:.3f}", f"{b:.3f}", f"{e:.3f}"))
    rows.append(("verify rounds", str(c["online_drafts"]), str(c["offline_rounds"]), ""))
    if c.get("lossless"):
        rows.append(("greedy output = without the drafter", f"{c['lossless']['equal']} of {c['lossless']['of']}", "",
                     ""))
    if c.get("per_request"):
        eq = c["per_request"]
        rows.append(("samples counted the same, per position", "", f"{eq['equal']} of {eq['compared']}", ""))
    rows.append(("diagnostic: per-position mean tau", "", f"{c['per_position_tau']:.3f}",
                 f"{c['per_position_rel_error']:.2%}"))
    head = ("", f"{'SGLang' if engine == 'sglang' else 'vLLM'} online", "offline walk", "|diff|")
    w = [max(len(r[i]) for r in [*rows, head]) for i in range(4)]
    lines = [f"== {shape} K={k}: {same} of {total} samples compared (engine output = stored answer)",
             "  ".join(h.rjust(w[i]) if i else h.ljust(w[0]) for i, h in enumerate(head))]
    lines += ["  ".join(v.rjust(w[i]) if i else v.ljust(w[0]) for i, v in enumerate(r)) for r in rows]
    lines.append("PASS" if c["ok"] else "FAIL: " + "; ".join(c["problems"]))
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    lines = ["| K | samples compared | tau online | tau offline (walk) | rel. error | per-position rates online | "
             "offline | max abs. diff | verify rounds online / offline | per-position mean tau (diagnostic) |",
             "|---|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for k, r in results["by_steps"].items():
        c = r["comparison"]
        lines.append(
            f"| {k} | {r['compared_samples']} of {r['samples']} | {c['tau_online']:.3f} | {c['tau_offline']:.3f} | "
            f"{c['tau_rel_error']:.2%} | {' / '.join(f'{x:.3f}' for x in c['rate_online'])} | "
            f"{' / '.join(f'{x:.3f}' for x in c['rate_offline'])} | {max(c['rate_abs_error']):.3f} | "
            f"{c['online_drafts']} / {c['offline_rounds']} | "
            f"{c['per_position_tau']:.3f} ({c['per_position_rel_error']:.1%}) |")
    return "\n".join(lines) + "\n"


def run(ckpt: str, data: str, steps: Sequence[int], tol: Tolerances, *, max_samples: int = 0,
        speed_samples: int = 8, engine_python: str | None = None, target: str | None = None, engine: str = "vllm",
        topk: int = 1, num_draft_tokens: int | None = None) -> dict[str, Any]:
    from redraft.core.dataset.reader import DatasetReader

    reader = DatasetReader(data)
    indices = online.select(reader, ckpt, "all", max_samples)
    shape = "chain" if topk == 1 else f"tree topk={topk} draft tokens={num_draft_tokens}"
    out: dict[str, Any] = {"checkpoint": ckpt, "data": data, "engine": engine, "topk": topk,
                           "num_draft_tokens": num_draft_tokens, "tolerances": tol.__dict__, "by_steps": {}}
    for k in steps:
        settings = online.OnlineSettings(steps=k, speed_samples=speed_samples, engine_python=engine_python,
                                         engine=engine, topk=topk, num_draft_tokens=num_draft_tokens)
        on = online.measure(ckpt, reader, indices, settings, target=target)
        print(online.format_table(on), flush=True)
        same = on["same_as_data_samples"]
        differed = len(indices) - len(same)
        print(f"-- {differed} of {len(indices)} samples: the engine's greedy output differs from the stored answer "
              "(compared on the others)", flush=True)
        entry: dict[str, Any] = {"samples": len(indices), "compared_samples": len(same), "differed": differed,
                                 "online": {kk: v for kk, v in on.items() if kk != "per_request"},
                                 "online_per_request": on["per_request"]}
        if len(same) < tol.min_samples:
            entry["comparison"] = None
            entry["error"] = (f"only {len(same)} samples have engine output = stored answer; at least "
                              f"{tol.min_samples} are needed")
            out["by_steps"][str(k)] = entry
            continue
        off = acceptance.evaluate(ckpt, reader, steps=k, indices=same, target=target, engine=engine, topk=topk,
                                  num_draft_tokens=num_draft_tokens)
        print(format_table({f"offline K={k}": off}), flush=True)
        c = compare(off, on["same_tokens"], tol)
        c["lossless"] = on.get("lossless")
        same_ids = [reader.sample_ids[i] for i in same]
        c["per_request"] = compare_requests(off["by_sample_walk"], on["per_request"], same_ids)
        eq = c["per_request"]
        if tol.exact_per_request and eq["mismatched"]:
            first = eq["mismatched"][0]
            c["problems"].append(f"{len(eq['mismatched'])} of {eq['compared']} samples counted differently, e.g. "
                                 f"{first['sample']}: online {first['online']}, offline {first['offline']}")
            c["ok"] = False
        if problem := lossless_problem(c["lossless"]):
            c["problems"].append(problem)
            c["ok"] = False
        if problem := bucket_problem(off, tol.require_bucket):
            c["problems"].append(problem)
            c["ok"] = False
        entry["offline"] = {kk: v for kk, v in off.items() if not kk.startswith("by_")}
        entry["comparison"] = c
        print(format_comparison(k, c, len(same), len(indices), engine, shape), flush=True)
        out["by_steps"][str(k)] = entry
    out["ok"] = all(e.get("comparison") and e["comparison"]["ok"] for e in out["by_steps"].values())
    return out


@dataclass(kw_only=True)
class EngineTruthOptions:
    """The options of python -m eval.engine_truth (redraft.core.options)."""

    checkpoint: str = option(help="run or step folder (exported to the engine's layout)", group="inputs",
                             positional=True, metavar="CKPT")
    data: str = option(help="dataset folder (prompts + stored answers + features)", group="inputs")
    max_samples: int = option(0, "first N samples (0 = all)", group="inputs")
    target: str | None = option(None, "target folder (default: the manifest's)", group="inputs")
    engine: str = option("vllm", "vllm or sglang (SGLang's engine; on a CPU the SGLang CPU venv)", group="engine",
                         choices=online.ENGINES)
    engine_python: str | None = option(None, "interpreter with the engine (default: this one if it has it, else the "
                                             "engine's CPU venv)", group="engine")
    steps: list[int] = option([], "K, repeatable or comma-separated (default 3); each K is one engine run",
                              group="speculation")
    topk: int = option(1, "--engine sglang: --speculative-eagle-topk (1 = a chain; > 1 = a tree)",
                       group="speculation")
    num_draft_tokens: int | None = option(None, "--engine sglang, --topk > 1: tokens verified per round, the root "
                                                "included", group="speculation")
    speed_samples: int = option(8, "requests also run without the drafter (tokens/s)", group="speculation")
    min_samples: int = option(32, "fail when fewer samples have engine output = stored answer", group="tolerances")
    tau_tol: float = option(0.02, "relative tau tolerance", group="tolerances")
    rate_tol: float = option(0.02, "absolute per-position tolerance", group="tolerances")
    exact_per_request: bool = option(False, "also fail unless every compared sample's drafts and accepted tokens per "
                                            "position are the engine's exactly", group="tolerances")
    require_bucket: str | None = option(None, "also fail unless the offline walk counts verify rounds drafted in this "
                                              "position bucket (0-4K, 4K-16K, 16K+): a long set that is long",
                                        group="tolerances")
    json: str | None = option(None, "write everything as JSON", group="output")
    markdown: str | None = option(None, "write the side-by-side table as Markdown", group="output")


PROG = "python -m eval.engine_truth"
DESCRIPTION = ("Hold eval.acceptance's offline tau against the engine's (vLLM or SGLang) online tau on the same "
               "prompts; exit 1 when they differ by more than the tolerances.")


def parse_options(argv: Sequence[str] | None) -> EngineTruthOptions:
    """The command line (and its --config YAML) as EngineTruthOptions (redraft.core.options)."""
    return options.parse(EngineTruthOptions, argv, prog=PROG, description=DESCRIPTION, section="truth")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(EngineTruthOptions, prog=PROG, description=DESCRIPTION)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_options(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.require_bucket is not None and args.require_bucket not in dict(POSITION_BUCKETS):
        raise ConfigError(f"--require-bucket {args.require_bucket!r}: not a position bucket "
                          f"({', '.join(name for name, _ in POSITION_BUCKETS)})")
    tol = Tolerances(args.tau_tol, args.rate_tol, args.min_samples, args.exact_per_request, args.require_bucket)
    res = run(args.checkpoint, args.data, args.steps or [3], tol, max_samples=args.max_samples,
              speed_samples=args.speed_samples, engine_python=args.engine_python, target=args.target,
              engine=args.engine, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=2) + "\n")
    if args.markdown:
        atomic_write_text(args.markdown, markdown(res) if all(e.get("comparison") for e in res["by_steps"].values())
                          else "comparison incomplete\n")
    for k, e in res["by_steps"].items():
        if e.get("error"):
            log.error("K=%s: %s", k, e["error"])
    print("ENGINE TRUTH: " + ("PASS" if res["ok"] else "FAIL"), flush=True)
    return 0 if res["ok"] else 1


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("eval.engine_truth"))


if __name__ == "__main__":
    sys.exit(cli())
