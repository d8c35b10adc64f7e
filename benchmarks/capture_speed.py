"""Capture speed side by side: ``--backend vllm``, ``--backend hf`` and a bare backbone forward (a benchmark).

    python benchmarks/capture_speed.py --out runs/capture-speed --threads 2
    python benchmarks/capture_speed.py --targets kimi-k25-mini --samples 32 --repeats 5

Per target (default both embedded ones), the same batches (MT-bench and chitchat prompts rendered with the
target's template, packed by ``redraft.core.batching.pack_batches`` at ``--batch-tokens``) go through:

- bare: the decoder stack alone (``benchmarks.extract_throughput.Bare``: no hooks, no lm_head);
- hf: ``HFTarget.capture`` (hooks on the aux layers, the top-k teacher in chunks);
- vllm: ``VLLMTarget.capture_batches``, as extraction runs it (the engine prefills batch n+1 while this
  process computes batch n's features; "no overlap": ``VLLMTarget.capture`` one batch after the other)
  (vLLM CPU's prefill with ``extract_hidden_states``, redraft's connector writing
  each request's states, the file read back and removed, the teacher from the last state). The engine is
  started once per target before the repeats (its start is reported, not counted), with the same thread count;
- vllm engine part: the same engine call with each file read back and removed, nothing computed here.

Each of hf and vllm runs with teacher top-k (the lm_head over the full vocabulary per token) and last_hidden
(no lm_head: the trainer applies it).

Repeats are interleaved (bare, hf, vllm, then vllm, hf, bare, ...) so load from elsewhere hits every path; the
ratios vllm/bare and hf/bare are per neighbouring triple, median reported. Tokens are real (unpadded) tokens.

Also measured, at Kimi-K2.5's width (H = 7168, 3 aux layers + the last state, bf16 in the engine): what a
token's states cost to move from the engine to redraft on the two paths, per token, single thread:
SGLang's list path (``tensor.tolist()`` in the scheduler, pickled to the tokenizer process and back as its
``meta_info``, ``torch.tensor(rows)`` here: ``extract/backends/sglang.py``) and vLLM's file path (the
connector's ``save_file`` of [T, 4, H], ``load_file`` here). And the bytes per token each path writes.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reporting import publish

from redraft.core import cli as ending

log = logging.getLogger("bench.capture_speed")

KIMI_HIDDEN = 7168
GOAL = 0.9  # issue 23: vLLM capture >= 0.9x the bare backbone forward's tokens/s


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="smollm2-135m-instruct,kimi-k25-mini", help="comma-separated built-in "
                   "names or local HF folders")
    p.add_argument("--samples", type=int, default=48, help="prompts per repeat (MT-bench first turns, then chitchat)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the three paths")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per capture batch")
    p.add_argument("--topk", type=int, default=64, help="teacher top-k (extract's default)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
                   help="torch threads here and OMP threads in the vLLM engine (0: torch's default, engine 2)")
    p.add_argument("--engine-python", default="", help="the vLLM interpreter (default: the vLLM CPU venv)")
    p.add_argument("--kimi-tokens", type=int, default=512, help="tokens in the Kimi-width transport measurement")
    p.add_argument("--out", default="", help="write capture-speed.json and capture-speed.md here")
    return p.parse_args(argv)


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """n rendered user prompts: MT-bench first turns, then chitchat openings."""
    from redraft.catalog.builtin import chitchat_records, mtbench_records

    texts = [r["turns"][0] for r in mtbench_records()]
    for rec in chitchat_records():
        if len(texts) >= n:
            break
        first = next((m["value"] for m in rec.get("conversations") or [] if m.get("from") == "human"), None)
        if first:
            texts.append(first)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)) for t in texts[:n]]


def _row_rel(a: Any, b: Any) -> Any:
    return (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)


def compare_captures(ours: list[Any], theirs: list[Any], hidden: int, n_aux: int) -> dict[str, Any]:
    """How far two backends' Captured features are apart, per token: for each aux layer and the last hidden
    state the median and max of ||a - b|| / ||a|| over positions; the share of positions whose teacher top-1 id
    is the same; over those, the median and max of the largest top-k log-probability gap."""
    import torch

    pairs = list(zip(ours, theirs, strict=True))
    layers = []
    for k in range(n_aux):
        cols = slice(k * hidden, (k + 1) * hidden)
        rel = torch.cat([_row_rel(a.aux_hidden[:, cols], b.aux_hidden[:, cols]) for a, b in pairs])
        layers.append({"median": rel.median().item(), "max": rel.max().item()})
    out: dict[str, Any] = {"layers": layers}
    if all(a.last_hidden is not None and b.last_hidden is not None for a, b in pairs):
        last = torch.cat([_row_rel(a.last_hidden, b.last_hidden) for a, b in pairs])
        out["last_hidden"] = {"median": last.median().item(), "max": last.max().item()}
    same = [a.topk_ids[:, 0] == b.topk_ids[:, 0] for a, b in pairs]
    top1 = torch.cat(same).float()
    gap = torch.cat([(a.topk_logprobs - b.topk_logprobs).abs().max(dim=-1).values[s]
                     for (a, b), s in zip(pairs, same, strict=True)])
    out.update(top1_equal=top1.mean().item(), positions=int(top1.numel()),
               topk_logprob_gap={"median": gap.median().item(), "max": gap.max().item()})
    return out


def read_files(engine: Any, batch: list[list[int]]) -> list[Any]:
    """One capture batch through the engine, its files read back (and removed), no teacher, no features."""
    from extract.backends.vllm import read_capture_file

    rows = engine.engine.capture(batch)
    return [read_capture_file(r["hidden_states_path"], s, len(engine.plan.engine_ids), engine.info.hidden_size)
            for r, s in zip(rows, batch, strict=True)]


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_target(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved repeats of bare / hf / vllm on one target's batches."""
    from extract_throughput import Bare

    from extract.backends.base import TeacherSpec
    from extract.backends.vllm import VLLMTarget
    from redraft.catalog.builtin import resolve_target
    from redraft.core.batching import pack_batches

    bare = Bare(name, "float32")
    hf = bare.hf
    seqs = prompts(hf.tokenizer, args.samples)
    batches = [[seqs[i] for i in b] for b in pack_batches([len(s) for s in seqs], args.batch_tokens)]
    tokens = sum(len(s) for s in seqs)
    topk = TeacherSpec(kinds=("topk",), topk=args.topk)
    last = TeacherSpec(kinds=("last_hidden",))  # no lm_head here: the trainer applies it
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine's (engine_env keeps a set value)
    t0 = time.perf_counter()
    engine = VLLMTarget(str(resolve_target(name)), python=args.engine_python or None, max_length=2048,
                        kv_cache_bytes=1 << 30)
    start_s = time.perf_counter() - t0
    paths = {
        "bare": lambda: bare.seconds(batches),
        "hf": lambda: [hf.capture(b, topk) for b in batches],
        # what extraction runs: the engine prefills batch n+1 while this process computes batch n's features
        "vllm": lambda: list(engine.capture_batches(batches, topk)),
        "hf_last": lambda: [hf.capture(b, last) for b in batches],
        "vllm_last": lambda: list(engine.capture_batches(batches, last)),
        # the same, one batch after the other (no overlap): what the overlap buys
        "vllm_last_serial": lambda: [engine.capture(b, last) for b in batches],
        # the engine's part alone: the prefill with the connector's writes, each file read back and removed
        "vllm_engine": lambda: [read_files(engine, b) for b in batches],
    }
    both = TeacherSpec(kinds=("topk", "last_hidden"), topk=args.topk)
    try:
        # warm-up (the engine's first batch, this process's allocator), and the equality of the two captures
        ours = [c for b in batches for c in hf.capture(b, both)]
        theirs = [c for b in batches for c in engine.capture(b, both)]
        equality = compare_captures(ours, theirs, hf.info.hidden_size, len(hf.info.aux_layer_ids))
        del ours, theirs
        times: dict[str, list[float]] = {k: [] for k in paths}
        order = list(paths)
        for r in range(args.repeats):
            for key in order if r % 2 == 0 else order[::-1]:
                times[key].append(_seconds(paths[key]))
                log.info("%s repeat %d %s: %.2f s", name, r, key, times[key][-1])
    finally:
        engine.close()
    info = hf.info
    n_engine_layers = len(engine.plan.engine_ids)
    rate = {k: tokens / statistics.median_low(v) for k, v in times.items()}
    ratio = {k: statistics.median([b / a for a, b in zip(times[k], times["bare"], strict=True)])
             for k in paths if k != "bare"}
    return {
        "target": name, "architecture": info.architecture, "hidden_size": info.hidden_size,
        "aux_layer_ids": list(info.aux_layer_ids), "samples": len(seqs), "tokens": tokens, "batches": len(batches),
        "equality_hf_vs_vllm": equality, "seconds": times, "tokens_per_s": rate, "ratio_to_bare": ratio, "engine_start_s": start_s,
        "engine_layers": n_engine_layers,
        # the engine's file per token: every captured layer in the model dtype (fp32 here) and the token id
        "engine_file_bytes_per_token": n_engine_layers * info.hidden_size * 4 + 8,
    }


