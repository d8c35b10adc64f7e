"""Training memory and speed against the sequence length T: is a training step linear in T?

    python benchmarks/long_context.py --out docs/results/long-context
    python benchmarks/long_context.py --seqs 4096,131072 --impls sdpa   # one path, two lengths

One sample of T tokens through one training step (the TTT unroll of K steps, the loss, the backward; no optimizer
step, whose memory does not depend on T) of an MLA drafter shaped like Kimi-K2.5's (q/k head 192 = 128 nope +
64 rope, v 128, the served 512 + 64 latent) on a reduced width (2 heads, hidden 256, draft vocabulary 4096, a
stored top-8 teacher) so that two CPU cores run T = 128K. Each case runs in its own process and reports the
growth of its peak RSS (``ru_maxrss``) over the step, per token: memory linear in T keeps that figure flat.

``--kimi-width``: the arithmetic at Kimi-K2.5's full drafter shape (benchmarks/loader_throughput.py's DRAFTER:
hidden 7168, 64 heads, MLP 18432, draft vocabulary 32000, TTT 7, bf16), measured on a short sample (T = 128) as
the bytes autograd keeps for the backward per token (saved-tensor hooks, each storage once), with and without
``activation_checkpointing``, beside the per-token inputs (aux states, dense teacher): what T tokens of one
sample hold on a device besides the weights and optimizer state. The GPU check measures the peak at 4K-32K.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from typing import Any

from reporting import child_case, publish

from redraft.core import cli as ending

HEADS, HIDDEN, DRAFT_VOCAB, VOCAB, TOPK, STEPS = 2, 256, 4096, 16384, 8, 3
DEFAULT_SEQS = "4096,8192,16384,32768,65536,131072"


def _drafter(seq: int, impl: str):
    import torch

    from redraft.core.drafter.config import DrafterConfig
    from redraft.core.drafter.kinds import build_drafter
    from redraft.core.drafter.vocab import build_vocab_mapping

    cfg = DrafterConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=192,
                        intermediate_size=2 * HIDDEN, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                        target_hidden_size=HIDDEN, aux_layer_ids=[1, 29, 57], target_num_layers=61,
                        max_position_embeddings=seq + STEPS + 1, torch_dtype="float32", attention="mla",
                        q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, attention_impl=impl)
    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(1))
    drafter.set_vocab_mapping(*build_vocab_mapping(counts, DRAFT_VOCAB))
    return drafter


def _case(seq: int, path: str) -> dict:
    """One training step in this process: its peak RSS growth and seconds. ``path``: an attention path, with
    "+ckpt" for activation checkpointing of each TTT step."""
    import torch

    from redraft.core.teacher_targets import teacher_from_topk
    from train.ttt import ttt_forward

    torch.set_num_threads(2)
    impl, _, ckpt = path.partition("+")
    drafter = _drafter(seq, impl)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    aux = torch.randn(1, seq, 3 * HIDDEN, generator=g)
    ones = torch.ones(1, seq, dtype=torch.long)
    topk_ids = torch.randint(0, VOCAB, (1, seq, TOPK), generator=g)
    topk_logprobs = torch.log_softmax(torch.randn(1, seq, TOPK, generator=g), -1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # inputs and drafter held
    start = time.perf_counter()
    teacher = teacher_from_topk(topk_ids, topk_logprobs, drafter.t2d, drafter.d2t)
    out = ttt_forward(drafter, input_ids=ids, aux_hidden=aux, attention_mask=ones, loss_mask=ones, teacher=teacher,
                      steps=STEPS, recompute=ckpt == "ckpt")
    out.loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seq": seq, "impl": path, "rss_before_bytes": before, "peak_rss_bytes": peak,
            "step_bytes": peak - before, "seconds": seconds, "loss": float(out.loss)}


def kimi_width_bytes(seq: int = 128) -> dict:
    """Bytes kept for the backward per token by one training step at the Kimi drafter's shape, bf16 (CPU)."""
    import torch
    from gpu_check import _drafter as kimi_drafter
    from loader_throughput import DRAFTER

    from redraft.core.teacher_targets import teacher_from_topk
    from train.ttt import ttt_forward

    torch.set_num_threads(2)
    drafter = kimi_drafter(DRAFTER, torch.device("cpu"), torch.bfloat16)  # the GPU check's drafter, on the CPU
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, DRAFTER["draft_vocab_size"], (1, seq), generator=g)
    aux = torch.randn(1, seq, 3 * DRAFTER["target_hidden_size"], generator=g).to(torch.bfloat16)
    ones = torch.ones(1, seq, dtype=torch.long)
    top = torch.log_softmax(torch.randn(1, seq, 256, generator=g), -1).topk(64, dim=-1)
    teacher = teacher_from_topk(ids[..., None].expand(1, seq, 64).contiguous(), top.values, drafter.t2d, drafter.d2t)
    out: dict[str, Any] = {"seq": seq, "ttt_steps": 7, "dtype": "bf16",
                           "aux_input_bytes_per_token": 3 * DRAFTER["target_hidden_size"] * 2,
                           "dense_teacher_bytes_per_token": 2 * DRAFTER["draft_vocab_size"] * 4}
    for recompute in (False, True):
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor, kept: dict[int, int] = kept) -> torch.Tensor:
            storage = t.untyped_storage()
            kept[storage.data_ptr()] = storage.nbytes()
            return t

        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = ttt_forward(drafter, input_ids=ids, aux_hidden=aux, attention_mask=ones, loss_mask=ones,
                              teacher=teacher, steps=7, recompute=recompute)
        res.loss.backward()
        drafter.zero_grad(set_to_none=True)
        params = {p.untyped_storage().data_ptr() for p in drafter.parameters()} | {
            b.untyped_storage().data_ptr() for b in drafter.buffers()}
        saved = sum(n for ptr, n in kept.items() if ptr not in params)  # weights are not activations
        out["checkpointed" if recompute else "plain"] = {"saved_bytes_per_token": saved / seq,
                                                         "seconds": time.perf_counter() - start}
    return out


