"""What would make a stream or a trainer wait for ever, or two trainers write one folder, is refused by name.

- a window that cannot hold the trainer's group of shards plus one: refused by extraction before it writes
  anything, and by the trainer from the extraction's window.json and plan.json;
- a trainer waiting for shards an earlier run consumed: stops, naming --resume auto;
- a second train/main.py on the same --out: refused while the first runs, allowed once it is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_faults import child_env, extract_args, write_corpus
from helpers_paths import ROOT
from helpers_store import make_header, make_sample
from helpers_train import base_args, run_main

from extract.__main__ import main as extract_main
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.config import ConfigError
from redraft.core.dataset.format import DatasetError
from redraft.core.dataset.window import (
    HEADER_NAME,
    PLAN_NAME,
    consume,
    window_fit_problem,
    write_seal,
    write_window,
)
from redraft.core.dataset.writer import write_shard
from redraft.core.drafter.folder import CheckpointError
from train.checkpoint import output_lock
from train.config import parse_cli
from train.stream import StreamSource

MiB = 1 << 20


def test_the_fit_rule_names_the_numbers_and_what_would_fit():
    problem = window_fit_problem(3 * MiB, 0, MiB, 4)
    assert "window_bytes=3MiB" in problem and "5 shards" in problem and "window_bytes >= 5MiB" in problem
    assert "stream_group_shards <= 2" in problem
    assert window_fit_problem(5 * MiB, 0, MiB, 4) is None and window_fit_problem(3 * MiB, 0, 0, 4) is None
    assert "window_shards >= 5" in window_fit_problem(0, 4, 0, 4)
    assert "stream_group_shards <=" not in window_fit_problem(0, 1, 0, 1)  # no group fits one shard


def test_extraction_refuses_a_window_too_small_before_writing(tmp_path, caplog):
    """The issue's settings: --window-bytes 3MiB --shard-bytes 1MiB at the trainer's default group of 4."""
    target = make_tiny_llama(tmp_path / "target", num_layers=4)
    corpus = write_corpus(tmp_path / "corpus.jsonl", 400, seed=3)
    out = tmp_path / "ds"
    args = extract_args(target, corpus, out, samples_per_shard=1000, max_length=128, window_bytes="3MiB",
                        shard_bytes="1MiB")
    assert extract_main(args) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "window_bytes=3MiB cannot hold stream_group_shards=4" in line and "window_bytes >= " in line
    assert not (out / PLAN_NAME).exists() and not list(out.glob("shards/*"))  # nothing written
    assert extract_main([*args, "--window-shards", "3"]) == 2  # the count rule, from the options alone


def _stream_folder(root: Path, shards: int, window: dict[str, int] | None, largest: int) -> None:
    """A streamed folder as extraction leaves it: plan, header, window settings, sealed shards."""
    root.mkdir(parents=True)
    (root / PLAN_NAME).write_text(json.dumps({"num_shards": shards, "largest_shard_bytes": largest,
                                              "shard_bytes_exact": True}))
    (root / HEADER_NAME).write_text(json.dumps(make_header(hidden=16, vocab=100, topk=4)))
    if window is not None:
        write_window(root, window)
    for s in range(shards):
        info = write_shard(root, s, [make_sample(f"s{s}", 6, seed=s)], hidden_dtype="bf16", num_aux=3)
        write_seal(root, s, info)


def _source(root: Path, group: int, tmp_path: Path) -> StreamSource:
    cfg = parse_cli(base_args(root, tmp_path / "run", data_order="stream", stream=True, stream_group_shards=group,
                              stream_poll_s=0.05))
    return StreamSource(root, cfg, 0, 1, wait=True)


def test_the_trainer_refuses_a_group_the_window_cannot_hold(tmp_path):
    ds = tmp_path / "ds"
    _stream_folder(ds, 4, {"window_bytes": 3 * MiB, "window_shards": 0, "stream_group_shards": 2}, MiB)
    assert _source(ds, 2, tmp_path).num_shards == 4  # 3 shards of 1 MiB: a group of 2 plus one
    with pytest.raises(ConfigError, match=r"window.json .*window_bytes=3MiB cannot hold stream_group_shards=4"):
        _source(ds, 4, tmp_path)


def test_a_trainer_waiting_for_consumed_shards_stops_naming_resume(tmp_path):
    """An earlier streamed run trained and consumed group 0; the same command without --resume auto would wait
    for it for ever."""
    ds = tmp_path / "ds"
    _stream_folder(ds, 4, None, 0)
    for s in (0, 1):
        consume(ds, s, keep=False)
    source = _source(ds, 2, tmp_path)
    with pytest.raises(DatasetError, match=r"shard 0 \(group 0\) was consumed by an earlier .*--resume auto"):
        source._landed(0)
    assert source._landed(1)  # the group still in the window is there


def test_a_second_trainer_on_one_output_is_refused_until_the_first_dies(tmp_path):
    from helpers_store import make_dataset

    out, data = tmp_path / "run", tmp_path / "ds"
    make_dataset(data)
    with output_lock(out), pytest.raises(CheckpointError, match=r"another train/main.py is training into this"):
        run_main(base_args(data, out))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom train.checkpoint import output_lock\n"
         "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n", str(out)],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = subprocess.run([sys.executable, "train/main.py", *base_args(data, out)], cwd=ROOT,
                             env=child_env(), capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert f"pid {holder.pid}" in res.stderr and "pass another --out" in res.stderr
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # the kernel released the dead holder's lock
        try:
            with output_lock(out):
                break
        except CheckpointError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
