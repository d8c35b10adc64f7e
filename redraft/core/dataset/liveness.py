"""Whether the other side of a stream is still there: extraction's end state and both sides' heartbeats (issue 44).

A streamed run is two programs that meet only in the dataset folder, often on two nodes. Each waits for the other
(the trainer for shards, extraction for room in its window), so each must be able to tell from the folder alone
that the other is gone:

- ``extract_end/rank-R.json``: how extraction rank R ended, written atomically before it exits in every way it can
  still act on: ``finished``, ``refused`` (the user's input: exit 2), ``failed`` (exit 1) or ``stopped`` (a signal).
  A rank that starts again removes its own, so a restarted extraction is waited for as before.
- ``heartbeats/extract-rank-R.json`` and ``heartbeats/train.json``: a counter each side rewrites every few seconds
  while it runs (a daemon thread). What cannot be caught (SIGKILL, a lost node) shows as a counter that stops.

Clock honesty: two nodes' clocks differ, so no wall time from the other machine is compared with this one's. The
watcher notes when *it* last saw the peer's heartbeat change, on its own monotonic clock; the peer is gone once that
is longer ago than the bound. A peer that comes back (a restart rewrites the file with a new pid and counter) is
seen as alive again at its first beat.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.core.atomic import atomic_write_text
from redraft.core.errors import Failure

log = logging.getLogger(__name__)

END_DIR = "extract_end"
HEARTBEAT_DIR = "heartbeats"
TRAINER = "train"
END_STATES = ("finished", "refused", "failed", "stopped")
DEFAULT_PEER_TIMEOUT_S = 900.0  # far above a poll (seconds) and a restart on the same allocation (a minute or two)


class PeerGone(Failure):
    """The other side of the stream is gone: ``exit_code`` is what this side should end with (2: the user's
    input was refused on the other side; 1: it failed, was stopped or stopped beating)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def extractor_name(rank: int) -> str:
    return f"extract-rank-{rank}"


def heartbeat_interval(timeout_s: float) -> float:
    """How often a side beats: often enough that the watcher's bound is many beats long."""
    return max(0.2, min(15.0, timeout_s / 10))


# ----------------------------------------------------------------------------- extraction's end state


def end_path(root: Path, rank: int) -> Path:
    return Path(root) / END_DIR / f"rank-{rank}.json"


def write_end(root: Path, rank: int, state: str, reason: str, exit_code: int) -> None:
    """How extraction rank ``rank`` ended (atomic: the watcher reads all of it or nothing)."""
    if state not in END_STATES:
        raise ValueError(f"end state {state!r}: one of {', '.join(END_STATES)}")
    path = end_path(root, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"state": state, "reason": " ".join(str(reason).split()), "exit_code": exit_code, "rank": rank,
              "pid": os.getpid(), "host": socket.gethostname()}
    atomic_write_text(path, json.dumps(record, sort_keys=True) + "\n")


def clear_end(root: Path, rank: int) -> None:
    """A rank starting (again): its previous end, if any, no longer holds."""
    end_path(root, rank).unlink(missing_ok=True)


