"""Extraction speed and size, side by side in one run (a benchmark, not a test).

Measures on the embedded default target, over the same batches:
  * a bare forward pass of the causal LM (what the model costs anyway), and
  * the extraction stage's work for those batches: hooks on three layers, the chunked
    top-k teacher, and writing the shard (encoding + checksum + atomic rename),
then reports tokens/s of each and their ratio (goal: stage >= 0.9x bare). Repeats are
interleaved and the best of each is kept, because the machines are noisy.

Also reports bytes per token for bf16/fp8 x topk/last_hidden, measured from the shards
written here and computed from the same layout for Kimi-K2.5's shapes (H=7168), next to
SpecForge's 2 bytes x 4H per token.

    python benchmarks/extract_throughput.py --samples 32 --json bench-extract.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.batching import pack_batches  # noqa: E402
from core.dataset.format import SampleFeatures, bytes_per_token  # noqa: E402
from core.dataset.writer import write_shard  # noqa: E402
from core.embedded import resolve_data, resolve_target  # noqa: E402
from extract.backends.base import TeacherSpec  # noqa: E402
from extract.backends.hf import HFTarget  # noqa: E402
from extract.chat import tokenize_conversation  # noqa: E402
from extract.records import read_records  # noqa: E402

log = logging.getLogger("bench.extract")

KIMI_HIDDEN = 7168
SPECFORGE_BYTES_PER_TOKEN = 2 * 4 * KIMI_HIDDEN  # bf16 aux (3H) + last hidden (H)


def _batches(backend: HFTarget, data: str, samples: int, max_length: int, batch_tokens: int):
    records = read_records([resolve_data(data)], max_records=samples * 4).records
    seqs = []
    for rec in records:
        tok = tokenize_conversation(backend.tokenizer, rec.messages, max_length)
        if any(tok.loss_mask):
            seqs.append(tok)
        if len(seqs) == samples:
            break
    batches = [[seqs[i] for i in b] for b in pack_batches([len(s.input_ids) for s in seqs], batch_tokens)]
    return seqs, batches


def _bare_forward(backend: HFTarget, batches) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            width = max(len(s.input_ids) for s in batch)
            ids = torch.full((len(batch), width), backend._pad_id(), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, s in enumerate(batch):
                ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids)
                mask[row, : len(s.input_ids)] = 1
            backend.model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - start


def _stage(backend: HFTarget, batches, teacher: TeacherSpec, out: Path, hidden_dtype: str) -> float:
    start = time.perf_counter()
    samples = []
    for batch in batches:
        captured = backend.capture([s.input_ids for s in batch], teacher)
        for s, cap in zip(batch, captured, strict=True):
            samples.append(SampleFeatures(
                sample_id=str(len(samples)), source="bench", category=None,
                input_ids=torch.tensor(s.input_ids), loss_mask=torch.tensor(s.loss_mask, dtype=torch.uint8),
                aux_hidden=cap.aux_hidden, topk_ids=cap.topk_ids, topk_logprobs=cap.topk_logprobs,
                last_hidden=cap.last_hidden,
            ))
    write_shard(out, 0, samples, hidden_dtype=hidden_dtype, num_aux=len(backend.info.aux_layer_ids))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="Built-in name or local HF folder.")
    p.add_argument("--data", default="chitchat", help="Input data (file or built-in name).")
    p.add_argument("--samples", type=int, default=32, help="Conversations to push through.")
    p.add_argument("--max-length", type=int, default=512, help="Truncation length in tokens.")
    p.add_argument("--batch-tokens", type=int, default=4096, help="Padded tokens per forward batch.")
    p.add_argument("--topk", type=int, default=64, help="Teacher top-k.")
    p.add_argument("--repeats", type=int, default=3, help="Interleaved repeats; the best of each is kept.")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is).")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="Target compute dtype.")
    p.add_argument("--json", default="", help="Write the results here as JSON.")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    backend = HFTarget(str(resolve_target(args.target)), name=args.target, dtype=args.dtype)
    seqs, batches = _batches(backend, args.data, args.samples, args.max_length, args.batch_tokens)
    tokens = sum(len(s.input_ids) for s in seqs)
    teacher = TeacherSpec(kinds=("topk",), topk=args.topk)
    bare, stage = [], []
    with tempfile.TemporaryDirectory() as tmp:
        _bare_forward(backend, batches[:1])  # warm-up
        for _ in range(args.repeats):
            bare.append(_bare_forward(backend, batches))
            stage.append(_stage(backend, batches, teacher, Path(tmp) / "speed", "bf16"))

        sizes = {}
        for dtype in ("bf16", "fp8"):
            for kind in ("topk", "last_hidden"):
                folder = Path(tmp) / f"{dtype}-{kind}"
                _stage(backend, batches, TeacherSpec(kinds=(kind,), topk=args.topk), folder, dtype)
                shard_bytes = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
                sizes[f"{dtype}+{kind}"] = {
                    "measured_bytes_per_token": shard_bytes / tokens,
                    "layout_bytes_per_token": bytes_per_token(backend.info.hidden_size, 3, dtype, (kind,), args.topk),
                    "kimi_k25_bytes_per_token": bytes_per_token(KIMI_HIDDEN, 3, dtype, (kind,), args.topk),
                }

    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "target": args.target, "dtype": args.dtype, "samples": len(seqs), "tokens": tokens, "batches": len(batches),
        "bare_forward_tok_s": tokens / min(bare), "stage_tok_s": tokens / min(stage),
        "ratio_stage_over_bare": min(bare) / min(stage),
        "bare_seconds": bare, "stage_seconds": stage, "bytes_per_token": sizes,
        "specforge_kimi_bytes_per_token": SPECFORGE_BYTES_PER_TOKEN,
    }
    print(f"\nExtraction throughput on {args.target} ({len(seqs)} samples, {tokens} tokens, "
          f"{torch.get_num_threads()} threads, best of {args.repeats})")
    print(f"{'':28}{'tok/s':>10}")
    print(f"{'bare forward (causal LM)':28}{result['bare_forward_tok_s']:>10.0f}")
    print(f"{'extraction stage':28}{result['stage_tok_s']:>10.0f}")
    print(f"{'ratio stage / bare':28}{result['ratio_stage_over_bare']:>10.2f}   (goal >= 0.90)")
    print(f"\n{'storage':20}{'measured B/tok':>16}{'Kimi-K2.5 B/tok':>17}{'vs SpecForge 8H':>17}")
    for name, s in sizes.items():
        print(f"{name:20}{s['measured_bytes_per_token']:>16,.0f}{s['kimi_k25_bytes_per_token']:>17,.0f}"
              f"{s['kimi_k25_bytes_per_token'] / SPECFORGE_BYTES_PER_TOKEN:>16.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
