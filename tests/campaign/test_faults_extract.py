"""Fault suite, extraction side: kills, concurrent ranks, disk full, non-finite captures, bad input.

Every case compares against an uninterrupted run of the same command: the dataset after any
fault and a rerun must be byte-identical, and no file at a final name may ever be partial.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers_faults import (
    dataset_files,
    extract_args,
    extract_cmd,
    kill_when,
    partial_files_at_final_names,
    run,
    self_kill_cmd,
    start,
    temp_leftovers,
    write_corpus,
    write_malformed_corpus,
)

import redraft.core.atomic as atomic
from extract.__main__ import main as extract_main
from extract.backends.hf import HFTarget
from extract.config import parse_args
from extract.pipeline import run_extraction
from extract.records import BadRecordError, read_records
from extract.run_state import rank_lock
from extract.verify import verify_dataset
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.dataset.format import MANIFEST_NAME, read_shard_header
from redraft.core.dataset.reader import DatasetReader
from redraft.core.dataset.shard_record import RECORD_SUFFIX

NUM_SAMPLES = 240
PER_SHARD = 20  # 12 shards
SMALL = dict(samples_per_shard=5, max_length=256, batch_tokens=2048)  # in-process cases: 40 samples, 8 shards


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults_extract")
    target = make_tiny_llama(root / "target", num_layers=6)
    corpus = write_corpus(root / "corpus.jsonl", NUM_SAMPLES, seed=11)
    small = write_corpus(root / "small.jsonl", 40, seed=12)
    return {"root": root, "target": target, "corpus": corpus, "small": small}


def _args(world, out: Path, data: Path | None = None, **kw) -> list[str]:
    opts = dict(samples_per_shard=PER_SHARD, max_length=256, batch_tokens=2048)
    opts.update(kw)
    return extract_args(world["target"], data or world["corpus"], out, **opts)


@pytest.fixture(scope="module")
def reference(world) -> Path:
    """An uninterrupted run of the big corpus (in process; the bytes do not depend on the process)."""
    out = world["root"] / "reference"
    assert run_extraction(parse_args(_args(world, out))).manifest is not None
    return out


@pytest.fixture(scope="module")
def small_reference(world) -> Path:
    out = world["root"] / "small_reference"
    assert run_extraction(parse_args(extract_args(world["target"], world["small"], out, **SMALL))).manifest
    return out


# ----------------------------------------------------------------------------- 1. kill and resume


def test_kill_and_resume_extraction_is_byte_identical(world, reference, tmp_path):
    out = tmp_path / "ds"
    args = _args(world, out)
    log = tmp_path / "extract.log"
    shards = out / "shards"

    def n_shards() -> int:
        return len(list(shards.glob("shard-*.safetensors"))) if shards.is_dir() else 0

    rounds = [
        ("external: while loading the target / first forward", None, lambda: (out / "plan.json").exists()),
        ("external: mid-forward, after 3 shards", None, lambda: n_shards() >= 3),
        ("external: as soon as a shard temp file appears",
         None, lambda: shards.is_dir() and any(shards.glob(".shard-*.tmp-*"))),
        ("self: mid-shard-write (temp half written)", ("shard-*.safetensors:1", True), None),
        ("self: shard fully written, not yet renamed", ("shard-*.safetensors:2", False), None),
        ("self: mid-finalize (token counts)", ("token_counts.safetensors:1", False), None),
        ("self: mid-manifest", ("manifest.json:1", True), None),
    ]
    progress = []
    for name, self_kill, condition in rounds:
        if self_kill is None:
            proc = start(extract_cmd(args), log)
            killed = kill_when(proc, condition)  # False only if the run finished first (a slow poller)
            assert killed or proc.returncode == 0, f"{name}: exit {proc.returncode}, see {log}"
        else:
            killed = run(self_kill_cmd("extract", args, self_kill[0], truncate=self_kill[1]), log) == -9
            assert killed, f"{name}: the kill point was not reached, see {log}"
        progress.append((name, n_shards()))
        assert partial_files_at_final_names(out) == [], name
        assert not killed or not (out / MANIFEST_NAME).exists(), name  # every kill comes before the rename
    assert run(extract_cmd(args), log) == 0
    assert dataset_files(out) == dataset_files(reference), progress
    assert temp_leftovers(shards) == []  # killed runs' shard temps are removed by the next run
    assert verify_dataset(out, deep=True) == []


# ----------------------------------------------------------------------------- 7. concurrency


def test_concurrent_ranks_write_the_same_bytes_as_one(world, small_reference, tmp_path):
    out = tmp_path / "ds"
    log = tmp_path / "ranks.log"
    cmds = [extract_cmd(extract_args(world["target"], world["small"], out, rank=r, world_size=3, **SMALL))
            for r in range(3)]
    procs = [start(cmd, log) for cmd in cmds]
    codes = [p.wait(300) for p in procs]
    assert codes == [0, 0, 0], log.read_text()[-3000:]
    assert dataset_files(out) == dataset_files(small_reference)
    assert verify_dataset(out) == []


def test_second_process_on_a_busy_rank_is_refused(world, tmp_path):
    out = tmp_path / "ds"
    log = tmp_path / "dup.log"
    with rank_lock(out, 0):  # this test process is the first run, holding rank 0 of the folder
        code = run(extract_cmd(extract_args(world["target"], world["small"], out, **SMALL)), log)
    assert code == 2
    assert f"{out}: another extraction process is already writing rank 0" in log.read_text()
    assert not (out / "shards").exists() and not (out / "plan.json").exists()


# ----------------------------------------------------------------------------- 5. disk full


class _FullDisk:
    """An `open` for redraft.core.dataset.writer that fails with ENOSPC half way through the `fail_at`-th shard write."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.shards = fail_at, 0

    def __call__(self, path, mode="r", *a, **kw):
        f = open(path, mode, *a, **kw)
        if ".safetensors.tmp-" not in str(path) or "w" not in mode:  # shard files only (not their records)
            return f
        self.shards += 1
        if self.shards != self.fail_at:
            return f
        real_write = f.write

        def write(data):
            real_write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        f.write = write
        return f