def render_kimi(k: dict) -> str:
    lines = [f"## At Kimi-K2.5's drafter width (hidden 7168, 64 MLA heads, MLP 18432, draft vocabulary 32000, TTT "
             f"{k['ttt_steps']}, bf16)", "",
             f"Kept for the backward, per token (saved-tensor hooks over one step of a {k['seq']}-token sample, each "
             "storage once, weights left out), and what T tokens of one sample hold on that account:", "",
             "| per token | bytes | T = 4K | T = 32K | T = 64K | T = 128K |", "|---|---:|---:|---:|---:|---:|"]
    rows = [("activations kept, plain", k["plain"]["saved_bytes_per_token"]),
            ("activations kept, activation_checkpointing", k["checkpointed"]["saved_bytes_per_token"]),
            ("aux states in (bf16)", k["aux_input_bytes_per_token"]),
            ("dense draft-vocabulary teacher (fp32 x 2)", k["dense_teacher_bytes_per_token"])]
    for label, b in rows:
        cells = " | ".join(f"{b * t / 2**30:.1f} GiB" for t in (4096, 32768, 65536, 131072))
        lines.append(f"| {label} | {b / 1024:,.0f} KiB | {cells} |")
    lines += ["", "Weights, gradients and AdamW state come on top (they do not depend on T); so do a step's "
              "transient blocks (bounded: the eager kernel's score blocks, the loss head's chunks).", ""]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default=DEFAULT_SEQS, help="sequence lengths, comma-separated")
    p.add_argument("--impls", default="eager,sdpa", help="attention paths (eager, sdpa; flex trains on CUDA only), "
                   "each optionally with +ckpt (activation_checkpointing), e.g. sdpa+ckpt")
    p.add_argument("--out", default="", help="write long-context.json and long-context.md here")
    p.add_argument("--kimi-width", action="store_true", help="also the per-token arithmetic at the Kimi drafter's "
                   "full width (about 8 GB of memory and a few minutes on 2 cores)")
    p.add_argument("--case", default="", help=argparse.SUPPRESS)  # internal: seq:impl, run in a child
    args = p.parse_args(argv)
    try:
        args.seq_list = [int(x) for x in args.seqs.split(",")]
    except ValueError:
        p.exit(2, f"long_context: --seqs {args.seqs!r}: comma-separated integers wanted\n")
    args.impl_list = args.impls.split(",")
    if bad := [i for i in args.impl_list if i not in ("eager", "sdpa", "eager+ckpt", "sdpa+ckpt")]:
        p.exit(2, f"long_context: --impls {','.join(bad)}: eager or sdpa, optionally +ckpt (flex has no backward on "
                  "a CPU)\n")
    return args