def transport_at_kimi_width(tokens: int) -> dict[str, Any]:
    """Per-token cost of moving [T, 3H] aux (+ the last state for vLLM) from the engine to redraft, both paths."""
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    aux = torch.randn(tokens, 3 * KIMI_HIDDEN).to(torch.bfloat16)
    t0 = time.perf_counter()
    rows = aux.float().cpu().clone().tolist()  # SGLang: _append_prefill_hidden_states
    blob = pickle.dumps({"meta_info": {"hidden_states": [rows]}}, protocol=pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(blob)["meta_info"]["hidden_states"][0]
    got = torch.tensor(back, dtype=torch.float32)  # extract/backends/sglang.py: parse_capture_output
    list_s = time.perf_counter() - t0
    assert got.shape == aux.shape
    block = torch.randn(tokens, 4, KIMI_HIDDEN).to(torch.bfloat16)
    folder = Path(tempfile.mkdtemp(prefix="redraft-capture-bench-"))
    try:
        path = str(folder / "req.safetensors")
        t0 = time.perf_counter()
        save_file({"hidden_states": block, "token_ids": torch.arange(tokens)}, path)  # the connector
        data = load_file(path)  # extract/backends/vllm.py: read_capture_file
        got = data["hidden_states"].to(torch.float32)
        file_s = time.perf_counter() - t0
        file_bytes = os.path.getsize(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "hidden_size": KIMI_HIDDEN, "tokens": tokens,
        "sglang_list_ms_per_token": list_s / tokens * 1e3, "sglang_list_tokens_per_s": tokens / list_s,
        "sglang_pickle_bytes_per_token": len(blob) / tokens,
        "vllm_file_ms_per_token": file_s / tokens * 1e3, "vllm_file_tokens_per_s": tokens / file_s,
        "vllm_file_bytes_per_token": file_bytes / tokens,
    }


def format_tables(report: dict[str, Any]) -> str:
    lines = [f"`{report['command']}`", "",
             "tokens/s (ratio to bare, median of the interleaved repeats); teacher top-k = the lm_head over the full "
             "vocabulary per token, last_hidden = none (the trainer applies it)", "",
             "| target | tokens | bare | hf, top-k | vllm, top-k | hf, last_hidden | vllm, last_hidden "
             "| vllm, last_hidden, no overlap | vllm engine part | engine file B/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in report["targets"]:
        r, q = t["tokens_per_s"], t["ratio_to_bare"]
        cell = {k: f"{r[k]:,.0f} ({q[k]:.2f}x)" for k in q}
        lines.append(f"| {t['target']} | {t['tokens']:,} | {r['bare']:,.0f} | {cell['hf']} | {cell['vllm']} | "
                     f"{cell['hf_last']} | {cell['vllm_last']} | {cell['vllm_last_serial']} | {cell['vllm_engine']} | "
                     f"{t['engine_file_bytes_per_token']:,} |")
    lines += ["", "Features, `--backend vllm` against `--backend hf` (fp32, every position of the prompts above): "
              "||vllm - hf|| / ||hf|| per token, median / max", "",
              "| target | positions | aux layers | last hidden | teacher top-1 equal | top-k log-prob gap, median / max |",
              "|---|---:|---|---|---:|---|"]
    for t in report["targets"]:
        e = t["equality_hf_vs_vllm"]
        aux = "; ".join(f"{x['median']:.1e} / {x['max']:.1e}" for x in e["layers"])
        lh = e.get("last_hidden", {})
        lines.append(f"| {t['target']} | {e['positions']:,} | {aux} | {lh.get('median', 0):.1e} / {lh.get('max', 0):.1e} | "
                     f"{e['top1_equal']:.4f} | {e['topk_logprob_gap']['median']:.1e} / {e['topk_logprob_gap']['max']:.1e} |")
    k = report["kimi_width_transport"]
    lines += ["", f"Kimi-K2.5 width (H = {k['hidden_size']}), {k['tokens']} tokens, engine to redraft, one thread:", "",
              "| path | ms / token | tokens/s | bytes / token moved |", "|---|---:|---:|---:|",
              f"| SGLang lists (tolist, pickle, unpickle, tensor) | {k['sglang_list_ms_per_token']:.3f} | "
              f"{k['sglang_list_tokens_per_s']:,.0f} | {k['sglang_pickle_bytes_per_token']:,.0f} |",
              f"| vLLM file (save_file, load_file), 3 aux + last state | {k['vllm_file_ms_per_token']:.3f} | "
              f"{k['vllm_file_tokens_per_s']:,.0f} | {k['vllm_file_bytes_per_token']:,.0f} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parse(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/capture_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    targets = [measure_target(t.strip(), args) for t in args.targets.split(",") if t.strip()]
    torch.set_num_threads(1)
    report = {"command": command.strip(), "goal_vllm_over_bare": GOAL, "threads": args.threads,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "targets": targets, "kimi_width_transport": transport_at_kimi_width(args.kimi_tokens)}
    publish(report, format_tables(report), args.out, "capture-speed")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.capture_speed")))
