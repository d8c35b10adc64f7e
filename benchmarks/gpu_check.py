"""The prepared GPU check: one script a lent CUDA device runs in a few minutes, with a bare image's packages.

    PYTHONPATH=. python benchmarks/gpu_check.py --out docs/results/gpu-check   # on a CUDA device: Kimi-K2.5's shape
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu-check                 # where redraft is installed: tiny

Needs torch, transformers and safetensors (what a bare device image holds), and this repository: installed, or
on PYTHONPATH (a bare image, where nothing is installed: run it from the repository root as above). It measures, in
order, each part recorded even when a later one fails:

1. **matmul**: the dense bf16 matmul rate this device achieves (8192^3 products), the yardstick below;
2. **train step** at the Kimi-K2.5 MLA drafter's shape (configs/kimi-k25.yaml#train-mla: hidden 7168, 64 MLA
   heads, MLP 18432, draft vocab 32000; one 4096-token sample; TTT unroll 7; AdamW): tokens/s, achieved TFLOP/s
   (the drafter's counted FLOPs, benchmarks/loader_throughput.py) against the matmul rate, peak memory, for each
   TTT attention kernel (eager, sdpa, flex);
3. **equality** of the kernels: loss and every gradient of sdpa and flex against eager in fp32 at T = 512 (the
   CPU has no FlexAttention backward, so this is where flex's gradients are held);
4. **loader**: the stored-row loader (redraft.core.dataset.stored) over shards written by the real writer at Kimi's
   width, up to the decoded batch on this device: tokens/s per host core, and the cores per rank that feed the
   measured training rate;
5. **long context**: one training step (forward, loss, backward) of one sample of T = 4K, 16K and 32K tokens at
   the same shape, per kernel, with and without ``activation_checkpointing``: peak memory per token (flat when
   memory is linear in T, the arithmetic docs/long-context.md writes beside the Kimi configs) and tokens/s;
   a case that runs out of memory is recorded as such.

Writes gpu-check.json and gpu-check.md. ``--tiny`` shrinks every shape (a CPU in CI; flex forward only there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from loader_throughput import DRAFTER, KIMI, drafter_flops_per_token
from reporting import publish

from redraft.core import cli as ending

IMPLS = ("eager", "sdpa", "flex")
TINY_DRAFTER = {**DRAFTER, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 80,
                "intermediate_size": 128, "vocab_size": 512, "draft_vocab_size": 128, "target_hidden_size": 64,
                "q_lora_rank": 32, "qk_nope_head_dim": 16, "v_head_dim": 16}  # the engines' MLA latent: 512 + 64


@dataclasses.dataclass
class Shape:
    drafter: dict
    seq: int
    long_seqs: tuple[int, ...]
    equality_seq: int
    matmul: int
    steps: int  # timed optimizer steps per kernel
    ttt_steps: int
    loader_samples: int
    aux_width: int


def shape(tiny: bool) -> Shape:
    if tiny:
        return Shape(TINY_DRAFTER, seq=64, long_seqs=(64, 256), equality_seq=32, matmul=256, steps=1, ttt_steps=3, loader_samples=2,
                     aux_width=64)
    return Shape(DRAFTER, seq=4096, long_seqs=(4096, 16384, 32768), equality_seq=512, matmul=8192, steps=5, ttt_steps=7, loader_samples=4,
                 aux_width=KIMI["hidden"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, n: int) -> dict:
    dtype = torch.bfloat16
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    reps = 20 if device.type == "cuda" else 3
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - start) / reps
    return {"n": n, "dtype": "bf16", "seconds": seconds, "tflops": 2 * n**3 / seconds / 1e12}


def _drafter(cfg: dict, device: torch.device, dtype: torch.dtype, impl: str = "eager") -> Any:
    from redraft.core.drafter.config import DrafterConfig
    from redraft.core.drafter.modeling import Eagle3Drafter
    from redraft.core.drafter.vocab import build_vocab_mapping

    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig(**cfg, torch_dtype="bfloat16"), attention_impl=impl)
    counts = torch.arange(cfg["vocab_size"], 0, -1, dtype=torch.int64)  # the lowest ids most frequent
    d.set_vocab_mapping(*build_vocab_mapping(counts, cfg["draft_vocab_size"]))
    return d.to(device=device, dtype=dtype)


def _batch(cfg: dict, seq: int, device: torch.device, dtype: torch.dtype, seed: int = 1) -> Any:
    from redraft.core.dataset.batch import Batch

    g = torch.Generator().manual_seed(seed)
    k = 8
    ids = torch.randint(0, cfg["draft_vocab_size"], (1, seq), generator=g)
    top = torch.log_softmax(torch.randn(1, seq, 4 * k, generator=g), -1).topk(k, dim=-1)
    return Batch(input_ids=ids, attention_mask=torch.ones(1, seq, dtype=torch.int64),
                 loss_mask=(torch.rand(1, seq, generator=g) > 0.3).long(),
                 aux_hidden=torch.randn(1, seq, 3 * cfg["target_hidden_size"], generator=g),
                 topk_ids=torch.randint(0, cfg["draft_vocab_size"], (1, seq, k), generator=g),
                 topk_logprobs=top.values, last_hidden=None, sample_ids=["s"]).to(device, dtype)


def train_step_rates(sh: Shape, device: torch.device, matmul_tflops: float) -> dict:
    from train.ttt import TTTModel

    flops = drafter_flops_per_token(sh.seq, sh.ttt_steps, sh.drafter)
    out: dict[str, Any] = {"seq": sh.seq, "ttt_steps": sh.ttt_steps, "dtype": "bf16",
                           "train_flops_per_token": flops["train_flops_per_token"]}
    drafter = _drafter(sh.drafter, device, torch.bfloat16)
    model = TTTModel(drafter, steps=sh.ttt_steps, decay=0.8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    batch = _batch(sh.drafter, sh.seq, device, torch.bfloat16)
    for impl in IMPLS:
        if impl == "flex" and device.type != "cuda":
            out[impl] = {"skipped": "FlexAttention trains on CUDA only"}
            continue
        drafter.attention_impl = impl
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(2):  # warm-up (and flex's compile)
                model(batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            for _ in range(sh.steps):
                loss = model(batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            _sync(device)
            seconds = (time.perf_counter() - start) / sh.steps
            r = {"step_s": seconds, "tokens_per_s": sh.seq / seconds, "loss": float(loss),
                 "tflops": flops["train_flops_per_token"] * sh.seq / seconds / 1e12}
            r["of_matmul_rate"] = r["tflops"] / matmul_tflops
            if device.type == "cuda":
                r["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            out[impl] = r
        except Exception as e:  # one kernel failing must not hide the others
            out[impl] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return out


def kernel_equality(sh: Shape, device: torch.device) -> dict:
    """Loss and gradients of each kernel against eager, fp32, one sample of equality_seq tokens."""
    from train.ttt import TTTModel

    batch = _batch(sh.drafter, sh.equality_seq, device, torch.float32, seed=2)
    results: dict[str, Any] = {"seq": sh.equality_seq, "dtype": "fp32"}
    ref = None
    for impl in IMPLS:
        drafter = _drafter(sh.drafter, device, torch.float32, impl)
        model = TTTModel(drafter, steps=sh.ttt_steps, decay=0.8)
        grad = impl != "flex" or device.type == "cuda"
        try:
            with torch.set_grad_enabled(grad):
                loss = model(batch).loss
                if grad:
                    loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        except Exception as e:
            results[impl] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        if ref is None:
            ref = (loss.detach(), grads)
            results[impl] = {"loss": float(loss)}
            continue
        r: dict[str, Any] = {"loss": float(loss), "loss_rel_diff": float((loss - ref[0]).abs() / ref[0].abs())}
        if grads:
            r["grad_max_rel_diff"] = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30))
                                         for n, g in ref[1].items())
        else:
            r["grads"] = "not on a CPU (FlexAttention has no backward there)"
        results[impl] = r
    return results


def long_context(sh: Shape, device: torch.device) -> dict:
    """One step per (T, kernel, recompute): peak memory over the step per token, and tokens/s (issue 45)."""
    from train.ttt import TTTModel

    out: dict[str, Any] = {"seqs": list(sh.long_seqs), "ttt_steps": sh.ttt_steps, "dtype": "bf16", "cases": []}
    drafter = _drafter(sh.drafter, device, torch.bfloat16)
    for seq in sh.long_seqs:
        batch = _batch(sh.drafter, seq, device, torch.bfloat16, seed=3)
        for impl in IMPLS:
            for recompute in (False, True):
                case: dict[str, Any] = {"seq": seq, "impl": impl, "activation_checkpointing": recompute}
                out["cases"].append(case)
                if impl == "flex" and device.type != "cuda":
                    case["skipped"] = "FlexAttention trains on CUDA only"
                    continue
                drafter.attention_impl = impl
                model = TTTModel(drafter, steps=sh.ttt_steps, decay=0.8, recompute=recompute)
                try:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                    _sync(device)
                    start = time.perf_counter()
                    model(batch).loss.backward()
                    _sync(device)
                    case["seconds"] = time.perf_counter() - start
                    case["tokens_per_s"] = seq / case["seconds"]
                    if device.type == "cuda":
                        case["step_memory_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                        case["kib_per_token"] = case["step_memory_gib"] * 2**20 / seq
                except torch.OutOfMemoryError as e:
                    case["error"] = f"out of memory: {str(e).splitlines()[0]}"[:300]
                except Exception as e:  # one case failing must not hide the others
                    case["error"] = f"{type(e).__name__}: {e}"[:2000]
                finally:
                    drafter.zero_grad(set_to_none=True)
        del batch
    return out


def loader_rate(sh: Shape, device: torch.device) -> dict:
    """Stored rows -> pinned batch -> decoded on ``device``, over shards the real writer wrote."""
    from redraft.core.dataset.format import SampleFeatures
    from redraft.core.dataset.reader import DatasetReader
    from redraft.core.dataset.stored import collate_stored
    from redraft.core.dataset.writer import finalize_dataset, write_shard

    torch.set_num_threads(1)  # a loader worker is one core
    root = Path(tempfile.mkdtemp(prefix="gpu-check-loader-"))
    try:
        g = torch.Generator().manual_seed(0)
        seq, width, vocab = sh.seq, sh.aux_width, sh.drafter["vocab_size"]
        top = torch.log_softmax(torch.randn(seq, 256, generator=g), -1).topk(64, dim=-1)
        base = SampleFeatures(sample_id="", source="gpu-check", category=None,
                              input_ids=torch.randint(0, vocab, (seq,), generator=g),
                              loss_mask=torch.rand(seq, generator=g) > 0.3,
                              aux_hidden=torch.randn(seq, 3 * width, generator=g), topk_ids=top.indices,
                              topk_logprobs=top.values)
        for s in range(sh.loader_samples):
            write_shard(root, s, [dataclasses.replace(base, sample_id=f"s{s}")], hidden_dtype="fp8", num_aux=3)
        finalize_dataset(root, num_shards=sh.loader_samples, vocab_size=vocab,
                         header={"hidden_size": width, "vocab_size": vocab, "aux_layer_ids": [1, 2, 3],
                                 "hidden_dtype": "fp8", "teacher": {"kinds": ["topk"], "topk": 64}})
        reader = DatasetReader(root)
        pin = device.type == "cuda"
        cpu0, start, tokens = time.process_time(), time.perf_counter(), 0
        for i in range(len(reader)):
            batch = collate_stored([reader.get_stored(i)])
            batch = batch.pin_memory() if pin else batch
            tokens += batch.num_tokens
            batch.to(device, torch.bfloat16)
        _sync(device)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    finally:
        shutil.rmtree(root, ignore_errors=True)
        torch.set_num_threads(max(torch.get_num_threads(), 1))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s_per_core": tokens / seconds,
            "cpu_s_per_mtok": cpu / tokens * 1e6, "pinned": pin}


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    sh = shape(args.tiny or device.type != "cuda")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor()})",
        "torch": torch.__version__, "tiny": sh.drafter is not DRAFTER, "python": platform.python_version(),
        "drafter": sh.drafter, "errors": {}}
    parts = (("matmul", lambda: matmul_rate(device, sh.matmul)),
             ("train_step", lambda: train_step_rates(sh, device, report.get("matmul", {}).get("tflops", 1.0))),
             ("equality", lambda: kernel_equality(sh, device)),
             ("loader", lambda: loader_rate(sh, device)),
             ("long_context", lambda: long_context(sh, device)))
    for name, fn in parts:
        start = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:
            report["errors"][name] = traceback.format_exc()[-4000:]
        print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f} s", flush=True)
    eager = report.get("train_step", {}).get("eager", {})
    if "tokens_per_s" in eager and "loader" in report:
        report["loader"]["cores_per_rank"] = eager["tokens_per_s"] / report["loader"]["tokens_per_s_per_core"]
    return report


def render(r: dict) -> str:
    lines = [f"# GPU check: {r['device']} (torch {r['torch']}){' — tiny shapes' if r['tiny'] else ''}", ""]
    if "matmul" in r:
        m = r["matmul"]
        lines += [f"Dense bf16 matmul ({m['n']}^3): **{m['tflops']:.1f} TFLOP/s**.", ""]
    ts = r.get("train_step")
    if ts:
        lines += [f"Train step, one {ts['seq']}-token sample, TTT {ts['ttt_steps']}, bf16, AdamW:", "",
                  "| kernel | step | tokens/s | TFLOP/s | of matmul rate | peak memory |", "|---|---:|---:|---:|---:|---:|"]
        for impl in IMPLS:
            x = ts.get(impl, {})
            if "step_s" not in x:
                lines.append(f"| {impl} | {x.get('skipped') or x.get('error', '')[:80]} | | | | |")
                continue
            memory = f"{x['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in x else "(not on a CPU)"
            lines.append(f"| {impl} | {x['step_s'] * 1000:.0f} ms | {x['tokens_per_s']:,.0f} | {x['tflops']:.2f} | "
                         f"{x['of_matmul_rate']:.0%} | {memory} |")
        lines.append("")
    eq = r.get("equality")
    if eq:
        lines += [f"Kernels against eager (fp32, T = {eq['seq']}):", ""]
        for impl in IMPLS[1:]:
            x = eq.get(impl, {})
            grads = (f"max gradient rel. diff {x['grad_max_rel_diff']:.1e}" if "grad_max_rel_diff" in x
                     else f"gradients {x.get('grads', 'missing')}")
            lines.append(f"- {impl}: " + (x.get("error") or f"loss rel. diff {x.get('loss_rel_diff', float('nan')):.1e}, "
                                           f"{grads}"))
        lines.append("")
    lo = r.get("loader")
    if lo:
        lines += [f"Loader (stored rows, one core, to the decoded batch on the device): "
                  f"{lo['tokens_per_s_per_core']:,.0f} tokens/s, {lo['cpu_s_per_mtok']:.1f} CPU s per 1M tokens"
                  + (f"; {lo['cores_per_rank']:.2f} cores per rank feed the eager step above" if "cores_per_rank" in lo
                     else "") + ".", ""]
    lc = r.get("long_context")
    if lc:
        lines += [f"Long context: one training step (forward, loss, backward), one sample, TTT {lc['ttt_steps']}, "
                  "bf16; memory: the step's peak over what was allocated before it:", "",
                  "| T | kernel | activation checkpointing | step memory | per token | tokens/s |",
                  "|---:|---|---|---:|---:|---:|"]
        for c in lc["cases"]:
            head = f"| {c['seq']} | {c['impl']} | {'yes' if c['activation_checkpointing'] else 'no'} |"
            if "seconds" not in c:
                lines.append(f"{head} {c.get('skipped') or c.get('error', '')[:80]} | | |")
                continue
            memory = (f"{c['step_memory_gib']:.1f} GiB | {c['kib_per_token']:.0f} KiB" if "step_memory_gib" in c
                      else "(not on a CPU) |")
            lines.append(f"{head} {memory} | {c['tokens_per_s']:,.0f} |")
        lines.append("")
    for name, tb in r.get("errors", {}).items():
        lines += [f"**{name} failed**: `{tb.strip().splitlines()[-1]}`", ""]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (what a CPU runs; CI)")
    p.add_argument("--out", default="", help="write gpu-check.json and gpu-check.md here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = run(args)
    publish(report, render(report), args.out, "gpu-check")
    if args.out:
        (Path(args.out) / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.gpu_check")))