def read_ends(root: Path) -> dict[int, dict[str, Any]]:
    """Every extraction rank's end state, by rank (unreadable files are skipped: a write is atomic, so such a
    file was not written by redraft)."""
    ends: dict[int, dict[str, Any]] = {}
    for path in sorted((Path(root) / END_DIR).glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
            ends[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ends


def extraction_problem(root: Path) -> PeerGone | None:
    """The first extraction rank that ended without finishing, as the trainer should end (None: none did)."""
    for rank, end in sorted(read_ends(root).items()):
        if end.get("state") == "finished":
            continue
        code = 2 if end.get("state") == "refused" else 1
        how = {"refused": "refused to run", "failed": "failed", "stopped": "was stopped"}.get(end.get("state"), "ended")
        fix = ("fix what it names and run extraction again" if code == 2
               else "run the same extraction command again (it resumes)")
        return PeerGone(f"{Path(root)}: extraction rank {rank} {how}: {end.get('reason', '?')} ({fix}; then "
                        "restart training with --resume auto)", code)
    return None


# ----------------------------------------------------------------------------- heartbeats


def heartbeat_path(root: Path, side: str) -> Path:
    return Path(root) / HEARTBEAT_DIR / f"{side}.json"


class Heartbeat:
    """Rewrite ``heartbeats/<side>.json`` with a growing counter every ``interval_s`` until ``stop`` (a daemon
    thread: it dies with the process, which is what a SIGKILL must look like to the peer)."""

    def __init__(self, root: Path, side: str, interval_s: float) -> None:
        self.path = heartbeat_path(root, side)
        self.interval_s = interval_s
        self.beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.beats += 1
        self.path.parent.mkdir(exist_ok=True)  # not the folder itself: a folder deleted under a run stays deleted
        atomic_write_text(self.path, json.dumps({"beat": self.beats, "pid": os.getpid(), "host": socket.gethostname(),
                                                 "interval_s": self.interval_s}) + "\n")

    def start(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)  # a trainer may start before extraction made the folder
        self.beat()  # the first beat before anything waits on it
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.path.stem}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except OSError as e:  # a full or lost disk, a deleted folder: the beats stop, which is the truth
                log.warning("heartbeat %s stopped: %s", self.path, e)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class _Seen:
    content: str
    since: float  # this machine's monotonic clock when the content last changed


class PeerWatch:
    """The other side's heartbeats, judged on this side's own clock: a heartbeat file that has not changed for
    ``timeout_s`` seconds of this watcher's monotonic time is a peer that is gone."""

    def __init__(self, root: Path, timeout_s: float, clock: Any = time.monotonic) -> None:
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}

    def age(self, side: str) -> float | None:
        """Seconds (this machine's) since ``side``'s heartbeat last changed; None while it has never beaten."""
        try:
            content = heartbeat_path(self.root, side).read_text()
        except OSError:
            return None
        now = self.clock()
        seen = self._seen.get(side)
        if seen is None or seen.content != content:  # first look, or a beat since: alive now
            self._seen[side] = _Seen(content, now)
            return 0.0
        return now - seen.since

    def stale(self, side: str) -> float | None:
        """The heartbeat's age when it is past the bound, else None."""
        age = self.age(side)
        return age if age is not None and age > self.timeout_s else None

    def sides(self, prefix: str) -> list[str]:
        """The heartbeat names under ``heartbeats/`` that start with ``prefix``."""
        return sorted(p.stem for p in (self.root / HEARTBEAT_DIR).glob(f"{prefix}*.json"))


# ----------------------------------------------------------------------------- what each side checks while it waits


def trainer_check(root: Path, timeout_s: float) -> Any:
    """Extraction's check while it waits for room: raises PeerGone once the trainer's heartbeat has stood still
    for ``timeout_s`` (a trainer that has not beaten yet, e.g. still queued, is waited for)."""
    watch = PeerWatch(root, timeout_s)

    def check() -> None:
        age = watch.stale(TRAINER)
        if age is not None:
            raise PeerGone(f"{heartbeat_path(root, TRAINER)}: the trainer's heartbeat has not moved for {age:.0f} s "
                           f"(stream_peer_timeout {timeout_s:g} s): the trainer is gone. The shards landed so far "
                           "are kept: restart training with --resume auto, then run this extraction again (it "
                           "resumes)")
    return check


def extraction_check(root: Path, timeout_s: float) -> Any:
    """The trainer's check while it waits for shards: raises PeerGone when an extraction rank ended without
    finishing (its own reason and exit code), or when a rank that has not finished stopped beating for
    ``timeout_s``."""
    watch = PeerWatch(root, timeout_s)

    def check() -> None:
        if problem := extraction_problem(root):
            raise problem
        ends = read_ends(root)
        for side in watch.sides("extract-rank-"):
            rank = int(side.rsplit("-", 1)[1])
            if ends.get(rank, {}).get("state") == "finished":
                continue
            age = watch.stale(side)
            if age is not None:
                raise PeerGone(f"{heartbeat_path(root, side)}: extraction rank {rank}'s heartbeat has not moved for "
                               f"{age:.0f} s (stream_peer_timeout {timeout_s:g} s): extraction is gone. Run the "
                               "same extraction command again (it resumes), then restart training with "
                               "--resume auto")
    return check
