"""Disk for a Kimi-K2.5 drafter's data, offline against streaming (issue 24): a table and JSON, no GPU needed.

    python benchmarks/storage_table.py --out docs/results/storage

Bytes per token are the shard layout's (``redraft.core.dataset.format.bytes_per_token``: token id and loss mask, the
aux layers in the storage dtype with their fp8 scales, the teacher). Offline keeps every token until training
ends; a stream (``extract --window-bytes W`` + ``train/main.py --stream``) holds at most the window plus the
shard each extraction rank is writing, whatever the number of conversations. The streamed figure is the
layout's bound; ``tests/campaign/test_stream.py`` measures it at small scale (the folder's peak stayed within window +
one shard).
"""

from __future__ import annotations

import argparse
import logging
import sys

from reporting import publish

from redraft.core import cli as ending
from redraft.core.dataset.format import bytes_per_token

KIMI = {"hidden_size": 7168, "num_aux": 3}  # Kimi-K2.5: hidden 7168, EAGLE-3's three aux layers
LAYOUTS = [("fp8", ("topk",), 64), ("bf16", ("topk",), 64), ("fp8", ("last_hidden",), 0)]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", default="100000,1000000", help="comma-separated dataset sizes")
    p.add_argument("--tokens-per-conversation", type=int, default=2000, help="mean tokens per conversation "
                   "(published Kimi drafters: ~2k)")
    p.add_argument("--window-gib", type=float, default=64, help="the stream's window (extract --window-bytes)")
    p.add_argument("--shard-gib", type=float, default=24, help="extract --shard-bytes (configs/kimi-k25.yaml: 24GiB)")
    p.add_argument("--extract-ranks", type=int, default=8, help="extraction ranks writing at once (array tasks)")
    p.add_argument("--out", default="", help="write storage.json and storage.md here")
    return p.parse_args(argv)


def table(args: argparse.Namespace) -> dict:
    gib = 1 << 30
    stream_bytes = (args.window_gib + args.extract_ranks * args.shard_gib) * gib
    rows = []
    for dtype, teacher, topk in LAYOUTS:
        bpt = bytes_per_token(KIMI["hidden_size"], KIMI["num_aux"], dtype, teacher, topk)
        for n in (int(x) for x in args.conversations.split(",")):
            tokens = n * args.tokens_per_conversation
            rows.append({"hidden_dtype": dtype, "teacher": "+".join(teacher) + (f"-{topk}" if topk else ""),
                         "bytes_per_token": bpt, "conversations": n, "tokens": tokens,
                         "offline_bytes": tokens * bpt, "stream_bytes": stream_bytes})
    return {"command": "python benchmarks/storage_table.py " + " ".join(sys.argv[1:]), "target": "Kimi-K2.5",
            **KIMI, "tokens_per_conversation": args.tokens_per_conversation, "window_gib": args.window_gib,
            "shard_gib": args.shard_gib, "extract_ranks": args.extract_ranks, "rows": rows}


def format_table(report: dict) -> str:
    lines = [f"`{report['command']}`", "",
             f"Kimi-K2.5 (H {report['hidden_size']}, {report['num_aux']} aux layers), "
             f"{report['tokens_per_conversation']:,} tokens per conversation; stream: a {report['window_gib']:g} GiB "
             f"window + {report['extract_ranks']} extraction ranks x one {report['shard_gib']:g} GiB shard", "",
             "| storage | teacher | bytes / token | conversations | offline | streaming |",
             "|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['hidden_dtype']} | {r['teacher']} | {r['bytes_per_token']:,.0f} | {r['conversations']:,} | "
                     f"{r['offline_bytes'] / 1e12:,.1f} TB | {r['stream_bytes'] / 1e9:,.0f} GB |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = table(args)
    publish(report, format_table(report), args.out, "storage")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.storage_table")))
