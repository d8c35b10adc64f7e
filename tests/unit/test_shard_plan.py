"""Byte-bounded shards: boundaries decided before capture, the same for every world size and rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import extract.pipeline as pipeline
from extract.config import ExtractConfig, parse_args
from extract.pipeline import run_extraction
from extract.records import Message, Record
from extract.shard_plan import OFFSET_BYTES, cut_shards, regenerated_bytes_bound
from extract.verify import verify_dataset
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.config import ConfigError
from redraft.core.dataset.format import bytes_per_token, read_shard_header, shard_relpath
from redraft.core.dataset.reader import DatasetReader

WORDS = "a cat sat on the mat and ran far away to see the sun rise over green hills".split()


def test_cut_shards_bounds_bytes_and_records_in_input_order():
    sizes = [40, 30, 50, 10, 10, 10, 200, 5, 0, 0]
    starts = cut_shards(sizes, shard_bytes=100, max_records=3)
    assert starts == [0, 2, 5, 6, 7, 10]
    for a, b in zip(starts, starts[1:], strict=False):
        assert b - a <= 3 and (sum(sizes[a:b]) <= 100 or b - a == 1)  # only a record alone may exceed
    assert cut_shards(sizes, shard_bytes=10**9, max_records=4) == [0, 4, 8, 10]  # the old fixed-count layout
    assert cut_shards([], shard_bytes=1, max_records=1) == [0]
    with pytest.raises(ValueError):
        cut_shards([1], shard_bytes=0, max_records=1)


def test_regenerated_records_are_planned_at_their_largest():
    rec = Record(id="r", source="s", category=None, origin="f:1",
                 messages=(Message("system", "be brief"), Message("user", "hi"), Message("assistant", "yo"),
                           Message("user", "and?"), Message("user", "so?")))
    per_turn = 512 * 100 + OFFSET_BYTES
    assert regenerated_bytes_bound(rec, max_length=512, max_user_turns=0, bytes_per_token=100) == 3 * per_turn
    assert regenerated_bytes_bound(rec, max_length=512, max_user_turns=2, bytes_per_token=100) == 2 * per_turn


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shard_plan")
    target = make_tiny_llama(root / "llama", num_layers=4)
    data = root / "chat.jsonl"
    lines = []
    for i in range(14):
        n = 3 + (i * 7) % 23  # very different lengths, so byte bounds and record counts cut differently
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
        lines.append(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": text},
                                                                   {"from": "gpt", "value": text[::-1]}]}))
    data.write_text("\n".join(lines) + "\n")
    return {"root": root, "target": target, "data": data}


def _cfg(world, out: Path, **kw) -> ExtractConfig:
    base = dict(target=str(world["target"]), data=[str(world["data"])], out=str(out), samples_per_shard=100,
                shard_bytes=40_000, max_length=256, batch_tokens=1024, topk=4, rank=0, world_size=1)
    base.update(kw)
    return ExtractConfig(**base).validate()


def _dataset_files(root: Path) -> dict[str, bytes]:
    from helpers_faults import dataset_files  # the dataset's bytes: no bookkeeping (plan, header, records)

    return dataset_files(root)


def _data_bytes(path: Path) -> int:
    """A shard's tensor data: the file minus its header."""
    return path.stat().st_size - 8 - int.from_bytes(path.read_bytes()[:8], "little")


@pytest.fixture(scope="module")
def one_rank(world) -> Path:
    out = world["root"] / "one"
    assert run_extraction(_cfg(world, out)).manifest is not None
    return out


def test_shards_stay_under_the_byte_budget_and_keep_input_order(world, one_rank):
    plan = json.loads((one_rank / "plan.json").read_text())
    bpt = int(bytes_per_token(64, 3, "bf16", ["topk"], 4))
    assert plan["bytes_per_token"] == bpt and plan["shard_bytes"] == 40_000
    starts = plan["shard_starts"]
    assert plan["num_shards"] == len(starts) - 1 >= 4
    sizes = []
    for s in range(plan["num_shards"]):
        path = one_rank / shard_relpath(s)
        hdr = read_shard_header(path)
        data = _data_bytes(path)
        assert data == sum(n["num_tokens"] for n in hdr.samples) * bpt + OFFSET_BYTES * (len(hdr.samples) + 1)
        assert data - OFFSET_BYTES <= 40_000 or len(hdr.samples) == 1, (s, data)  # planned sizes are exact
        assert [x["id"] for x in hdr.samples] == [f"c{i}" for i in range(starts[s], starts[s + 1])]
        sizes.append(data)
    # greedy: no shard could have taken the next record
    for s in range(len(sizes) - 1):
        first_next = read_shard_header(one_rank / shard_relpath(s + 1)).samples[0]["num_tokens"]
        assert sizes[s] - OFFSET_BYTES + first_next * bpt + OFFSET_BYTES > 40_000
    assert DatasetReader(one_rank).sample_ids == [f"c{i}" for i in range(14)]
    assert verify_dataset(one_rank, deep=True) == []


def test_any_world_size_writes_the_same_bytes(world, one_rank, tmp_path):
    for world_size in (2, 3):
        out = tmp_path / f"w{world_size}"
        for rank in range(world_size):
            run_extraction(_cfg(world, out, rank=rank, world_size=world_size))
        assert _dataset_files(out) == _dataset_files(one_rank), world_size


def test_rerun_reuses_the_plan_and_refuses_other_budgets(world, one_rank, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    run_extraction(_cfg(world, out, finalize=False, max_samples=0))
    plan = (out / "plan.json").read_bytes()

    def no_tokenizing(*a, **kw):
        raise AssertionError("a rerun must reuse plan.json's boundaries")

    monkeypatch.setattr(pipeline, "record_sizes", no_tokenizing)
    summary = run_extraction(_cfg(world, out))
    assert summary.shards_written == 0 and summary.manifest is not None
    assert (out / "plan.json").read_bytes() == plan
    with pytest.raises(ConfigError, match="shard_bytes: folder has 40000, this run 50000"):
        run_extraction(_cfg(world, out, shard_bytes=50_000))


def test_regenerated_shards_are_planned_from_the_largest_reply(world, tmp_path):
    out = tmp_path / "regen"
    per_record = 64 * int(bytes_per_token(64, 3, "bf16", ["topk"], 4)) + OFFSET_BYTES  # one user turn each
    cfg = _cfg(world, out, regenerate=True, max_new_tokens=4, max_length=64, shard_bytes=3 * per_record + 1,
               max_samples=7)
    assert run_extraction(cfg).manifest is not None
    plan = json.loads((out / "plan.json").read_text())
    assert plan["shard_starts"] == [0, 3, 6, 7]
    for s in range(3):
        assert _data_bytes(out / shard_relpath(s)) < 3 * per_record


def test_shard_bytes_flag_takes_units():
    args = ["--target", "t", "--data", "d", "--out", "o"]
    assert parse_args([*args, "--shard-bytes", "2GiB"]).shard_bytes == 2 << 30
    assert parse_args([*args, "--shard-bytes", "500M"]).shard_bytes == 500_000_000
    assert parse_args(args).shard_bytes == 4 << 30
    with pytest.raises(ConfigError, match=r"^shard_bytes='lots': not a size in bytes"):
        parse_args([*args, "--shard-bytes", "lots"])
