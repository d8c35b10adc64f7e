"""``--backend sglang`` against ``--backend hf``, every layer SGLang can return, and their speed (a benchmark).

    python benchmarks/sglang_capture.py --out docs/results/sglang-capture

SGLang 0.5.23's own engine (its scheduler, model code and aux-hidden-state capture) runs on the CPU in the
SGLang CPU venv (``make sglang-cpu-venv``) with redraft's stand-in for its compiled kernels
(``redraft/engines/sglang_cpu``: the attention of its ``intel_amx`` backend and bookkeeping ops, plain PyTorch).
Per target (SmolLM2: Llama, GQA; kimi-k25-mini: DeepSeek-V3 MLA + MoE + YaRN, 4 layers; a random 6-layer
DeepSeek-V3 with Kimi's YaRN, built by ``redraft.catalog.tiny_models.make_served_deepseek_v3``), in fp32, on MT-bench
first turns rendered with the target's template and a run of arbitrary ids: every layer SGLang can return
(``0 .. L-2``, asked through ``redraft.core.layers``) against the HF backend's output of the same layer, per token
||sglang - hf|| / ||hf|| (median and max per layer), the teacher's top-1 ids and top-k log-probabilities; then
the default aux layers' capture timed through both backends (tokens/s; the engine's start apart). The speed is
the stand-in's, not SGLang's compiled kernels': it says what a CPU run costs, nothing about a GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reporting import publish

from redraft.core import cli as ending

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.sglang_capture")
DEEPSEEK6 = "deepseek-v3-6"  # the random 6-layer DeepSeek-V3 (built here, not a built-in target)


def sequences(tokenizer: Any, vocab_size: int, turns: int = 6, random_ids: int = 600) -> list[list[int]]:
    """MT-bench first turns rendered with the target's template, and a run of arbitrary ids in its vocabulary."""
    import torch

    from redraft.catalog.builtin import mtbench_records

    seqs = [list(tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
            for r in mtbench_records()[:turns]]
    g = torch.Generator().manual_seed(0)
    seqs.append(torch.randint(3, min(40000, vocab_size), (random_ids,), generator=g).tolist())
    return seqs


def capture_every_layer(path: Path, seqs: list[list[int]], python: str | None) -> dict[str, Any]:
    """Every layer SGLang can return through SGLang and through HF: {hf (default-id HFTarget), sglang, hf_every
    (captures), layers, engine_start_s}. Refuses to leave capture files behind."""
    from extract.backends.base import TeacherSpec
    from extract.backends.hf import HFTarget
    from extract.backends.sglang import SGLangTarget

    teacher = TeacherSpec(kinds=("topk",), topk=8)
    hf = HFTarget(str(path))
    every = list(range(hf.info.num_layers - 1))
    ref = HFTarget(str(path), aux_layer_ids=every).capture(seqs, teacher)
    t0 = time.perf_counter()
    engine = SGLangTarget(str(path), aux_layer_ids=every, dtype="float32", max_length=1024, python=python)
    start = time.perf_counter() - t0
    try:
        theirs = engine.capture(seqs, teacher)
        left = sorted(p.name for p in engine.capture_dir.glob("*"))
    finally:
        engine.close()
    if left:
        raise RuntimeError(f"capture files were left behind: {left}")
    return {"hf": hf, "sglang": theirs, "hf_every": ref, "layers": every, "engine_start_s": start}


def timed_default_capture(path: Path, seqs: list[list[int]], python: str | None, repeats: int) -> dict[str, Any]:
    """The default aux layers through both backends, interleaved repeats: tokens/s, median."""
    import statistics

    from extract.backends.base import TeacherSpec
    from extract.backends.hf import HFTarget
    from extract.backends.sglang import SGLangTarget

    teacher = TeacherSpec(kinds=("topk",), topk=64)
    tokens = sum(len(s) for s in seqs)
    hf = HFTarget(str(path))
    engine = SGLangTarget(str(path), dtype="float32", max_length=1024, python=python)
    times: dict[str, list[float]] = {"hf": [], "sglang": []}
    try:
        engine.capture(seqs[:1], teacher)  # warm-up: the engine's first batch
        for r in range(repeats):
            for name in (("hf", "sglang") if r % 2 == 0 else ("sglang", "hf")):
                t0 = time.perf_counter()
                (hf if name == "hf" else engine).capture(seqs, teacher)
                times[name].append(time.perf_counter() - t0)
    finally:
        engine.close()
    return {"tokens": tokens, "seconds": times,
            "tokens_per_s": {k: tokens / statistics.median_low(v) for k, v in times.items()},
            "sglang_over_hf": statistics.median(h / s for h, s in zip(times["hf"], times["sglang"], strict=True))}


def measure_target(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from capture_speed import compare_captures

    from redraft.catalog.builtin import resolve_target
    from redraft.core import layers

    if name == DEEPSEEK6:
        from redraft.catalog.tiny_models import make_served_deepseek_v3

        path = make_served_deepseek_v3(work / DEEPSEEK6)
    else:
        path = resolve_target(name, dtype="float32")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    from extract.backends.hf import HFTarget

    info = HFTarget(str(path)).info
    seqs = sequences(tok, info.vocab_size)
    got = capture_every_layer(Path(path), seqs, args.engine_python or None)
    equality = compare_captures(got["hf_every"], got["sglang"], info.hidden_size, len(got["layers"]))
    speed = timed_default_capture(Path(path), seqs, args.engine_python or None, args.repeats)
    return {"target": name, "architecture": info.architecture, "num_layers": info.num_layers,
            "hidden_size": info.hidden_size, "captured_layers": got["layers"],
            "engine_ids": layers.to_engine_layer_ids(got["layers"], "sglang", info.architecture, info.num_layers),
            "default_aux_layer_ids": list(info.aux_layer_ids), "sequences": len(seqs),
            "positions": equality["positions"], "equality": equality, "engine_start_s": got["engine_start_s"],
            "speed": speed}


def format_tables(report: dict[str, Any]) -> str:
    lines = [f"`{report['command']}`", "",
             f"SGLang {report['sglang_version']} (its engine; redraft's CPU stand-in for its kernels), fp32. Every "
             "layer SGLang can return, asked through redraft.core.layers, against the HF backend's output of that layer: "
             "||sglang - hf|| / ||hf|| per token, median / max over positions", "",
             "| target | layers (engine ids) | positions | worst layer median | worst layer max | teacher top-1 equal | "
             "top-k log-prob gap, median / max |", "|---|---|---:|---:|---:|---:|---|"]
    for t in report["targets"]:
        e = t["equality"]
        med = max(x["median"] for x in e["layers"])
        mx = max(x["max"] for x in e["layers"])
        lines.append(f"| {t['target']} ({t['architecture']}, {t['num_layers']} layers) | {t['captured_layers']} "
                     f"({t['engine_ids']}) | {e['positions']:,} | {med:.1e} | {mx:.1e} | {e['top1_equal']:.4f} | "
                     f"{e['topk_logprob_gap']['median']:.1e} / {e['topk_logprob_gap']['max']:.1e} |")
    lines += ["", "Per layer (median / max):", ""]
    for t in report["targets"]:
        per = "; ".join(f"{i}: {x['median']:.1e} / {x['max']:.1e}" for i, x in zip(t["captured_layers"],
                                                                                  t["equality"]["layers"], strict=True))
        lines.append(f"- {t['target']}: {per}")
    lines += ["", "Capture of the default aux layers with the top-64 teacher, tokens/s (median of interleaved "
              "repeats; the engine's start apart; the CPU stand-in's speed, not SGLang's compiled kernels'):", "",
              "| target | default aux ids | tokens | hf | sglang | sglang / hf | engine start s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for t in report["targets"]:
        s = t["speed"]
        lines.append(f"| {t['target']} | {t['default_aux_layer_ids']} | {s['tokens']:,} | {s['tokens_per_s']['hf']:,.0f} "
                     f"| {s['tokens_per_s']['sglang']:,.0f} | {s['sglang_over_hf']:.2f}x | {t['engine_start_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=f"smollm2-135m-instruct,kimi-k25-mini,{DEEPSEEK6}",
                   help=f"comma-separated built-in names, local folders, or {DEEPSEEK6}")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats per backend")
    p.add_argument("--engine-python", default="", help="SGLang's interpreter (default: the SGLang CPU venv)")
    p.add_argument("--out", default="", help="write sglang-capture.json and sglang-capture.md here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from redraft.engines.sglang import engine_runtime, installed_version

    runtime = engine_runtime(args.engine_python or None)
    with tempfile.TemporaryDirectory(prefix="redraft-sglang-capture-") as work:
        targets = [measure_target(n.strip(), args, Path(work)) for n in args.targets.split(",") if n.strip()]
    report = {"command": " ".join(["python benchmarks/sglang_capture.py", *(argv or sys.argv[1:])]),
              "sglang_version": installed_version(runtime.python) if runtime.stand_in else "(installed)",
              "engine_python": runtime.python, "stand_in": runtime.stand_in, "host": platform.node(),
              "cpus": os.cpu_count(), "processor": platform.processor(), "date": time.strftime("%Y-%m-%d"),
              "targets": targets}
    publish(report, format_tables(report), args.out, "sglang-capture")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.sglang_capture")))
