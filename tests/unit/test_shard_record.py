"""Hash once: the writer's record of each shard spares resume and finalize a second read of the data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers_store import make_dataset, make_header, make_sample

from redraft.core.dataset import writer as writer_mod
from redraft.core.dataset.format import MANIFEST_NAME, sha256_file, shard_relpath
from redraft.core.dataset.shard_record import record_path
from redraft.core.dataset.writer import finalize_dataset, read_shard_info, write_shard


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """Every file redraft.core.dataset.writer hashes after the shards are written."""
    seen: list[Path] = []
    monkeypatch.setattr(writer_mod, "sha256_file", lambda p: seen.append(Path(p)) or sha256_file(p))
    return seen


def _rewrite(path: Path, sample_id: str) -> None:
    """Write shard 0 again with other content; its mtime moves on (set, since one clock tick can hold both)."""
    before = path.stat().st_mtime_ns
    write_shard(path.parents[1], 0, [make_sample(sample_id, 6, hidden=16, num_aux=3, vocab=100, topk=4, seed=9)],
                hidden_dtype="bf16", num_aux=3)
    os.utime(path, ns=(before + 5_000_000_000, before + 5_000_000_000))


def test_writer_records_what_it_hashed(tmp_path, hashed):
    make_dataset(tmp_path)
    for i in range(3):
        path = tmp_path / shard_relpath(i)
        record = json.loads(record_path(tmp_path, i).read_text())
        assert record["sha256"] == sha256_file(path)  # the hash computed while streaming = the file's
        assert record["file"] == {"bytes": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns}
    hashed.clear()
    for i in range(3):
        assert read_shard_info(tmp_path, i) == read_shard_info(tmp_path, i, rehash=True)
    assert len(hashed) == 3  # only the rehash=True calls read the files


def test_finalize_trusts_records_and_writes_the_same_manifest(tmp_path, hashed):
    make_dataset(tmp_path, shard_lengths=[[5, 7], [3, 4], [2]])
    trusted_manifest = (tmp_path / MANIFEST_NAME).read_text()
    assert hashed == []  # make_dataset's finalize hashed nothing: every shard had its record
    finalize_dataset(tmp_path, num_shards=3, header=make_header(hidden=16, vocab=100, topk=4), vocab_size=100,
                     rehash=True)
    assert len(hashed) == 3
    assert (tmp_path / MANIFEST_NAME).read_text() == trusted_manifest


def test_a_rewritten_shard_is_hashed_again(tmp_path, hashed):
    make_dataset(tmp_path)
    path = tmp_path / shard_relpath(0)
    old = read_shard_info(tmp_path, 0)
    record = record_path(tmp_path, 0).read_text()
    _rewrite(path, "other")
    record_path(tmp_path, 0).write_text(record)  # the old record back: stale now, since the file changed
    hashed.clear()
    new = read_shard_info(tmp_path, 0)
    assert hashed == [path] and new.sha256 == sha256_file(path) != old.sha256
    assert new.num_tokens == 6


def test_a_shard_without_record_is_hashed_once(tmp_path, hashed):
    """A run killed between the shard's rename and its record: the next reader hashes it and records it."""
    make_dataset(tmp_path)
    record_path(tmp_path, 1).unlink()
    hashed.clear()
    first = read_shard_info(tmp_path, 1)
    assert hashed == [tmp_path / shard_relpath(1)] and record_path(tmp_path, 1).is_file()
    assert read_shard_info(tmp_path, 1) == first and len(hashed) == 1
