"""Regeneration tokens/s of each engine, side by side on the same prompts (a measurement, not a test).

    OMP_NUM_THREADS=2 python benchmarks/regen_throughput.py --json regen-throughput.json
    python benchmarks/regen_throughput.py --engines hf:8,hf:32,vllm,server --prompts 96 --repeats 3

Every engine gets the same prompts (first user turns rendered by the target's chat template, exactly
what ``extract --regenerate`` sends), greedy, the same max new tokens and stop ids, through the same
regenerators the extraction uses (``extract.regen_engines``), in interleaved repeats (engine A, B, C,
then A, B, C again) so that load from elsewhere on the machine hits them alike. Timed: one call with
every prompt, as one regenerated turn; engine start-up is timed apart. Reported per engine: generated
tokens per second (median over repeats, min and max), the ratio to the first engine (``hf:8`` is
today's path: transformers generate, batches of 8), how many replies equal the first engine's token for
token, whether its repeats agree with each other, and the start-up time.

Engines: ``hf:B`` (transformers, batches of B), ``vllm`` (vLLM through ``redraft.engines.vllm``: in-process
where vllm is installed, else the vLLM CPU venv), ``server`` (a vLLM server from the same venv, started
here on 127.0.0.1, asked by ``redraft.engines.server`` with ``--concurrency`` requests in flight; or
``--server-url`` for one already running, e.g. SGLang on a GPU node).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from redraft.core import cli as ending

log = logging.getLogger("bench.regen_throughput")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="target model (built-in name or folder)")
    p.add_argument("--data", default="chitchat", help="prompts: built-in name (chitchat, mtbench) or file")
    p.add_argument("--prompts", type=int, default=96, help="how many first user turns (default 96)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="budget per reply (default 128)")
    p.add_argument("--engines", default="hf:8,hf:32,vllm,server",
                   help="comma-separated, the first is the baseline: hf:B (batch B), vllm, server "
                        "(default hf:8,hf:32,vllm,server)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats per engine (default 2)")
    p.add_argument("--concurrency", type=int, default=64, help="server: requests in flight (default 64)")
    p.add_argument("--server-url", default="", help="server: use this running server instead of starting one")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="vLLM KV cache in GiB (default 2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype (float32)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                   help="CPU threads for every engine (default $OMP_NUM_THREADS or 2)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--markdown", default=None, help="write the table here")
    return p.parse_args(argv)


def load_prompts(tokenizer: Any, data: str, n: int, max_length: int) -> list[list[int]]:
    """The first user turn of the first n records, rendered as regeneration renders it."""
    from extract.chat import encode_prompt
    from extract.records import read_records
    from redraft.catalog.builtin import resolve_data

    records = read_records([resolve_data(data)], require_assistant=False).records
    prompts = []
    for r in records:
        system = [m for m in r.messages if m.role == "system"]
        users = [m for m in r.messages if m.role == "user"]
        if not users:
            continue
        ids = encode_prompt(tokenizer, system + users[:1])
        if len(ids) < max_length // 2:
            prompts.append(ids)
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise SystemExit(f"{data}: only {len(prompts)} usable prompts, asked for {n}")
    return sorted(prompts, key=len)  # as extract.regenerate orders a turn


def _engines(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        if not (name in ("vllm", "server") or (name.startswith("hf:") and name[3:].isdigit() and int(name[3:]) > 0)):
            raise SystemExit(f"--engines: unknown engine {name!r} (hf:B, vllm, server)")
    if len(set(names)) != len(names) or not names:
        raise SystemExit(f"--engines: give each engine once: {spec!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engines' subprocesses inherit it
    import torch

    torch.set_num_threads(args.threads)
    from extract.backends.base import GenerationConfig
    from extract.backends.hf import HFTarget
    from extract.chat import stop_token_ids
    from extract.regen_engines import BackendRegenerator, ServerRegenerator, VLLMRegenerator
    from redraft.catalog.builtin import resolve_target
    from redraft.engines.vllm import EngineSettings, VLLMServer

    names = _engines(args.engines)
    target = resolve_target(args.target)
    max_length = 2048
    t0 = time.perf_counter()
    hf = HFTarget(str(target), name=args.target, dtype=args.dtype, device="cpu")
    hf_load = time.perf_counter() - t0
    prompts = load_prompts(hf.tokenizer, args.data, args.prompts, max_length)
    stops = stop_token_ids(hf.tokenizer)
    budgets = [args.max_new_tokens] * len(prompts)
    gen = GenerationConfig(temperature=0.0, max_new_tokens=args.max_new_tokens)
    log.info("%d prompts (%d-%d tokens), %d new tokens at most, engines %s, %d repeats, %d threads", len(prompts),
             len(prompts[0]), len(prompts[-1]), args.max_new_tokens, names, args.repeats, args.threads)
    kv = int(args.kv_cache_gb * (1 << 30))
    results: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        regens: dict[str, Any] = {}
        for name in names:
            t0 = time.perf_counter()
            if name.startswith("hf:"):
                regens[name] = (BackendRegenerator(hf), replace(gen, batch_size=int(name[3:])))
                load = hf_load
            elif name == "vllm":
                r = VLLMRegenerator(target, dtype=args.dtype, max_model_len=max_length, kv_cache_bytes=kv)
                stack.callback(r.close)
                load = r.start().load_seconds
                regens[name] = (r, gen)
            else:
                url = args.server_url
                if not url:
                    server = stack.enter_context(VLLMServer(
                        EngineSettings(target=str(target), dtype=args.dtype, max_model_len=max_length,
                                       kv_cache_bytes=kv)))
                    url = server.url
                r = ServerRegenerator(url, concurrency=args.concurrency)
                r.server.describe()
                regens[name] = (r, gen)
                load = time.perf_counter() - t0
            results[name] = {"load_seconds": round(load, 1), "runs": []}
        outputs: dict[str, list[list[list[int]]]] = {name: [] for name in names}
        for rep in range(args.repeats):
            for name in names:
                regen, g = regens[name]
                t0 = time.perf_counter()
                out = regen.generate(prompts, budgets, g, stops)
                secs = time.perf_counter() - t0
                tokens = sum(len(o) for o in out)
                outputs[name].append(out)
                results[name]["runs"].append({"seconds": round(secs, 2), "tokens": tokens,
                                              "tokens_per_s": round(tokens / secs, 2)})
                log.info("repeat %d/%d %-8s %6d tokens in %6.1f s: %7.1f tokens/s", rep + 1, args.repeats, name,
                         tokens, secs, tokens / secs)
        if "server" in regens:
            results["server"]["engine"] = regens["server"][0].describe()
        if "vllm" in regens:
            results["vllm"]["engine"] = regens["vllm"][0].describe()
    base = names[0]
    base_rate = statistics.median(r["tokens_per_s"] for r in results[base]["runs"])
    for name in names:
        rates = [r["tokens_per_s"] for r in results[name]["runs"]]
        res = results[name]
        res["tokens_per_s"] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
        res["ratio_to_baseline"] = round(res["tokens_per_s"]["median"] / base_rate, 2)
        res["same_as_baseline"] = sum(a == b for a, b in zip(outputs[name][0], outputs[base][0], strict=True))
        res["repeats_agree"] = all(o == outputs[name][0] for o in outputs[name][1:])
        res["stopped"] = sum(1 for o in outputs[name][0] if o and o[-1] in stops)
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report = {"target": args.target, "data": args.data, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "greedy": True, "repeats": args.repeats, "threads": args.threads, "dtype": args.dtype,
              "baseline": base, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                            "load_1min_at_end": load1},
              "engines": results}
    table = format_table(report)
    print()
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


def format_table(report: dict[str, Any]) -> str:
    n = report["prompts"]
    lines = [f"{n} {report['data']} prompts, greedy, <= {report['max_new_tokens']} new tokens, "
             f"{report['repeats']} interleaved repeats, {report['threads']} thread(s) per engine, {report['dtype']}; "
             f"1-min load at the end {report['machine']['load_1min_at_end']:.1f} on {report['machine']['cpus']} CPUs",
             "",
             f"| engine | tokens/s (median) | min / max | x {report['baseline']} | tokens | replies = "
             f"{report['baseline']} | repeats agree | start-up s |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for name, r in report["engines"].items():
        t = r["tokens_per_s"]
        lines.append(f"| {name} | {t['median']:.1f} | {t['min']:.1f} / {t['max']:.1f} | {r['ratio_to_baseline']:.2f} "
                     f"| {r['runs'][0]['tokens']} | {r['same_as_baseline']}/{n} | "
                     f"{'yes' if r['repeats_agree'] else 'no'} | {r['load_seconds']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.regen_throughput")))