def test_disk_full_in_the_shard_writer(world, small_reference, tmp_path, monkeypatch, caplog):
    out = tmp_path / "ds"
    args = extract_args(world["target"], world["small"], out, **SMALL)
    monkeypatch.setattr(atomic, "open", _FullDisk(fail_at=4), raising=False)
    assert extract_main(args) == 1
    assert "No space left on device" in caplog.text and "shard-000003.safetensors" in caplog.text
    assert "rerun the same command" in caplog.text
    kept = sorted(p.name for p in (out / "shards").iterdir() if not p.name.endswith(RECORD_SUFFIX))
    assert kept == [f"shard-{i:06d}.safetensors" for i in range(3)]  # complete ones kept, no temp left
    for p in (out / "shards").glob("*.safetensors"):
        read_shard_header(p)
    monkeypatch.undo()
    summary = run_extraction(parse_args(args))
    assert (summary.shards_reused, summary.shards_written) == (3, 5)
    assert dataset_files(out) == dataset_files(small_reference)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                         capture_output=True)
    return res.returncode == 0


def test_disk_full_on_a_real_small_filesystem(world, small_reference, tmp_path):
    fs = tmp_path / "small_fs"
    if not _mount_tmpfs(fs, "600k"):
        pytest.skip("mounting a size-limited tmpfs needs root (CAP_SYS_ADMIN) here")
    try:
        out = fs / "ds"
        args = extract_args(world["target"], world["small"], out, **SMALL)
        with pytest.raises(OSError) as info:
            run_extraction(parse_args(args))
        assert info.value.errno == errno.ENOSPC
        assert "shard-" in str(info.value)
        done = sorted((out / "shards").glob("shard-*.safetensors"))
        assert 0 < len(done) < 8
        for p in done:
            assert p.read_bytes() == (small_reference / "shards" / p.name).read_bytes()
        assert temp_leftovers(out) == []
        subprocess.run(["mount", "-o", "remount,size=16m", str(fs)], check=True)  # "space was freed"
        summary = run_extraction(parse_args(args))
        assert summary.shards_reused == len(done) and summary.manifest is not None
        assert dataset_files(out) == dataset_files(small_reference)
    finally:
        subprocess.run(["umount", str(fs)], check=False)


