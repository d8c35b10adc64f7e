"""redraft.core.dataset.liveness: extraction's end state, the heartbeats, and the watcher's own clock (issue 44).

The processes themselves are tests/campaign/test_stream_peers.py; here the rules, with a clock the test moves.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from redraft.core.dataset import liveness as lv


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _beat(root, side: str, beat: int, pid: int = 1) -> None:
    path = lv.heartbeat_path(root, side)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"beat": beat, "pid": pid, "host": "other-node"}))


def test_a_heartbeat_that_stands_still_is_stale_only_after_the_bound_of_the_watchers_clock(tmp_path):
    clock = Clock()
    watch = lv.PeerWatch(tmp_path, timeout_s=10, clock=clock)
    assert watch.age("train") is None and watch.stale("train") is None  # never beaten: not judged (still queued)
    _beat(tmp_path, "train", 1)
    assert watch.age("train") == 0.0  # first look: alive now
    clock.now += 9.5
    assert watch.stale("train") is None
    _beat(tmp_path, "train", 2)  # a beat: alive again, the bound starts over
    assert watch.age("train") == 0.0
    clock.now += 10.5
    assert watch.stale("train") == pytest.approx(10.5)


def test_a_restarted_peer_is_alive_at_its_first_beat(tmp_path):
    clock = Clock()
    watch = lv.PeerWatch(tmp_path, timeout_s=10, clock=clock)
    _beat(tmp_path, "train", 7, pid=100)
    watch.age("train")
    clock.now += 30
    assert watch.stale("train") == pytest.approx(30)
    _beat(tmp_path, "train", 1, pid=200)  # a new process: its counter starts again, the content differs
    assert watch.stale("train") is None


def test_the_peers_own_times_are_never_read(tmp_path):
    """Two nodes' clocks differ: a heartbeat carrying a time hours off changes nothing; only its changes count."""
    clock = Clock()
    watch = lv.PeerWatch(tmp_path, timeout_s=10, clock=clock)
    path = lv.heartbeat_path(tmp_path, "train")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"beat": 1, "time": time.time() - 86_400}))
    assert watch.stale("train") is None
    os.utime(path, (0, 0))  # an mtime from 1970 does not make it old either
    clock.now += 5
    assert watch.stale("train") is None


def test_the_heartbeat_thread_beats_and_stops(tmp_path):
    hb = lv.Heartbeat(tmp_path / "d", "train", interval_s=0.05).start()
    first = json.loads(lv.heartbeat_path(tmp_path / "d", "train").read_text())
    time.sleep(0.3)
    hb.stop()
    after = json.loads(lv.heartbeat_path(tmp_path / "d", "train").read_text())
    assert first["beat"] == 1 and after["beat"] > 2 and after["pid"] == os.getpid()
    time.sleep(0.2)
    assert json.loads(lv.heartbeat_path(tmp_path / "d", "train").read_text()) == after


def test_a_heartbeat_never_recreates_a_deleted_folder(tmp_path):
    hb = lv.Heartbeat(tmp_path / "d", "train", interval_s=0.05).start()
    shutil.rmtree(tmp_path / "d")
    time.sleep(0.3)
    assert not (tmp_path / "d").exists()
    hb.stop()


@pytest.mark.parametrize("state, code, words", [
    ("refused", 2, "refused to run: window_shards=2"),
    ("failed", 1, "failed: window_shards=2"),
    ("stopped", 1, "was stopped: window_shards=2"),
])
def test_extractions_end_says_how_the_trainer_ends(tmp_path, state, code, words):
    lv.write_end(tmp_path, 1, state, "window_shards=2\ncannot hold", 2 if state == "refused" else 1)
    problem = lv.extraction_problem(tmp_path)
    assert problem is not None and problem.exit_code == code
    assert f"extraction rank 1 {words} cannot hold" in str(problem) and "--resume auto" in str(problem)


def test_a_finished_or_restarted_rank_stops_nobody(tmp_path):
    lv.write_end(tmp_path, 0, "finished", "done", 0)
    assert lv.extraction_problem(tmp_path) is None
    lv.write_end(tmp_path, 1, "failed", "disk full", 1)
    assert lv.extraction_problem(tmp_path) is not None
    lv.clear_end(tmp_path, 1)  # rank 1 started again
    assert lv.extraction_problem(tmp_path) is None
    with pytest.raises(ValueError, match="end state 'crashed'"):
        lv.write_end(tmp_path, 0, "crashed", "?", 1)


def test_the_trainer_ignores_the_still_heartbeat_of_a_finished_rank(tmp_path):
    check = lv.extraction_check(tmp_path, timeout_s=0.01)
    _beat(tmp_path, "extract-rank-0", 1)
    _beat(tmp_path, "extract-rank-1", 1)
    lv.write_end(tmp_path, 0, "finished", "done", 0)
    check()  # first look at both
    time.sleep(0.05)
    with pytest.raises(lv.PeerGone, match="extraction rank 1's heartbeat has not moved") as gone:
        check()
    assert gone.value.exit_code == 1
    lv.write_end(tmp_path, 1, "finished", "done", 0)
    check()  # both finished: their heartbeats may stand still for ever


def test_extraction_stops_waiting_for_a_trainer_that_stopped_beating(tmp_path):
    check = lv.trainer_check(tmp_path, timeout_s=0.01)
    check()  # no trainer yet: waited for without bound
    _beat(tmp_path, "train", 1)
    check()
    time.sleep(0.05)
    with pytest.raises(lv.PeerGone, match="the trainer is gone") as gone:
        check()
    assert gone.value.exit_code == 1 and "restart training with --resume auto" in str(gone.value)
