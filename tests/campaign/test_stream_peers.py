"""A stream never waits on a side that is gone (issue 44): every way one side goes away ends the other.

Real processes on a tiny Llama target (the shape proves nothing here; the processes and the folder do):
``python -m extract --window-shards 3`` and ``train/main.py --stream`` on one folder, with a small
``stream_peer_timeout`` (BOUND). One case per way of going away:

- extraction refuses its options, fails (a full disk), or is stopped (SIGTERM): its end state goes into the folder
  and the trainer stops within a few polls with extraction's own reason (exit 2 for the refusal, 1 otherwise);
- extraction or the trainer is SIGKILLed, or the trainer SIGTERMed (it leaves no word): the other side stops once
  the heartbeat has stood still for BOUND, naming the peer and the heartbeat's age;
- nothing is lost: the trainer that stopped had saved its progress, and restarting both sides finishes the run.

A side that comes back within the bound is waited for as before: the watcher's rule is tests/unit/test_liveness.py's
(a restarted peer is alive at its first beat), and test_stream.py's twenty kills restart each side within it.

Each case prints how long the other side took to stop (the closing note's table).
"""

from __future__ import annotations

import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers_faults import disk_full_cmd, extract_args, extract_cmd, start, train_cmd, write_corpus
from helpers_train import base_args

from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.dataset.liveness import END_DIR, HEARTBEAT_DIR, heartbeat_interval, read_ends
from redraft.core.dataset.window import SEAL_SUFFIX

RECORDS, PER_SHARD, GROUP = 100, 10, 2  # 10 shards; a group of 2 plus the shard being written: a window of 3
BOUND = 6.0  # stream_peer_timeout of both sides, seconds
POLL = 0.2  # the trainer's stream_poll_s (extraction polls for room every second)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    return {"target": make_tiny_llama(root / "target", num_layers=4),
            "corpus": write_corpus(root / "corpus.jsonl", RECORDS, seed=5)}


def _extract(world, out: Path, **kw: object) -> list[str]:
    opts: dict[str, object] = dict(samples_per_shard=PER_SHARD, max_length=128, batch_tokens=1024,
                                   stream_group_shards=GROUP, window_shards=3, stream_peer_timeout=BOUND)
    opts.update(kw)
    return extract_args(world["target"], world["corpus"], out, **opts)


def _train(data: Path, out: Path, **kw: object) -> list[str]:
    opts: dict[str, object] = dict(stream=True, resume="auto", stream_group_shards=GROUP, max_steps=0, save_every=3,
                                   log_every=5, stream_poll_s=POLL, stream_peer_timeout=BOUND, val_fraction=0.0)
    opts.update(kw)
    return base_args(data, out, **opts)


