"""An extraction folder's state across runs: what lets a killed or repeated run resume safely.

The plan a rerun must agree with (`plan.json`, shard boundaries included), one lock per rank, which
shards are done (they parse and match the manifest's checksum), the temporaries a killed run left,
and the per-shard checks of samples built from generated ids. `extract.pipeline` decides what to
compute; this module only reads and writes the folder's bookkeeping.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from extract.generated import ExactnessCounts
from extract.shard_plan import cut_shards
from redraft.core.atomic import atomic_write_text
from redraft.core.config import ConfigError
from redraft.core.dataset.format import MANIFEST_NAME, shard_relpath
from redraft.core.dataset.window import PLAN_NAME, is_consumed
from redraft.core.dataset.writer import read_shard_info

log = logging.getLogger(__name__)

REGEN_DIR = "regenerated"
REGEN_NAME = "regenerated.jsonl"


@contextlib.contextmanager
def rank_lock(out: Path, rank: int) -> Iterator[None]:
    """Hold an exclusive lock for this rank of this folder, so two runs never interleave shards."""
    lock_dir = out / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"rank-{rank:05d}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"{out}: another extraction process is already writing rank {rank} of this folder"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)



_DERIVED = ("shard_starts", "num_shards", "largest_shard_bytes", "shard_bytes_exact")  # computed from the others


def plan_shards(out: Path, plan: dict[str, Any], sizes: Callable[[], list[int]],
                accept: Callable[[dict[str, Any]], None] = lambda plan: None) -> list[int]:
    """The shard starts of this folder: those in plan.json when it was started with the same settings,
    else cut from `sizes()` (bytes per record) and written there. Refuses a folder started otherwise.
    ``accept(full plan)`` may refuse it (raise) before anything is written."""
    path = out / PLAN_NAME
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in (set(old) | set(plan)) - set(_DERIVED) if old.get(k) != plan.get(k))
        if diff:
            details = "; ".join(f"{k}: folder has {old.get(k)!r}, this run {plan.get(k)!r}" for k in diff)
            raise ConfigError(f"{out} holds an extraction with other settings ({details}); use a new --out")
        accept(old)
        return [int(x) for x in old["shard_starts"]]
    start = time.perf_counter()
    record_bytes = sizes()
    starts = cut_shards(record_bytes, shard_bytes=plan["shard_bytes"], max_records=plan["samples_per_shard"])
    log.info("planned %d shards of <= %d records and <= %s feature bytes in %.1f s", len(starts) - 1,
             plan["samples_per_shard"], f"{plan['shard_bytes']:,}", time.perf_counter() - start)
    # the largest shard's feature bytes: exact unless the answers are yet to be generated (then a bound)
    largest = max((sum(record_bytes[a:b]) for a, b in zip(starts, starts[1:], strict=False)), default=0)
    full = {**plan, "num_shards": len(starts) - 1, "shard_starts": starts, "largest_shard_bytes": largest,
            "shard_bytes_exact": plan.get("generation") is None}
    accept(full)
    atomic_write_text(path, json.dumps(full, indent=2, sort_keys=True) + "\n")
    return starts



def check_path(out: Path, shard: int) -> Path:
    return out / REGEN_DIR / f"shard-{shard:06d}.check.json"


def read_checks(out: Path, num_shards: int) -> dict[str, Any] | None:
    """The dataset's `regeneration` manifest entry: the shards' checks summed (None: no generated samples)."""
    total, found = ExactnessCounts(), False
    for s in range(num_shards):
        path = check_path(out, s)
        if path.exists():
            total.merge(ExactnessCounts.from_json(json.loads(path.read_text())))
            found = True
    if not found:
        return None
    if total.mismatched_samples:
        log.warning("%d of %d samples built from generated ids are not stored as generated; first: %s",
                    total.mismatched_samples, total.samples,
                    ", ".join(f"{m['id']} ({m['problem']})" for m in total.first_mismatches[:3]))
    return total.to_json()


def expected_checksums(out: Path) -> dict[str, str]:
    path = out / MANIFEST_NAME
    if not path.exists():
        return {}
    return {s["path"]: s["sha256"] for s in json.loads(path.read_text()).get("shards", [])}


def shard_is_done(out: Path, shard: int, expected: dict[str, str]) -> bool:
    """Present and sound (checksum as the manifest's, when there is one), or consumed by a streaming trainer."""
    if is_consumed(out, shard):
        return True
    try:
        info = read_shard_info(out, shard)
    except Exception as e:  # a shard that does not parse is redone, whatever the reason
        log.warning("%s: unreadable (%s); redoing it", out / shard_relpath(shard), e)
        return False
    if info is None:
        return False
    want = expected.get(info.path)
    if want is not None and want != info.sha256:
        log.warning("%s: checksum differs from manifest.json; redoing it", out / info.path)
        return False
    return True


def remove_stale_temps(out: Path, shards: Sequence[int]) -> None:
    """Delete temp files a killed run left for this rank's shards (a shard temp can be gigabytes).

    Only this rank writes these shards and we hold its lock, so no live writer owns them.
    """
    for s in shards:
        for folder, pattern in ((out / Path(shard_relpath(s)).parent, f".shard-{s:06d}.*.tmp-*"),  # shard, record, seal
                                (out / REGEN_DIR, f".shard-{s:06d}.jsonl.tmp-*"),
                                (out / REGEN_DIR, f".shard-{s:06d}.check.json.tmp-*")):
            for tmp in folder.glob(pattern) if folder.is_dir() else []:
                log.info("%s: removing the temp file of an interrupted run", tmp)
                tmp.unlink(missing_ok=True)


def concat_regenerated(out: Path, num_shards: int) -> None:
    target = out / REGEN_NAME
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as dst:
        for s in range(num_shards):
            dst.write((out / REGEN_DIR / f"shard-{s:06d}.jsonl").read_bytes())
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, target)