def _child(seq: int, impl: str) -> dict:
    return child_case(__file__, "--case", f"{seq}:{impl}")


def run(args: argparse.Namespace) -> dict:
    rows = []
    for seq in args.seq_list:
        for impl in args.impl_list:
            r = _child(seq, impl)
            rows.append(r)
            print(f"  T={seq} {impl}: step +{r['step_bytes'] / 2**30:.2f} GiB "
                  f"({r['step_bytes'] / seq / 1024:.1f} KiB/token), {r['seconds']:.1f} s", flush=True)
    by_impl: dict[str, list[dict]] = {}
    for r in rows:
        by_impl.setdefault(r["impl"], []).append(r)
    spread = {impl: max(r["step_bytes"] / r["seq"] for r in rs) / min(r["step_bytes"] / r["seq"] for r in rs) - 1
              for impl, rs in by_impl.items()}
    for rs in by_impl.values():  # what each further token cost, from the previous length: flat when linear
        for a, b in zip(rs, rs[1:], strict=False):
            b["marginal_bytes_per_token"] = (b["step_bytes"] - a["step_bytes"]) / (b["seq"] - a["seq"])
    return {"heads": HEADS, "hidden": HIDDEN, "draft_vocab": DRAFT_VOCAB, "topk": TOPK, "ttt_steps": STEPS,
            "threads": 2, "rows": rows, "per_token_spread": spread}


def render(report: dict) -> str:
    lines = [f"# Training step memory against T: MLA drafter (Kimi-K2.5's head shapes, {report['heads']} heads, hidden "
             f"{report['hidden']}), K={report['ttt_steps']}", "",
             f"One sample, one step (forward, loss, backward), 2 CPU threads; draft vocabulary {report['draft_vocab']}, "
             f"stored top-{report['topk']} teacher. Step memory: the process's peak RSS growth over the step.", "",
             "| T | path | step memory | per token | per further token | seconds | tokens/s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(report["rows"], key=lambda r: (r["impl"], r["seq"])):
        marginal = (f"{r['marginal_bytes_per_token'] / 1024:.1f} KiB" if "marginal_bytes_per_token" in r else "")
        lines.append(f"| {r['seq']} | {r['impl']} | {r['step_bytes'] / 2**30:.2f} GiB | "
                     f"{r['step_bytes'] / r['seq'] / 1024:.1f} KiB | {marginal} | {r['seconds']:.1f} | "
                     f"{r['seq'] / r['seconds']:.0f} |")
    lines += ["", "Path +ckpt: activation_checkpointing on. Per further token: the step memory's growth from the "
              "previous length over the tokens added (flat when memory is linear in T; the per-token column also "
              "carries the step's fixed part, which the shorter samples feel most).", "",
              "Per-token memory, largest over smallest minus one, per path: "
              + ", ".join(f"{impl} {v:+.1%}" for impl, v in report["per_token_spread"].items()) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.case:
        seq, impl = args.case.split(":")
        print(json.dumps(_case(int(seq), impl)))
        return 0
    report = run(args)
    text = render(report)
    if args.kimi_width:
        report["kimi_width"] = kimi_width_bytes()
        text += "\n" + render_kimi(report["kimi_width"])
    publish(report, text, args.out, "long-context")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.long_context")))
