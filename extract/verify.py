"""Check a dataset folder against its manifest: `python -m extract.verify DIR [--deep]`.

Run before training on data that was copied or sat on shared storage: a flipped byte or a
truncated copy would otherwise surface as a crash (or silent garbage) hours into a run.
Exit codes: 0 all good, 1 problems found (one line per bad file), 2 usage error / no
readable manifest.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from redraft.core import cli as ending
from redraft.core import options
from redraft.core.config import ConfigError
from redraft.core.dataset.format import (
    COUNTS_NAME,
    MANIFEST_NAME,
    DatasetError,
    ShardHeader,
    load_manifest,
    read_shard_header,
    resolve_inside,
    sha256_file,
)
from redraft.core.dataset.fp8 import dequantize_fp8
from redraft.core.dataset.shard_record import recorded_sha256
from redraft.core.dataset.token_counts import count_tokens
from redraft.core.dataset.writer import shard_loss_tokens
from redraft.core.options import option

logger = logging.getLogger(__name__)

_DEEP_CHUNK_BYTES = 256 << 20  # rows read at once by --deep, bounding memory on multi-GB shards
_FLOAT_KEYS = (("aux_hidden", "aux_scale"), ("last_hidden", "last_scale"), ("topk_logprobs", None))


def _non_finite_keys(path: Path, hdr: ShardHeader) -> list[str]:
    """Keys of a shard holding NaN/Inf (after fp8 dequantisation), reading rows in bounded chunks."""
    bad: list[str] = []
    with safe_open(str(path), framework="pt") as f:
        for key, scale_key in _FLOAT_KEYS:
            if key not in hdr.shapes:
                continue
            n, width = hdr.shapes[key]
            step = max(1, _DEEP_CHUNK_BYTES // max(1, width * 4))
            for a in range(0, n, step):
                x = f.get_slice(key)[a : a + step]
                if scale_key is not None and scale_key in hdr.shapes:
                    x = dequantize_fp8(x, f.get_slice(scale_key)[a : a + step])
                if not bool(torch.isfinite(x.float()).all()):
                    bad.append(key)
                    break
    return bad


def _check_shard(root: Path, entry: Any, index: int, deep: bool) -> tuple[str, list[str], Path | None]:
    """(name, problems, path if readable) for one manifest shard entry."""
    if not isinstance(entry, dict) or "path" not in entry:
        return f"{MANIFEST_NAME} shards[{index}]", ["entry has no 'path'"], None
    name = str(entry["path"])
    try:
        path = resolve_inside(root, entry["path"])
    except DatasetError as e:
        return name, [str(e)], None
    if not path.is_file():
        return name, ["missing"], None
    problems: list[str] = []
    recorded = None if deep else recorded_sha256(path)  # hashed once by its writer, the file unchanged since
    digest = recorded or sha256_file(path)
    if digest != entry.get("sha256"):
        what = "its writer's record" if recorded else "file"
        problems.append(f"sha256 mismatch (manifest {entry.get('sha256')}, {what} {digest})")
    try:
        hdr = read_shard_header(path)
        loss = shard_loss_tokens(path)
    except DatasetError as e:
        problems.append(f"truncated or unreadable: {e}")
        return name, problems, None
    if loss != [int(s["num_loss_tokens"]) for s in hdr.samples]:
        problems.append("metadata num_loss_tokens disagree with loss_mask")
    actual = {"num_samples": len(hdr.samples), "num_tokens": hdr.num_tokens, "num_loss_tokens": sum(loss)}
    for key, got in actual.items():
        if entry.get(key) != got:
            problems.append(f"counts differ: {key} manifest {entry.get(key)}, shard {got}")
    if deep:
        bad = _non_finite_keys(path, hdr)
        if bad:
            problems.append(f"non-finite values in {', '.join(bad)}")
    return name, problems, path


def _check_counts(root: Path, manifest: dict, shard_paths: list[Path] | None, deep: bool) -> list[str]:
    path = root / COUNTS_NAME
    if not path.is_file():
        return ["missing"]
    try:
        counts = load_file(str(path)).get("counts")
    except SafetensorError as e:
        return [f"truncated or unreadable: {e}"]
    vocab = int(manifest["vocab_size"])
    if counts is None or counts.dtype != torch.int64 or tuple(counts.shape) != (vocab,):
        desc = "no key 'counts'" if counts is None else f"{counts.dtype} {list(counts.shape)}"
        return [f"key 'counts' is {desc}, expected int64 [{vocab}]"]
    problems = []
    total = int(counts.sum())
    if total != int(manifest.get("num_loss_tokens", -1)):
        problems.append(
            f"counts sum to {total}, manifest num_loss_tokens is {manifest.get('num_loss_tokens')}"
        )
    if deep:
        if shard_paths is None:
            problems.append("not recomputed: some shards are unreadable")
        else:
            try:
                if not torch.equal(count_tokens(shard_paths, vocab), counts):
                    problems.append("differs from the counts recomputed from the shards")
            except DatasetError as e:
                problems.append(f"not recomputed: {e}")
    return problems


def verify_dataset(root: str | Path, deep: bool = False) -> list[str]:
    """Problems found in a dataset folder, one line per bad file; empty when it is intact.

    Checks every shard exists inside the root, matches its manifest sha256 and counts, and
    parses consistently; the manifest totals equal the sum of shards; token_counts has the
    right shape and total. A shard's sha256 is the one its writer recorded while the file keeps the
    size and mtime it had then (``redraft.core.dataset.shard_record``), else the file is hashed. `deep` re-hashes
    every shard, checks every hidden/logprob value is finite and recomputes the token counts. Raises DatasetError when there is no readable manifest.
    """
    root = Path(root)
    manifest = load_manifest(root)
    lines: list[str] = []
    paths: list[Path] = []
    all_readable = True
    totals = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0}
    for i, entry in enumerate(manifest["shards"]):
        name, problems, path = _check_shard(root, entry, i, deep)
        if problems:
            lines.append(f"{name}: {'; '.join(problems)}")
        if path is None:
            all_readable = False
        else:
            paths.append(path)
        if isinstance(entry, dict):
            for key in totals:
                value = entry.get(key, 0)
                totals[key] += value if isinstance(value, int) else 0
    mismatched = [
        f"{k} {manifest.get(k)} != sum of shards {v}" for k, v in totals.items() if manifest.get(k) != v
    ]
    if mismatched:
        lines.append(f"{MANIFEST_NAME}: manifest totals disagree with shards: {'; '.join(mismatched)}")
    count_problems = _check_counts(root, manifest, paths if all_readable else None, deep)
    if count_problems:
        lines.append(f"{COUNTS_NAME}: {'; '.join(count_problems)}")
    return lines


@dataclass(kw_only=True)
class VerifyOptions:
    """The options of python -m extract.verify (redraft.core.options)."""

    dir: str = option(help="dataset folder (the one holding manifest.json and shards/)", group="inputs",
                      positional=True, metavar="DIR")
    deep: bool = option(False, "also read every byte: re-hash every shard (without it, a shard whose size and mtime "
                               "are still those its writer recorded is checked by the recorded sha256), check that "
                               "all hidden states (fp8 dequantised) and teacher log-probabilities are finite, and "
                               "recompute token_counts.safetensors (reads the whole dataset; slower)",
                        group="checks")
    quiet: bool = option(False, "print nothing when the dataset is intact", group="output", short="-q")


PROG = "python -m extract.verify"
DESCRIPTION = ("Verify a redraft dataset folder against its manifest.json: every shard exists, its sha256 and "
               "sample/token/loss-token counts match the manifest, the manifest totals equal the sum of the shards, "
               "and token_counts.safetensors has the right shape and total. Prints one line per bad file. Exit "
               "status: 0 intact, 1 problems found, 2 usage error or no readable manifest.")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(VerifyOptions, prog=PROG, description=DESCRIPTION)


def main(argv: list[str] | None = None) -> int:
    ending.configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")
    try:
        args = options.parse(VerifyOptions, argv, prog=PROG, description=DESCRIPTION, section="verify")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=sys.stderr)
        return 2
    try:
        problems = verify_dataset(root, deep=args.deep)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(line)
    if problems:
        return 1
    if not args.quiet:
        print(f"OK: {root} ({'deep' if args.deep else 'checksums and counts'})")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("extract.verify"))


if __name__ == "__main__":
    sys.exit(cli())
