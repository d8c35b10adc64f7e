"""Peak memory of offline chain and tree evaluation at long sequences with Kimi-K2.5's 64 attention heads.

    python benchmarks/eval_memory.py --out docs/results/eval-memory

One sample of T tokens, every position a drafting position (what ``eval.acceptance`` passes for trees), an MLA
drafter with Kimi-K2.5's attention (64 heads, q/k head 192 = 128 nope + 64 rope, v 128, kv_lora 512) on a narrow
hidden size (so that 2 CPU cores run it: the scores' memory depends on heads, T and positions, not on the
hidden width). Each case runs in its own process and reports its peak RSS (``ru_maxrss``) and the peak over the
drafter and step 0 alone: the difference is what the walk adds. "all at once" is the tree walk before
bounded evaluation (every position's nodes scored against every prefix key in one tensor), run only where it fits
this machine; beyond, its size is the formula ``eval.simulate`` bounds (fp32 scores x copies).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time

from reporting import child_case, publish

from redraft.core import cli as ending

HEADS, TOPK, STEPS, DRAFT_TOKENS = 64, 2, 3, 6


def _drafter(hidden: int):
    import torch

    from redraft.core.drafter.config import DrafterConfig
    from redraft.core.drafter.modeling import Eagle3Drafter

    cfg = DrafterConfig(hidden_size=hidden, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=192,
                        intermediate_size=2 * hidden, vocab_size=4096, draft_vocab_size=2048,
                        target_hidden_size=hidden, aux_layer_ids=[1, 29, 57], target_num_layers=61,
                        max_position_embeddings=8192, torch_dtype="float32", attention="mla", q_lora_rank=256,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    torch.manual_seed(0)
    return Eagle3Drafter(cfg).eval()


def _case(seq: int, hidden: int, mode: str) -> dict:
    """One measurement in this process: mode 'step0', 'chain', 'tree' (bounded) or 'tree-all' (one chunk)."""
    import torch

    from eval import simulate as sim

    torch.set_num_threads(2)
    drafter = _drafter(hidden)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4096, (1, seq), generator=g)
    aux = torch.randn(1, seq, 3 * hidden, generator=g)
    ones = torch.ones(1, seq, dtype=torch.bool)
    target = torch.randint(0, 4096, (1, seq), generator=g)
    start = time.perf_counter()
    with torch.no_grad():
        res, s0 = sim.simulate_chain_greedy(drafter, input_ids=ids, aux_hidden=aux, attention_mask=ones,
                                            loss_mask=ones, target_ids=target, steps=STEPS)
        accepted = int(res.accepted.sum())
        if mode.startswith("tree"):
            budget = 1 << 62 if mode == "tree-all" else sim.TREE_SCORE_BYTES
            tres = sim.simulate_tree(drafter, s0, input_ids=ids, loss_mask=ones, target_ids=target,
                                     positions=sim.drafting_positions(ones, ones), topk=TOPK,
                                     num_draft_tokens=DRAFT_TOKENS, steps=STEPS, max_score_bytes=budget)
            accepted = int(tres.accepted.sum())
    seconds = time.perf_counter() - start
    return {"seq": seq, "mode": mode, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "seconds": seconds, "accepted": accepted}


def _all_at_once_bytes(seq: int) -> int:
    from eval import simulate as sim

    return seq * TOPK * HEADS * seq * 4 * sim._SCORE_COPIES  # every position's nodes x prefix keys


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="1024,2048,4096", help="sequence lengths")
    p.add_argument("--hidden", type=int, default=256, help="drafter hidden size (heads and head dims are Kimi's)")
    p.add_argument("--all-at-once-max-bytes", type=int, default=6 << 30,
                   help="run the unbounded tree only where its scores need at most this many bytes")
    p.add_argument("--out", default="", help="write eval-memory.json and eval-memory.md here")
    p.add_argument("--case", default="", help=argparse.SUPPRESS)  # internal: seq:mode, run in a child
    return p.parse_args(argv)


def _child(seq: int, hidden: int, mode: str) -> dict:
    return child_case(__file__, "--case", f"{seq}:{mode}", "--hidden", str(hidden))


def run(args: argparse.Namespace) -> dict:
    rows = []
    for seq in (int(x) for x in args.seqs.split(",")):
        modes = ["chain", "tree"] + (["tree-all"] if _all_at_once_bytes(seq) <= args.all_at_once_max_bytes else [])
        row = {"seq": seq, "all_at_once_score_bytes": _all_at_once_bytes(seq)}
        for mode in modes:
            r = _child(seq, args.hidden, mode)
            row[mode] = r
            print(f"  T={seq} {mode}: peak {r['peak_rss_bytes'] / 2**30:.2f} GiB, {r['seconds']:.1f} s", flush=True)
        if "tree-all" in row:
            assert row["tree-all"]["accepted"] == row["tree"]["accepted"], row  # bounded = unbounded results
        rows.append(row)
    return {"heads": HEADS, "topk": TOPK, "steps": STEPS, "num_draft_tokens": DRAFT_TOKENS, "hidden": args.hidden,
            "all_at_once_max_bytes": args.all_at_once_max_bytes,
            "tree_score_bytes": __import__("eval.simulate", fromlist=["x"]).TREE_SCORE_BYTES, "rows": rows}


def render(report: dict) -> str:
    gib = 2**30
    lines = [f"# Offline evaluation memory: one sample, every position, MLA drafter with {report['heads']} heads",
             "", f"Chain K={report['steps']}; tree topk {report['topk']}, {report['num_draft_tokens']} draft tokens, "
             f"depth {report['steps']}; tree positions in chunks of at most {report['tree_score_bytes'] >> 20} MiB "
             "of scores. Peak RSS of the whole process (drafter, inputs, step 0 included).", "",
             "| T | chain | tree, bounded (now) | tree, all positions at once (before) | its scores alone |",
             "|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        before = (f"{r['tree-all']['peak_rss_bytes'] / gib:.2f} GiB" if "tree-all" in r
                  else f"not run (> {report.get('all_at_once_max_bytes', 6 << 30) / gib:.0f} GiB of scores)")
        lines.append(f"| {r['seq']} | {r['chain']['peak_rss_bytes'] / gib:.2f} GiB | "
                     f"{r['tree']['peak_rss_bytes'] / gib:.2f} GiB ({r['tree']['seconds']:.0f} s) | {before} | "
                     f"{r['all_at_once_score_bytes'] / gib:.1f} GiB |")
    lines += ["", "Where both ran, the bounded and the all-at-once walks accepted the same drafts (asserted).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.case:
        seq, mode = args.case.split(":")
        print(json.dumps(_case(int(seq), args.hidden, mode)))
        return 0
    report = run(args)
    publish(report, render(report), args.out, "eval-memory")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.eval_memory")))
