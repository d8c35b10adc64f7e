"""What a shard's writer computed, kept beside the shard: resume and finalize trust it instead of re-reading.

The writer hashes a shard as it streams it out (``ShardWriter``); hashing it again on every resume and at
finalize reads the whole dataset each time (hours at 2,000 shards of ~11 GB). So the writer leaves
``shards/shard-NNNNNN.record.json`` after the rename: the shard's ShardInfo (sha256 and counts) plus the size and
mtime the file had then. A record is trusted only while the file's size and mtime are those it recorded; any
rewrite of the file (a rerun, a copy without preserved times, an edit) makes it stale and the shard is read and
hashed again. Silent corruption that keeps size and mtime (bit rot) is what ``extract.verify --deep`` re-hashes
for.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from redraft.core.atomic import atomic_write_text
from redraft.core.dataset.format import ShardInfo, shard_relpath

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".record.json"


def record_path(root: Path, index: int) -> Path:
    return record_path_of(Path(root) / shard_relpath(index))


def record_path_of(shard: Path) -> Path:
    return shard.with_name(shard.name.replace(".safetensors", RECORD_SUFFIX))


def _stamp(path: Path) -> dict[str, int]:
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_record(root: Path, index: int, info: ShardInfo) -> None:
    """After shard ``index`` is at its final name: its info and the file's size and mtime (atomically)."""
    record = {**asdict(info), "file": _stamp(Path(root) / info.path)}
    atomic_write_text(record_path(root, index), json.dumps(record, sort_keys=True) + "\n")


def recorded_info(root: Path, index: int) -> ShardInfo | None:
    """The shard's ShardInfo as its writer recorded it, or None when there is no record, it does not parse, or
    the file is no longer the one recorded (size or mtime changed): then the caller reads the shard itself."""
    rel = shard_relpath(index)
    record = _fresh_record(Path(root) / rel)
    if record is None or record.get("path") != rel:
        return None
    try:
        return ShardInfo(path=rel, sha256=str(record["sha256"]), num_samples=int(record["num_samples"]),
                         num_tokens=int(record["num_tokens"]), num_loss_tokens=int(record["num_loss_tokens"]),
                         skipped={str(k): int(v) for k, v in dict(record.get("skipped") or {}).items()})
    except (KeyError, TypeError, ValueError):
        return None


def recorded_sha256(shard: Path) -> str | None:
    """The sha256 the writer recorded for the file at ``shard`` while it is still that file (else None)."""
    record = _fresh_record(shard)
    sha = record.get("sha256") if record is not None else None
    return sha if isinstance(sha, str) else None


def _fresh_record(shard: Path) -> dict | None:
    path = record_path_of(shard)
    try:
        record = json.loads(path.read_text())
        stamp = _stamp(shard)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("file") != stamp:
        log.debug("%s: stale record (the shard was rewritten since); it is read again", path)
        return None
    return record
