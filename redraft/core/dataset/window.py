"""The dataset as a stream: a bounded window of shards that extraction fills and training empties (issue 24).

Both sides see one folder (a shared filesystem between inference and training nodes). What they agree on:

- ``plan.json`` (its ``num_shards``) and ``header.json`` (the dataset-level facts the manifest will carry),
  written by extraction before its first shard;
- a shard counts as *landed* once its **seal** ``shards/shard-NNNNNN.seal.json`` exists: written after the
  shard is renamed into place, it holds the shard's sha256, sizes and the plan's fingerprint. A reader
  trains a shard only when the file's sha256 equals its seal and the seal's plan is this folder's, so a
  corrupt or foreign shard is refused by name, never trained on;
- a shard the trainer no longer needs (every micro-batch holding one of its samples is behind a saved
  checkpoint) is **consumed**: its seal moves to ``consumed/`` (atomically) and the shard file is deleted,
  unless the trainer keeps it. Extraction counts a consumed shard as done, so a restarted extraction never
  redoes it.

The window is the bytes (and number) of landed shards still present; extraction starts a shard only when it
will fit: the landed bytes plus the largest shard so far within ``window_bytes``, or fewer landed shards than
``window_shards``. The shard being written counts inside the window; while the writer assembles it, its spill
files hold a second copy for a moment, so the folder peaks at the window plus one shard (per extraction rank).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.core.atomic import atomic_write_text
from redraft.core.config import ConfigError
from redraft.core.dataset.format import SHARD_DIR, DatasetError, sha256_file, shard_relpath

log = logging.getLogger(__name__)

PLAN_NAME = "plan.json"
HEADER_NAME = "header.json"
CONSUMED_DIR = "consumed"
SEAL_SUFFIX = ".seal.json"
TRAINER_DONE = "trainer_done.json"  # the trainer needs no further shard (its schedule ended): extraction stops
WINDOW_NAME = "window.json"  # extraction's window settings (rewritten by every run; not part of the plan)


def window_fit_problem(window_bytes: int, window_shards: int, largest_shard: int, group_shards: int) -> str | None:
    """Why a window cannot feed a trainer that shuffles ``group_shards`` shards together (None: it can).

    The trainer opens a group once all its shards have landed and consumes it only after training it, so the
    window must hold a whole group while the next shard is written: ``group_shards + 1`` shards of up to
    ``largest_shard`` bytes (0: not known, no byte check). A smaller window leaves both sides waiting on each
    other for ever."""
    need = group_shards + 1
    if window_shards and window_shards < need:
        have, fix, fits = f"window_shards={window_shards}", f"window_shards >= {need}", window_shards - 1
    elif window_bytes and largest_shard and window_bytes < need * largest_shard:
        have = f"window_bytes={_size(window_bytes)}"
        fix = f"window_bytes >= {_size(need * largest_shard)} (or smaller shards: shard_bytes, samples_per_shard)"
        fits = window_bytes // largest_shard - 1
    else:
        return None
    group_fix = f", or stream_group_shards <= {fits} (the trainer's and extraction's)" if fits >= 1 else ""
    largest = f"; the largest is {_size(largest_shard)}" if largest_shard else ""
    return (f"{have} cannot hold stream_group_shards={group_shards} shards plus the one being written ({need} "
            f"shards{largest}): extraction and training would wait on each other "
            f"for ever; set {fix}{group_fix}")


def _size(n: int) -> str:
    """A size the size options accept, rounded up (a suggested minimum never falls short)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale}{unit}" if n % scale == 0 else f"{math.ceil(n / scale * 100) / 100:.2f}{unit}"
    return str(n)


def write_window(root: Path, settings: dict[str, int]) -> None:
    """Extraction's window, for the trainer to check its group against (``window_fit_problem``)."""
    atomic_write_text(Path(root) / WINDOW_NAME, json.dumps(settings, sort_keys=True) + "\n")


def read_window(root: Path) -> dict[str, int] | None:
    path = Path(root) / WINDOW_NAME
    if not path.is_file():
        return None
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError) as e:
        raise DatasetError(f"{path}: unreadable: {e}") from e


class StreamClosed(Exception):
    """The streaming trainer has finished; the shards not yet extracted would never be trained."""


def seal_path(root: Path, shard: int) -> Path:
    return Path(root) / shard_relpath(shard).replace(".safetensors", SEAL_SUFFIX)


def consumed_path(root: Path, shard: int) -> Path:
    return Path(root) / CONSUMED_DIR / Path(seal_path(root, shard)).name


def plan_fingerprint(root: Path) -> str:
    """sha256 of plan.json's bytes: what ties a shard to the run that planned it."""
    path = Path(root) / PLAN_NAME
    if not path.is_file():
        raise DatasetError(f"{path}: missing (extraction writes it before its first shard)")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_seal(root: Path, shard: int, info: Any) -> None:
    """After the shard is at its final name: its checksum and sizes, for the reader (``info``: a ShardInfo)."""
    seal = {"shard": shard, "path": info.path, "sha256": info.sha256, "bytes": (Path(root) / info.path).stat().st_size,
            "num_samples": info.num_samples, "num_tokens": info.num_tokens, "num_loss_tokens": info.num_loss_tokens,
            "plan": plan_fingerprint(root)}
    atomic_write_text(seal_path(root, shard), json.dumps(seal, sort_keys=True) + "\n")


