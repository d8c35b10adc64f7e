"""extract.verify: integrity checks of a dataset folder against its manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_paths import ROOT
from helpers_store import make_dataset, make_header
from safetensors import safe_open
from safetensors.torch import load_file

from extract import verify as verify_mod
from extract.verify import main, verify_dataset
from redraft.core.dataset.format import COUNTS_NAME, MANIFEST_NAME, shard_relpath
from redraft.core.dataset.safetensors_bytes import serialize
from redraft.core.dataset.writer import finalize_dataset


@pytest.fixture(params=["bf16", "fp8"])
def dataset(tmp_path, request) -> Path:
    make_dataset(tmp_path, shard_lengths=[[5, 7], [3, 4], []], hidden_dtype=request.param, last_hidden=True)
    return tmp_path


def _edit_manifest(root: Path, fn) -> None:
    m = json.loads((root / MANIFEST_NAME).read_text())
    fn(m)
    (root / MANIFEST_NAME).write_text(json.dumps(m))


def test_good_dataset_passes(dataset, capsys):
    assert verify_dataset(dataset) == []
    assert verify_dataset(dataset, deep=True) == []
    assert main([str(dataset), "--deep"]) == 0
    assert "OK" in capsys.readouterr().out


def _flip_last_rows(path: Path, keep_mtime: bool) -> None:
    """Flip one bit inside aux_hidden's rows (the file still parses, its counts hold)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8 : 8 + n])["aux_hidden"]["data_offsets"]
    data[8 + n + start + 1] ^= 0x01
    path.write_bytes(bytes(data))
    # a rewrite moves mtime on (set here, since two writes within one clock tick can share it); bit rot does not
    mtime = st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 5_000_000_000
    os.utime(path, ns=(st.st_atime_ns, mtime))