def _until(condition, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _sealed(data: Path) -> int:
    return len(list((data / "shards").glob(f"shard-*{SEAL_SUFFIX}"))) if (data / "shards").is_dir() else 0


def _beating(data: Path, side: str) -> bool:
    return (data / HEARTBEAT_DIR / f"{side}.json").is_file()


def _ended(proc: subprocess.Popen, since: float, timeout: float = 120.0) -> tuple[int, float]:
    """(exit code, seconds from ``since`` to the exit, as this test saw it)."""
    rc = proc.wait(timeout)
    return rc, time.monotonic() - since


def _log(path: Path) -> str:
    return path.read_text(errors="replace")


def _report(case: str, rc: int, seconds: float) -> None:
    print(f"\nstream-peer case | {case} | exit {rc} | {seconds:.1f} s")


def _ckpt_step(run: Path) -> int:
    latest = run / "latest"
    return int(latest.read_text().strip().rsplit("-", 1)[1]) if latest.is_file() else 0


def test_a_refused_extraction_stops_a_waiting_trainer_with_its_reason(world, tmp_path):
    data, tlog = tmp_path / "d", tmp_path / "train.log"
    trainer = start(train_cmd(_train(data, tmp_path / "run")), tlog)
    _until(lambda: _beating(data, "train"), what="the trainer's first heartbeat")
    rc = subprocess.run(extract_cmd(_extract(world, data, window_shards=2)), capture_output=True, text=True,
                        timeout=120).returncode
    t0 = time.monotonic()
    assert rc == 2
    assert read_ends(data)[0]["state"] == "refused"
    assert not (data / "plan.json").exists()  # refused before anything of the dataset was written
    rc, seconds = _ended(trainer, t0)
    _report("extraction refuses (window too small)", rc, seconds)
    out = _log(tlog)
    assert rc == 2, out[-3000:]
    assert "extraction rank 0 refused to run" in out and "window_shards=2" in out and "Traceback" not in out
    assert seconds < BOUND  # told by the end state, not by the heartbeat's bound


def test_a_failed_extraction_stops_the_trainer_after_its_checkpoint_and_both_resume(world, tmp_path):
    data, run, tlog, elog = tmp_path / "d", tmp_path / "run", tmp_path / "train.log", tmp_path / "extract.log"
    trainer = start(train_cmd(_train(data, run)), tlog)
    extractor = start(disk_full_cmd("extract", _extract(world, data), "shard-*.safetensors:6"), elog)
    assert extractor.wait(180) == 1, _log(elog)[-3000:]
    t0 = time.monotonic()
    end = read_ends(data)[0]
    assert end["state"] == "failed" and "No space left" in end["reason"]
    rc, seconds = _ended(trainer, t0)
    _report("extraction fails (disk full at shard 6)", rc, seconds)
    out = _log(tlog)
    assert rc == 1, out[-3000:]
    assert "extraction rank 0 failed" in out and "No space left" in out and "--resume auto" in out
    assert seconds < BOUND
    saved = _ckpt_step(run)
    assert saved > 0  # it had trained groups 0-1 and saved before waiting for group 2

    # nothing lost: the same commands again, and the run finishes from where it stopped
    extractor = start(extract_cmd(_extract(world, data)), elog)
    trainer = start(train_cmd(_train(data, run)), tlog)
    assert extractor.wait(300) == 0, _log(elog)[-3000:]
    assert trainer.wait(300) == 0, _log(tlog)[-3000:]
    assert "resum" in _log(tlog).lower() and _ckpt_step(run) > saved
    assert read_ends(data)[0]["state"] == "finished"


def test_a_stopped_extraction_stops_the_trainer(world, tmp_path):
    data, tlog, elog = tmp_path / "d", tmp_path / "train.log", tmp_path / "extract.log"
    trainer = start(train_cmd(_train(data, tmp_path / "run")), tlog)
    extractor = start(extract_cmd(_extract(world, data)), elog)
    _until(lambda: _sealed(data) >= 2, what="two shards")
    extractor.send_signal(signal.SIGTERM)
    assert extractor.wait(60) == 128 + signal.SIGTERM, _log(elog)[-3000:]
    t0 = time.monotonic()
    assert read_ends(data)[0]["state"] == "stopped"
    rc, seconds = _ended(trainer, t0)
    _report("extraction SIGTERM", rc, seconds)
    out = _log(tlog)
    assert rc == 1 and "extraction rank 0 was stopped: SIGTERM received" in out, out[-3000:]
    assert seconds < BOUND


def _stamp(line: str) -> float:
    """The wall-clock time a log line of ours was written (its asctime prefix, milliseconds)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _last_line(text: str, *parts: str) -> str:
    return [ln for ln in text.splitlines() if all(p in ln for p in parts)][-1]


def test_a_killed_extraction_stops_the_trainer_after_the_bound(world, tmp_path):
    data, tlog, elog = tmp_path / "d", tmp_path / "train.log", tmp_path / "extract.log"
    trainer = start(train_cmd(_train(data, tmp_path / "run")), tlog)
    extractor = start(extract_cmd(_extract(world, data)), elog)
    _until(lambda: _sealed(data) >= 2, what="two shards")
    t0, killed = time.monotonic(), time.time()
    extractor.send_signal(signal.SIGKILL)
    extractor.wait(60)
    rc, seconds = _ended(trainer, t0)
    out = _log(tlog)
    assert rc == 1, out[-3000:]
    assert "extraction rank 0's heartbeat has not moved for" in out and "extraction is gone" in out
    assert not (data / END_DIR).exists()  # nothing could be said: the heartbeat told
    # The trainer judges on its own clock, from the moment it first saw the last beat (at most one beat before the
    # kill), and looks only while it waits: it stops BOUND after its first look at the last beat, which is at the
    # kill if it was waiting then, else when its next wait begins (it may still be starting DeepSpeed or training a
    # group: on a loaded 2-core CI machine that took 85 s). Both moments are in its log: the wait's first line and
    # the error line.
    waited = _stamp(_last_line(out, "waiting for", "(0 s so far)"))
    stopped = _stamp(_last_line(out, "ERROR", "extraction is gone"))
    due = max(killed, waited) + BOUND
    _report(f"extraction SIGKILL (after the bound or its next wait: {stopped - due:+.1f} s)", rc, seconds)
    beat = heartbeat_interval(BOUND)
    assert stopped - killed >= BOUND - beat - 0.1, (killed, waited, stopped)  # never early
    assert stopped - due <= 3, (killed, waited, stopped)  # and at its first look past the bound


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_trainer_gone_stops_extraction_waiting_for_room_after_the_bound(world, tmp_path, sig):
    data, tlog, elog = tmp_path / "d", tmp_path / "train.log", tmp_path / "extract.log"
    trainer = start(train_cmd(_train(data, tmp_path / "run")), tlog)
    _until(lambda: _beating(data, "train"), what="the trainer's first heartbeat")
    trainer.send_signal(sig)
    trainer.wait(60)
    extractor = start(extract_cmd(_extract(world, data)), elog)
    _until(lambda: _sealed(data) == 3 or extractor.poll() is not None, what="a full window")
    t0 = time.monotonic()  # extraction now waits for room: its first look at the trainer's heartbeat
    rc, seconds = _ended(extractor, t0, timeout=180)
    out = _log(elog)
    assert rc == 1, out[-3000:]
    assert "the trainer's heartbeat has not moved for" in out and "the trainer is gone" in out
    assert read_ends(data)[0]["state"] == "stopped"
    assert _sealed(data) == 3  # the window filled; the shards are kept for a trainer restarted with --resume auto
    # from extraction's first look (its first "window full" line) to its error line, both in its own log
    first_look = _stamp(_last_line(out, "window full"))  # reported once: the wait was shorter than 15 s
    stopped = _stamp(_last_line(out, "ERROR", "the trainer is gone"))
    _report(f"trainer {sig.name} (from extraction's first look: {stopped - first_look:.1f} s)", rc, seconds)
    assert BOUND - 0.1 <= stopped - first_look <= BOUND + 3, (first_look, stopped)


def test_slurm_stream_sh_ends_when_extraction_refuses(world, tmp_path):
    """The one-machine job: a window too small for the trainer's group is refused by extraction while planning,
    and the trainer, told by the folder, ends the job with extraction's reason (no job-script logic needed)."""
    import sys

    import yaml
    from helpers_faults import child_env
    from helpers_paths import ROOT

    ext, tr = tmp_path / "extract.yaml", tmp_path / "train.yaml"
    ext.write_text(yaml.safe_dump({"target": str(world["target"]), "data": [str(world["corpus"])],
                                   "samples_per_shard": PER_SHARD, "max_length": 128, "batch_tokens": 1024,
                                   "topk": 4}))
    tr.write_text(yaml.safe_dump({"dtype": "fp32", "draft_vocab_size": 64, "tokens_per_batch": 160,
                                  "intermediate_size": 128, "report_to": "none", "stream_group_shards": GROUP,
                                  "stream_poll_s": POLL}))
    env = {**child_env(), "PYTHON": sys.executable, "EXTRACT_CONFIG": str(ext), "TRAIN_CONFIG": str(tr),
           "WINDOW": "4KiB"}
    t0 = time.monotonic()
    res = subprocess.run(["bash", "slurm/stream.sh", str(tmp_path / "ds"), str(tmp_path / "run")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    _report("slurm/stream.sh, extraction refuses its window (whole job)", res.returncode, time.monotonic() - t0)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "extraction rank 0 refused to run: window_bytes=4KiB cannot hold" in res.stderr
    assert "training exit 2, extraction exit 2" in res.stderr