# ----------------------------------------------------------------------------- 2. non-finite captures


def test_non_finite_captures_are_skipped_and_counted(world, tmp_path, monkeypatch):
    real_capture = HFTarget.capture
    seen = {"n": 0}
    poisoned = {3: ("aux_hidden", float("nan")), 11: ("last_hidden", float("inf")),
                17: ("topk_logprobs", float("nan")), 23: ("topk_logprobs", float("inf")),
                29: ("aux_hidden", -float("inf"))}
    minus_inf = 31  # -inf log-probs are legitimate (zero probability) and must be kept

    def poison(cap, key: str, row: int, col: int, value: float):
        t = getattr(cap, key).clone()  # captures are inference tensors: edit a copy
        t[row, col] = value
        return dataclasses.replace(cap, **{key: t})

    def capture(self, batch, teacher):
        out = []
        for cap in real_capture(self, batch, teacher):
            i, seen["n"] = seen["n"], seen["n"] + 1
            if i in poisoned:
                key, value = poisoned[i]
                cap = poison(cap, key, len(getattr(cap, key)) // 2, 0, value)
            if i == minus_inf:
                cap = poison(cap, "topk_logprobs", 0, -1, -float("inf"))
            out.append(cap)
        return out

    monkeypatch.setattr(HFTarget, "capture", capture)
    out = tmp_path / "ds"
    args = extract_args(world["target"], world["small"], out, teacher="topk,last_hidden", **SMALL)
    summary = run_extraction(parse_args(args))
    assert seen["n"] == 40
    assert summary.skipped == Counter(non_finite=len(poisoned))
    assert summary.manifest["skipped"] == {"non_finite": len(poisoned)}
    assert summary.manifest["num_samples"] == 40 - len(poisoned)
    assert verify_dataset(out, deep=True) == []
    reader = DatasetReader(out)
    for i in range(len(reader)):
        s = reader.get(i)
        assert torch.isfinite(s.aux_hidden).all() and torch.isfinite(s.topk_logprobs).all()


# ----------------------------------------------------------------------------- 8. bad input at scale


def test_malformed_corpus_gives_exact_skip_counts(tmp_path):
    corpus = write_malformed_corpus(tmp_path / "in", rounds=60, long_chars=1 << 20, seed=5)
    res = read_records(corpus["paths"])
    assert dict(res.skipped) == corpus["skipped"]
    assert [r.id for r in res.records] == corpus["good"]
    assert sum(corpus["skipped"].values()) == 60 * 26  # 26 malformed lines per round
    first = res.records[0]
    assert first.origin.endswith("a.jsonl:1")  # the BOM line is a record, not invalid_json
    assert max(len(m.content) for r in res.records for m in r.messages) >= 1 << 19  # the long one survived


def test_strict_stops_at_the_first_bad_record_with_file_and_line(world, tmp_path, caplog):
    corpus = write_malformed_corpus(tmp_path / "in", rounds=5, long_chars=4096, seed=6)
    with pytest.raises(BadRecordError) as info:
        read_records(corpus["paths"], strict=True)
    assert info.value.origin == corpus["first_bad"]
    out = tmp_path / "never"
    args = ["--target", str(world["target"]), "--out", str(out), "--strict", "--rank", "0", "--world-size", "1"]
    for p in corpus["paths"]:
        args += ["--data", str(p)]
    assert extract_main(args) == 2
    assert corpus["first_bad"] in caplog.text
    assert not out.exists()


def test_malformed_corpus_through_extraction(world, tmp_path):
    corpus = write_malformed_corpus(tmp_path / "in", rounds=2, long_chars=20_000, seed=7)
    out = tmp_path / "ds"
    args = ["--target", str(world["target"]), "--out", str(out), "--samples-per-shard", "4", "--max-length", "128",
            "--batch-tokens", "1024", "--topk", "4", "--rank", "0", "--world-size", "1"]
    for p in corpus["paths"]:
        args += ["--data", str(p)]
    summary = run_extraction(parse_args(args))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["skipped"] == corpus["skipped"]
    assert manifest["num_samples"] == len(corpus["good"])
    assert summary.truncated == 1  # the very long record, cut to max_length
    assert verify_dataset(out, deep=True) == []