def test_flipped_byte_is_a_sha_mismatch(dataset, capsys):
    _flip_last_rows(dataset / shard_relpath(1), keep_mtime=False)
    problems = verify_dataset(dataset)
    assert (
        len(problems) == 1 and problems[0].startswith(shard_relpath(1)) and "sha256 mismatch" in problems[0]
    )
    assert main([str(dataset)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == problems


def test_writer_record_spares_the_hash_and_deep_rehashes(dataset, monkeypatch):
    """Each shard is hashed once, by its writer: plain verify trusts that record while the file keeps the size
    and mtime it had, so damage that keeps both (bit rot) is found by --deep only, which re-hashes."""
    _flip_last_rows(dataset / shard_relpath(1), keep_mtime=True)
    hashed: list[Path] = []
    real = verify_mod.sha256_file
    monkeypatch.setattr(verify_mod, "sha256_file", lambda p: hashed.append(Path(p)) or real(p))
    assert verify_dataset(dataset) == [] and hashed == []
    (line,) = verify_dataset(dataset, deep=True)
    assert line.startswith(shard_relpath(1)) and "sha256 mismatch" in line and len(hashed) == 3


def test_truncated_shard(dataset):
    path = dataset / shard_relpath(0)
    path.write_bytes(path.read_bytes()[:-100])
    (line,) = verify_dataset(dataset)
    assert line.startswith(shard_relpath(0)) and "truncated" in line and "sha256 mismatch" in line


def test_missing_shard_and_one_line_per_bad_shard(dataset):
    (dataset / shard_relpath(2)).unlink()
    path = dataset / shard_relpath(0)
    path.write_bytes(path.read_bytes()[:50])
    problems = verify_dataset(dataset)
    assert problems[0].startswith(shard_relpath(0)) and problems[1] == f"{shard_relpath(2)}: missing"
    assert len(problems) == 2


def test_manifest_counts_disagreeing_with_shard(dataset):
    def bump(m):
        m["shards"][1]["num_loss_tokens"] += 1
        m["num_loss_tokens"] += 1

    _edit_manifest(dataset, bump)
    problems = verify_dataset(dataset)
    assert any(p.startswith(shard_relpath(1)) and "counts differ: num_loss_tokens" in p for p in problems)
    assert not any(p.startswith(MANIFEST_NAME) for p in problems)  # totals still equal the shard entries
    assert any(p.startswith(COUNTS_NAME) and "num_loss_tokens" in p for p in problems)


def test_manifest_totals_disagreeing_with_shards(dataset):
    _edit_manifest(dataset, lambda m: m.update(num_tokens=m["num_tokens"] + 5))
    (line,) = verify_dataset(dataset)
    assert line.startswith(MANIFEST_NAME) and "num_tokens" in line


def test_shard_path_leaving_root_is_reported(dataset):
    _edit_manifest(dataset, lambda m: m["shards"][0].update(path="../evil.safetensors"))
    (line,) = verify_dataset(dataset)
    assert "../evil.safetensors" in line and "leaves the dataset root" in line


def _inject_and_refinalize(root: Path, key: str, value: float, hidden_dtype: str) -> None:
    """Put a non-finite value in shard 0 (bypassing the writer) and re-finalize: only --deep can see it."""
    path = root / shard_relpath(0)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    t = tensors[key].float()
    t[3, min(2, t.shape[1] - 1)] = value
    tensors[key] = t.to(tensors[key].dtype)
    path.write_bytes(serialize(tensors, meta))
    finalize_dataset(
        root, num_shards=3, header=make_header(hidden_dtype=hidden_dtype, last_hidden=True), vocab_size=100
    )


@pytest.mark.parametrize("key", ["aux_hidden", "last_hidden", "topk_logprobs"])
def test_non_finite_values_found_only_by_deep(dataset, key):
    hidden_dtype = json.loads((dataset / MANIFEST_NAME).read_text())["hidden_dtype"]
    _inject_and_refinalize(dataset, key, float("nan"), hidden_dtype)
    assert verify_dataset(dataset) == []
    (line,) = verify_dataset(dataset, deep=True)
    assert line.startswith(shard_relpath(0)) and f"non-finite values in {key}" in line


def test_non_finite_fp8_scale_found_by_deep(tmp_path):
    make_dataset(tmp_path, shard_lengths=[[5, 7], [3, 4], []], hidden_dtype="fp8", last_hidden=True)
    _inject_and_refinalize(tmp_path, "last_scale", float("inf"), "fp8")
    (line,) = verify_dataset(tmp_path, deep=True)
    assert line.startswith(shard_relpath(0)) and "non-finite values in last_hidden" in line


def test_token_counts_checked_and_recomputed_with_deep(dataset):
    counts = load_file(dataset / COUNTS_NAME)["counts"]
    moved = counts.clone()
    i = int(torch.nonzero(moved)[0])
    moved[i] -= 1
    moved[(i + 1) % len(moved)] += 1  # same total: only a recount can tell
    (dataset / COUNTS_NAME).write_bytes(serialize({"counts": moved}))
    assert verify_dataset(dataset) == []
    (line,) = verify_dataset(dataset, deep=True)
    assert line.startswith(COUNTS_NAME) and "recomputed" in line

    (dataset / COUNTS_NAME).write_bytes(serialize({"counts": counts[:-1]}))
    (line,) = verify_dataset(dataset)
    assert line.startswith(COUNTS_NAME) and "expected int64" in line
    (dataset / COUNTS_NAME).unlink()
    assert verify_dataset(dataset) == [f"{COUNTS_NAME}: missing"]


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2  # no manifest
    assert "manifest.json" in capsys.readouterr().err
    assert main([str(tmp_path / "absent")]) == 2
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    assert main([str(tmp_path)]) == 2
    capsys.readouterr()
    assert main([]) == 2  # the folder is required: one line, not a usage block
    assert capsys.readouterr().err.strip() == ("error: python -m extract.verify: the following arguments are "
                                               "required: DIR (see python -m extract.verify --help)")


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--deep" in out and "finite" in out and "--quiet" in out and "Exit status" in out


def test_module_entry_point(tmp_path):
    make_dataset(tmp_path)
    (tmp_path / shard_relpath(1)).unlink()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "extract.verify", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert run.returncode == 1 and run.stdout.strip() == f"{shard_relpath(1)}: missing"
