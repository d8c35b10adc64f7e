"""The training loader's host cost at Kimi-K2.5's width, against the tokens per second one H200 trains.

    python benchmarks/loader_throughput.py --out docs/results/loader

Synthetic shards written by the real writer at Kimi-K2.5's feature width (3 x 7168 aux in fp8 with per-token
scales, top-64 teacher), samples of T tokens. Two host paths over the same batches, one thread each (a loader
worker is one core):

- **decoded on the host** (what redraft did before): ``DatasetReader.get`` decodes fp8 to fp32 and scans it for
  NaN/Inf, ``collate`` pads fp32, and the device would receive fp32 (~86 KB per token);
- **stored** (now): ``get_stored`` checks the stored bytes, ``collate_stored`` pads them as stored, and the device
  receives ~22 KB per token and decodes there (``redraft.core.dataset.stored``).

Per path: host tokens/s, bytes per token sent to the device, CPU seconds per million tokens. Beside them, the
tokens/s one H200 trains at the Kimi-K2.5 MLA drafter's shape, **estimated** from the drafter's counted FLOPs
per token (TTT unroll, forward and backward) and a stated achievable bf16 rate, until benchmarks/gpu_check.py
measures it on a device; and the host cores per rank each path needs to keep up.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from reporting import publish

from redraft.core import cli as ending
from redraft.core.dataset.batch import collate
from redraft.core.dataset.format import SampleFeatures
from redraft.core.dataset.reader import DatasetReader
from redraft.core.dataset.stored import collate_stored
from redraft.core.dataset.writer import finalize_dataset, write_shard

KIMI = {"hidden": 7168, "num_aux": 3, "topk": 64, "vocab": 163840}
# The Kimi-K2.5 MLA drafter (configs/kimi-k25.yaml#train-mla)
DRAFTER = {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 192,
           "intermediate_size": 18432, "vocab_size": 163840, "draft_vocab_size": 32000, "target_hidden_size": 7168,
           "aux_layer_ids": [1, 29, 57], "target_num_layers": 61, "attention": "mla", "q_lora_rank": 1536,
           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="tokens per sample (max_length of the Kimi recipe)")
    p.add_argument("--samples", type=int, default=8, help="samples written (2 per shard)")
    p.add_argument("--batch-samples", type=int, default=1, help="samples per micro-batch (the Kimi recipe: one "
                   "4096-token sample per GPU)")
    p.add_argument("--ttt-steps", type=int, default=7, help="TTT unroll of the FLOP count")
    p.add_argument("--bf16-tflops", type=float, default=400.0, help="achievable dense bf16 TFLOP/s of one H200 "
                   "for the estimate (its peak is ~989; 400 is ~40%% of it)")
    p.add_argument("--out", default="", help="write loader.json and loader.md here")
    return p.parse_args(argv)


def _write(root: Path, samples: int, seq: int) -> None:
    g = torch.Generator().manual_seed(0)
    layer_scale = torch.tensor([0.5, 4.0, 32.0]).repeat_interleave(KIMI["hidden"])
    aux = torch.randn(seq, KIMI["num_aux"] * KIMI["hidden"], generator=g) * layer_scale  # drawn once, reused
    top = torch.log_softmax(torch.randn(seq, 4 * KIMI["topk"], generator=g), -1).topk(KIMI["topk"], dim=-1)
    base = SampleFeatures(sample_id="", source="bench", category=None,
                          input_ids=torch.randint(0, KIMI["vocab"], (seq,), generator=g),
                          loss_mask=torch.rand(seq, generator=g) > 0.3, aux_hidden=aux, topk_ids=top.indices,
                          topk_logprobs=top.values)
    for s in range(samples // 2):
        write_shard(root, s, [dataclasses.replace(base, sample_id=f"s{2 * s + j}") for j in range(2)],
                    hidden_dtype="fp8", num_aux=KIMI["num_aux"])
    header = {"hidden_size": KIMI["hidden"], "vocab_size": KIMI["vocab"], "aux_layer_ids": [1, 29, 57],
              "hidden_dtype": "fp8", "teacher": {"kinds": ["topk"], "topk": KIMI["topk"]}}
    finalize_dataset(root, num_shards=samples // 2, header=header, vocab_size=KIMI["vocab"])


def _measure(reader: DatasetReader, batches: list[list[int]], stored: bool) -> dict:
    tokens = sent = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for chunk in batches:
        if stored:
            batch = collate_stored([reader.get_stored(i) for i in chunk])
            parts = [batch.input_ids, batch.attention_mask, batch.loss_mask, batch.aux_hidden, batch.aux_scale,
                     batch.topk_ids, batch.topk_logprobs]
        else:
            batch = collate([reader.get(i) for i in chunk])
            parts = [batch.input_ids, batch.attention_mask, batch.loss_mask, batch.aux_hidden, batch.topk_ids,
                     batch.topk_logprobs]
        tokens += batch.num_tokens
        sent += sum(t.numel() * t.element_size() for t in parts if t is not None)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "bytes_per_token": sent / tokens,
            "cpu_s_per_mtok": cpu / tokens * 1e6}


def drafter_flops_per_token(seq: int, ttt_steps: int, cfg: dict = DRAFTER) -> dict:
    """FLOPs one training token costs an MLA drafter (default: Kimi-K2.5's): 2 x weights per matmul pass (fc once;
    the layer and lm_head at every TTT step), the attention's q.k and p.v over the mean causal context, x3 for
    backward."""
    from redraft.core.drafter.config import DrafterConfig
    from redraft.core.drafter.modeling import Eagle3Drafter

    with torch.device("meta"):
        d = Eagle3Drafter(DrafterConfig(**cfg, torch_dtype="bfloat16"))
    fc = d.fc.weight.numel()
    layer = sum(p.numel() for p in d.midlayer.parameters())
    head = d.lm_head.weight.numel()
    heads, qk, v = cfg["num_attention_heads"], cfg["head_dim"], cfg["v_head_dim"]
    context = seq / 2 + ttt_steps / 2  # mean step-0 keys seen, plus the diagonal keys
    attention = 2 * heads * (qk + v) * context
    forward = 2 * fc + ttt_steps * (2 * (layer + head) + attention)
    return {"params": fc + layer + head, "fc": fc, "layer": layer, "lm_head": head,
            "forward_flops_per_token": forward, "train_flops_per_token": 3 * forward}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)  # one loader worker = one core
    root = Path(tempfile.mkdtemp(prefix="loader-"))
    try:
        _write(root, args.samples, args.seq)
        reader = DatasetReader(root)
        order = list(range(len(reader)))
        batches = [order[i:i + args.batch_samples] for i in range(0, len(order), args.batch_samples)]
        _measure(reader, batches[:1], stored=True)  # page cache and allocator warm for both
        rows = {"decoded on the host": _measure(reader, batches, stored=False),
                "stored (decoded on the device)": _measure(reader, batches, stored=True)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    flops = drafter_flops_per_token(args.seq, args.ttt_steps)
    gpu_tokens_per_s = args.bf16_tflops * 1e12 / flops["train_flops_per_token"]
    for r in rows.values():
        r["cores_per_rank"] = gpu_tokens_per_s / r["tokens_per_s"]
    return {"seq": args.seq, "samples": args.samples, "batch_samples": args.batch_samples, "width": KIMI,
            "paths": rows, "drafter": flops, "ttt_steps": args.ttt_steps, "bf16_tflops_assumed": args.bf16_tflops,
            "h200_tokens_per_s_estimated": gpu_tokens_per_s}


def render(r: dict) -> str:
    f = r["drafter"]
    lines = [f"# Training loader at Kimi-K2.5's width (3 x 7168 fp8 + top-64, T = {r['seq']})", "",
             "| host path (one core) | tokens/s | bytes/token to the device | CPU s per 1M tokens | cores per rank "
             "to feed one H200 (est.) |", "|---|---:|---:|---:|---:|"]
    for name, p in r["paths"].items():
        lines.append(f"| {name} | {p['tokens_per_s']:,.0f} | {p['bytes_per_token']:,.0f} | "
                     f"{p['cpu_s_per_mtok']:.1f} | {p['cores_per_rank']:.2f} |")
    lines += ["", f"One H200 trains ~{r['h200_tokens_per_s_estimated']:,.0f} tokens/s at this shape: an **estimate**, "
              f"{f['train_flops_per_token'] / 1e9:.1f} GFLOP per token (the MLA drafter's "
              f"{f['params'] / 1e9:.2f} B weights: fc once, layer + lm_head at each of {r['ttt_steps']} TTT steps, "
              f"attention over the mean context; x3 for backward) at an assumed {r['bf16_tflops_assumed']:.0f} "
              "TFLOP/s of bf16; benchmarks/gpu_check.py measures it on a device.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = run(args)
    publish(report, render(report), args.out, "loader")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.loader_throughput")))