def read_seal(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        seal = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: unreadable seal: {e}") from e
    if not isinstance(seal, dict) or not {"sha256", "plan", "bytes"} <= set(seal):
        raise DatasetError(f"{path}: not a shard seal (needs sha256, plan, bytes)")
    return seal


def is_consumed(root: Path, shard: int) -> bool:
    """The trainer is done with this shard (its seal moved to consumed/), for this folder's plan."""
    seal = read_seal(consumed_path(root, shard))
    return seal is not None and seal["plan"] == plan_fingerprint(root)


def landed_shard(root: Path, shard: int, plan: str) -> dict[str, Any] | None:
    """The seal of a landed shard after checking the file against it; None while it has not landed.

    Raises DatasetError naming the file for a shard that is corrupt (sha256 differs from its seal) or
    foreign (sealed for another plan)."""
    seal = read_seal(seal_path(root, shard))
    if seal is None:
        return None
    path = Path(root) / shard_relpath(shard)
    if seal["plan"] != plan:
        raise DatasetError(f"{seal_path(root, shard)}: sealed for another extraction plan ({seal['plan'][:12]}, "
                           f"this folder's is {plan[:12]}): a foreign shard, not trained on")
    if not path.is_file():
        raise DatasetError(f"{path}: sealed but missing (deleted by hand?)")
    digest = sha256_file(path)
    if digest != seal["sha256"]:
        raise DatasetError(f"{path}: sha256 {digest[:12]} differs from its seal {seal['sha256'][:12]}: corrupt, "
                           "not trained on")
    return seal


def consume(root: Path, shard: int, *, keep: bool) -> None:
    """Mark a shard consumed (its seal to consumed/, atomically), then delete the file unless ``keep``."""
    src = seal_path(root, shard)
    dst = consumed_path(root, shard)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        atomic_write_text(dst, src.read_text())
        if not keep:
            src.unlink()
    if not keep:
        (Path(root) / shard_relpath(shard)).unlink(missing_ok=True)


@dataclass(frozen=True)
class WindowUsage:
    shards: int
    bytes: int
    largest: int  # the largest shard sealed so far, consumed ones included: the next shard's expected size


def window_usage(root: Path) -> WindowUsage:
    """Landed shards still in the folder and not consumed (a consumed shard kept by ``stream_keep`` is the
    user's cache, outside the window): their count and bytes, from their seals."""
    shards, total, largest = 0, 0, 0
    for seal_file in sorted((Path(root) / SHARD_DIR).glob(f"shard-*{SEAL_SUFFIX}")):
        seal = read_seal(seal_file)
        if seal is None:
            continue
        largest = max(largest, int(seal["bytes"]))
        if (Path(root) / CONSUMED_DIR / seal_file.name).is_file():
            continue
        if (Path(root) / seal["path"]).is_file():
            shards += 1
            total += int(seal["bytes"])
    for seal_file in (Path(root) / CONSUMED_DIR).glob(f"shard-*{SEAL_SUFFIX}"):
        seal = read_seal(seal_file)
        largest = max(largest, int(seal["bytes"])) if seal is not None else largest
    return WindowUsage(shards, total, largest)


def wait_for_room(root: Path, max_bytes: int, max_shards: int, group_shards: int = 1, *, poll_s: float = 1.0,
                  report_every_s: float = 15.0, sleep: Callable[[float], None] = time.sleep,
                  peer: Callable[[], None] | None = None) -> float:
    """Block while the window is at its limits (0: no limit); returns the seconds waited. Says what it waits on.
    Raises StreamClosed once the trainer has finished (``close_stream``), ConfigError once a landed shard
    shows that the window cannot hold ``group_shards`` + 1 shards (sizes not known when planning: regeneration),
    and whatever ``peer`` raises while it waits (``redraft.core.dataset.liveness.trainer_check``: the trainer is gone)."""
    start = time.perf_counter()
    last = start - report_every_s  # the first wait is reported at once
    while True:
        done = Path(root) / TRAINER_DONE
        if done.is_file():
            raise StreamClosed(f"{done}: the trainer finished ({done.read_text().strip()}); no further shard is needed")
        use = window_usage(root)
        if problem := window_fit_problem(max_bytes, max_shards, use.largest, group_shards):
            raise ConfigError(f"{root}: the shards landed so far show that {problem}")
        # the next shard must fit: its size is estimated by the largest landed so far (the first always starts)
        full = use.shards > 0 and ((max_bytes and use.bytes + use.largest > max_bytes)
                                   or (max_shards and use.shards >= max_shards))
        if not full:
            return time.perf_counter() - start
        if peer is not None:
            peer()
        now = time.perf_counter()
        if now - last >= report_every_s:
            log.info("window full (%d shards, %.1f MB of %s): waiting for training to consume shards in %s",
                     use.shards, use.bytes / 1e6, f"{max_bytes / 1e6:.1f} MB" if max_bytes else f"{max_shards} shards",
                     root)
            last = now
        sleep(poll_s)


def close_stream(root: Path, why: dict[str, Any]) -> None:
    """The trainer's last word: extraction waiting for room stops instead of waiting for ever."""
    atomic_write_text(Path(root) / TRAINER_DONE, json.dumps(why, sort_keys=True) + "\n")


def folder_bytes(root: Path) -> int:
    """Every file's bytes under root (the peak-disk measurement)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total
