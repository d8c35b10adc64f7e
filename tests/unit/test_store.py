"""redraft.core.dataset: shard writer, manifest, reader, fp8 codec."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import struct
import weakref
from pathlib import Path

import pytest
import torch
from helpers_store import make_dataset, make_header, make_sample
from safetensors import safe_open
from safetensors.torch import load_file, save

import redraft.core.atomic as atomic
import redraft.core.dataset.reader as reader_module
from redraft.core.dataset.format import (
    COUNTS_NAME,
    MANIFEST_NAME,
    DatasetError,
    bytes_per_token,
    dataset_header,
    features_are_finite,
    shard_relpath,
)
from redraft.core.dataset.fp8 import dequantize_fp8
from redraft.core.dataset.reader import DatasetReader
from redraft.core.dataset.safetensors_bytes import serialize
from redraft.core.dataset.writer import ShardWriter, finalize_dataset, read_shard_info, write_shard

FLOOR = torch.finfo(torch.float32).min


def _roundtrip(tmp_path: Path, hidden_dtype: str, topk: int | None, last_hidden: bool):
    lengths = [[6, 1, 9], [4]]
    make_dataset(
        tmp_path, shard_lengths=lengths, hidden_dtype=hidden_dtype, topk=topk, last_hidden=last_hidden
    )
    originals = [
        make_sample(f"s{i}", n, topk=topk, last_hidden=last_hidden, seed=i)
        for i, n in enumerate(x for shard in lengths for x in shard)
    ]
    return DatasetReader(tmp_path, verify_checksums=True), originals


@pytest.mark.parametrize("topk,last_hidden", [(4, False), (None, True), (3, True)])
def test_roundtrip_bf16_exact_to_bf16_rounding(tmp_path, topk, last_hidden):
    reader, originals = _roundtrip(tmp_path, "bf16", topk, last_hidden)
    assert len(reader) == 4
    assert reader.has_topk == (topk is not None) and reader.has_last_hidden == last_hidden
    assert reader.topk == topk
    for i, want in enumerate(originals):
        got = reader.get(i)
        assert got.sample_id == want.sample_id and got.category == "chat" and got.source == "unit"
        assert got.input_ids.dtype == torch.int64 and torch.equal(got.input_ids, want.input_ids)
        assert got.loss_mask.dtype == torch.bool and torch.equal(got.loss_mask, want.loss_mask)
        assert got.aux_hidden.dtype == torch.float32
        assert torch.equal(got.aux_hidden, want.aux_hidden.to(torch.bfloat16).float())
        if topk:
            assert got.topk_ids.dtype == torch.int64 and torch.equal(got.topk_ids, want.topk_ids)
            assert torch.equal(got.topk_logprobs, want.topk_logprobs)
        else:
            assert got.topk_ids is None and got.topk_logprobs is None
        if last_hidden:
            assert torch.equal(got.last_hidden, want.last_hidden.to(torch.bfloat16).float())
        else:
            assert got.last_hidden is None
    assert reader.lengths == [6, 1, 9, 4]
    assert reader.num_loss_tokens == [int(s.loss_mask.sum()) for s in originals]
    assert reader.index_of("s2") == 2
    with pytest.raises(KeyError, match="nope"):
        reader.index_of("nope")


def test_roundtrip_fp8_error_bounded_by_per_token_layer_amax(tmp_path):
    reader, originals = _roundtrip(tmp_path, "fp8", 4, True)
    worst_aux = worst_last = 0.0
    for i, want in enumerate(originals):
        got = reader.get(i)
        assert got.aux_hidden.dtype == torch.float32
        for got_h, want_h, groups in (
            (got.aux_hidden, want.aux_hidden, 3),
            (got.last_hidden, want.last_hidden, 1),
        ):
            g = want_h.reshape(len(want_h), groups, -1)
            amax = g.abs().amax(-1, keepdim=True)
            err = ((got_h.reshape_as(g) - g).abs() / amax).max().item()
            # elementwise: at most 1/16 of the value itself (3 mantissa bits) plus a subnormal floor
            rel = (got_h.reshape_as(g) - g).abs() <= g.abs() / 16 + amax * 2.0**-9 / 448
            assert bool(rel.all())
            if groups == 3:
                worst_aux = max(worst_aux, err)
            else:
                worst_last = max(worst_last, err)
    # e4m3: spacing 32 on [256, 448] -> max error 16/448 = 3.6% of the per-token, per-layer amax
    assert 0 < worst_aux <= 16 / 448 + 1e-6
    assert 0 < worst_last <= 16 / 448 + 1e-6
    assert torch.equal(
        reader.get(0).topk_logprobs, originals[0].topk_logprobs
    )  # logprobs are never quantised


def test_fp8_scales_are_per_layer_and_zero_rows_survive(tmp_path):
    s = make_sample("z", 3, seed=1)
    s.aux_hidden[1] = 0.0  # an all-zero token: amax 0 must not produce NaN
    s.aux_hidden[2, 16:32] = 0.0  # one zero layer inside a token
    write_shard(tmp_path, 0, [s], hidden_dtype="fp8", num_aux=3)
    raw = load_file(tmp_path / shard_relpath(0))
    assert raw["aux_hidden"].dtype == torch.float8_e4m3fn and raw["aux_scale"].shape == (3, 3)
    expected = s.aux_hidden.reshape(3, 3, 16).abs().amax(-1) / 448
    assert torch.allclose(raw["aux_scale"], expected)
    finalize_dataset(tmp_path, num_shards=1, header=make_header(hidden_dtype="fp8"), vocab_size=100)
    got = DatasetReader(tmp_path).get(0).aux_hidden
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got[1], torch.zeros(48)) and torch.equal(got[2, 16:32], torch.zeros(16))


def test_shard_keys_dtypes_and_metadata_match_the_contract(tmp_path):
    s = make_sample("a", 5, topk=4, last_hidden=True)
    s.loss_mask = s.loss_mask.to(torch.uint8)
    write_shard(tmp_path, 3, [s], hidden_dtype="fp8", num_aux=3, skipped={"z": 1, "a": 2})
    path = tmp_path / "shards" / "shard-000003.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        keys = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    assert keys == {
        "input_ids": ("I32", [5]),
        "loss_mask": ("U8", [5]),
        "sample_offsets": ("I64", [2]),
        "aux_hidden": ("F8_E4M3", [5, 48]),
        "aux_scale": ("F32", [5, 3]),
        "topk_ids": ("I32", [5, 4]),
        "topk_logprobs": ("F32", [5, 4]),
        "last_hidden": ("F8_E4M3", [5, 16]),
        "last_scale": ("F32", [5, 1]),
    }
    assert meta["format_version"] == "1" and meta["hidden_dtype"] == "fp8" and meta["num_aux"] == "3"
    assert json.loads(meta["skipped"]) == {"a": 2, "z": 1}
    assert json.loads(meta["samples"]) == [
        {
            "id": "a",
            "source": "unit",
            "category": "chat",
            "num_tokens": 5,
            "num_loss_tokens": int(s.loss_mask.sum()),
            "truncated": False,
        }
    ]


def test_minus_inf_logprobs_are_clamped_nan_and_inf_are_refused(tmp_path):
    s = make_sample("ok", 4)
    s.topk_logprobs[0, -1] = float("-inf")
    assert features_are_finite(s)
    write_shard(tmp_path, 0, [s], hidden_dtype="bf16", num_aux=3)
    assert load_file(tmp_path / shard_relpath(0))["topk_logprobs"][0, -1].item() == FLOOR
    assert torch.exp(torch.tensor(FLOOR)).item() == 0.0

    for field, value in (
        ("aux_hidden", float("nan")),
        ("last_hidden", float("inf")),
        ("topk_logprobs", float("nan")),
    ):
        bad = make_sample("bad-one", 4, last_hidden=True)
        getattr(bad, field)[2, 1] = value
        assert not features_are_finite(bad)
        with pytest.raises(ValueError, match=f"'bad-one'.*{field}"):
            write_shard(
                tmp_path, 1, [make_sample("fine", 3, last_hidden=True), bad], hidden_dtype="fp8", num_aux=3
            )
        assert not (tmp_path / shard_relpath(1)).exists()
    huge = make_sample("huge", 4)
    huge.aux_hidden[0, 0] = 3.4e38  # finite in float32, inf once rounded to bfloat16
    with pytest.raises(ValueError, match="overflows bfloat16"):
        write_shard(tmp_path, 1, [huge], hidden_dtype="bf16", num_aux=3)
    pos = make_sample("pos", 4)
    pos.topk_logprobs[0, 0] = float("inf")
    assert not features_are_finite(pos)


def test_writer_rejects_inconsistent_samples(tmp_path):
    a = make_sample("a", 4)
    with pytest.raises(ValueError, match="twice"):
        write_shard(tmp_path, 0, [a, make_sample("a", 3)], hidden_dtype="bf16", num_aux=3)
    with pytest.raises(ValueError, match="'b'.*topk width"):
        write_shard(tmp_path, 0, [a, make_sample("b", 3, topk=5)], hidden_dtype="bf16", num_aux=3)
    with pytest.raises(ValueError, match="'c'.*aux_hidden width"):
        write_shard(tmp_path, 0, [a, make_sample("c", 3, hidden=8)], hidden_dtype="bf16", num_aux=3)
    short = make_sample("d", 4)
    short.loss_mask = short.loss_mask[:3]
    with pytest.raises(ValueError, match="'d'.*loss_mask"):
        write_shard(tmp_path, 0, [short], hidden_dtype="bf16", num_aux=3)
    with pytest.raises(ValueError, match="hidden_dtype"):
        write_shard(tmp_path, 0, [a], hidden_dtype="fp16", num_aux=3)
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())


def test_empty_shard_is_valid(tmp_path):
    info = write_shard(tmp_path, 0, [], hidden_dtype="fp8", num_aux=3, skipped={"too_long": 2})
    assert (info.num_samples, info.num_tokens, info.num_loss_tokens) == (0, 0, 0)
    assert read_shard_info(tmp_path, 0) == info
    manifest = finalize_dataset(
        tmp_path, num_shards=1, header=make_header(hidden_dtype="fp8"), vocab_size=100
    )
    assert manifest["num_samples"] == 0 and manifest["skipped"] == {"too_long": 3}
    reader = DatasetReader(tmp_path)
    assert len(reader) == 0 and reader.has_topk and not reader.has_last_hidden and reader.topk == 4
    assert torch.equal(reader.token_counts(), torch.zeros(100, dtype=torch.int64))


def test_writes_are_deterministic(tmp_path):
    for d in ("a", "b"):
        make_dataset(tmp_path / d, hidden_dtype="fp8", last_hidden=True)
    for rel in (shard_relpath(0), shard_relpath(1), shard_relpath(2), MANIFEST_NAME, COUNTS_NAME):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    # rewriting over an existing shard gives the same bytes too
    before = (tmp_path / "a" / shard_relpath(1)).read_bytes()
    write_shard(
        tmp_path / "a",
        1,
        [make_sample("s2", 3, last_hidden=True, seed=2)],
        hidden_dtype="fp8",
        num_aux=3,
        skipped={"empty": 1},
    )
    assert (tmp_path / "a" / shard_relpath(1)).read_bytes() == before


@pytest.mark.parametrize("fail_at", ["replace", "fsync", "write"])
def test_failed_write_leaves_no_file_at_the_final_name(tmp_path, monkeypatch, fail_at):
    first = write_shard(tmp_path, 0, [make_sample("a", 5)], hidden_dtype="bf16", num_aux=3)
    before = (tmp_path / first.path).read_bytes()

    def boom(*args, **kwargs):
        raise OSError(f"injected {fail_at} failure")

    if fail_at == "write":
        monkeypatch.setattr(atomic, "open", _half_writing_open, raising=False)
    else:
        monkeypatch.setattr(os, fail_at, boom)
    with pytest.raises(OSError, match="injected"):
        write_shard(tmp_path, 1, [make_sample("b", 5)], hidden_dtype="bf16", num_aux=3)
    monkeypatch.undo()
    assert read_shard_info(tmp_path, 1) is None
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        "shard-000000.record.json", "shard-000000.safetensors"
    ]  # no temp left, and no record of the failed shard
    assert (tmp_path / first.path).read_bytes() == before


class _HalfWriter:
    """A file that stores half of what it is given and then fails, like a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError("injected write failure")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def _half_writing_open(path, mode="r", *args, **kwargs):
    return _HalfWriter(open(path, mode, *args, **kwargs))


def test_read_shard_info_matches_write_and_detects_damage(tmp_path):
    info = write_shard(
        tmp_path,
        2,
        [make_sample("a", 5), make_sample("b", 2)],
        hidden_dtype="bf16",
        num_aux=3,
        skipped={"non_finite": 1},
    )
    assert info.path == "shards/shard-000002.safetensors" == shard_relpath(2)
    assert read_shard_info(tmp_path, 2) == info
    assert read_shard_info(tmp_path, 0) is None
    path = tmp_path / info.path
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DatasetError, match="shard-000002"):
        read_shard_info(tmp_path, 2)


def test_finalize_manifest_and_token_counts(tmp_path):
    manifest = make_dataset(tmp_path, shard_lengths=[[5, 7], [3], []], vocab=50)
    samples = [make_sample(f"s{i}", n, vocab=50, seed=i) for i, n in enumerate([5, 7, 3])]
    assert manifest == json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 1 and manifest["vocab_size"] == 50
    assert manifest["num_samples"] == 3 and manifest["num_tokens"] == 15
    assert manifest["num_loss_tokens"] == sum(int(s.loss_mask.sum()) for s in samples)
    assert manifest["skipped"] == {"empty": 0 + 1 + 2, "too_long": 1}
    assert [s["path"] for s in manifest["shards"]] == [shard_relpath(i) for i in range(3)]
    assert [s["num_tokens"] for s in manifest["shards"]] == [12, 3, 0]
    for key in (
        "target",
        "tokenizer_hash",
        "chat_template_hash",
        "hidden_size",
        "num_layers",
        "aux_layer_ids",
        "aux_layer_convention",
        "teacher",
        "hidden_dtype",
        "max_length",
        "generation",
    ):
        assert key in manifest
    want = torch.zeros(50, dtype=torch.int64)
    for s in samples:
        want += torch.bincount(s.input_ids[s.loss_mask], minlength=50)
    reader = DatasetReader(tmp_path)
    assert torch.equal(reader.token_counts(), want)
    assert reader.hidden_size == 16 and reader.num_aux == 3
    assert reader.teacher == {"kinds": ["topk"], "topk": 4} and reader.topk == 4


def test_header_names_the_teacher_once_and_an_empty_dataset_still_knows_it(tmp_path):
    """The manifest's teacher entry is read back even with no sample to look at (all shards empty)."""
    make_dataset(tmp_path, shard_lengths=[[]], topk=5, last_hidden=True)
    reader = DatasetReader(tmp_path)
    assert len(reader.lengths) == 0
    assert (reader.topk, reader.has_topk, reader.has_last_hidden) == (5, True, True)
    sizes = dict(hidden_size=1, num_layers=1, vocab_size=1, aux_layer_ids=[0], tokenizer_hash="",
                 chat_template_hash="", hidden_dtype="bf16", max_length=1)
    with pytest.raises(ValueError, match="topk=None does not fit teacher"):
        dataset_header({}, teacher=["topk"], topk=None, **sizes)
    with pytest.raises(ValueError, match="teacher must name"):
        dataset_header({}, teacher=["logits"], topk=None, **sizes)


def test_finalize_refuses_missing_and_mismatched_shards(tmp_path):
    write_shard(tmp_path, 0, [make_sample("a", 4)], hidden_dtype="bf16", num_aux=3)
    write_shard(tmp_path, 2, [make_sample("c", 4)], hidden_dtype="bf16", num_aux=3)
    with pytest.raises(FileNotFoundError, match="shard-000001"):
        finalize_dataset(tmp_path, num_shards=3, header=make_header(), vocab_size=100)
    assert not (tmp_path / MANIFEST_NAME).exists() and not (tmp_path / COUNTS_NAME).exists()
    with pytest.raises(DatasetError, match="shard-000000.*hidden_dtype"):
        finalize_dataset(tmp_path, num_shards=1, header=make_header(hidden_dtype="fp8"), vocab_size=100)
    with pytest.raises(DatasetError, match="hidden_size 32"):
        finalize_dataset(tmp_path, num_shards=1, header=make_header(hidden=32), vocab_size=100)
    with pytest.raises(DatasetError, match="outside vocab_size 10"):
        finalize_dataset(tmp_path, num_shards=1, header=make_header(vocab=10), vocab_size=10)
    write_shard(
        tmp_path, 1, [make_sample("b", 4, topk=None, last_hidden=True)], hidden_dtype="bf16", num_aux=3
    )
    with pytest.raises(DatasetError, match="shard-000001.*differ"):
        finalize_dataset(tmp_path, num_shards=2, header=make_header(), vocab_size=100)


def test_get_slices_rows_and_never_loads_whole_tensors(tmp_path, monkeypatch):
    lengths = [[int(x) for x in torch.randint(1, 200, (40,), generator=torch.Generator().manual_seed(0))]]
    make_dataset(tmp_path, shard_lengths=lengths, hidden_dtype="fp8", last_hidden=True, hidden=64)
    full = load_file(tmp_path / shard_relpath(0))
    calls: list[str] = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def get_tensor(self, key):
            calls.append(f"get_tensor:{key}")
            return self.inner.get_tensor(key)

        def get_slice(self, key):
            calls.append(f"get_slice:{key}")
            return self.inner.get_slice(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    real_open = reader_module.safe_open
    reader = DatasetReader(tmp_path)
    monkeypatch.setattr(reader_module, "safe_open", lambda *a, **k: Spy(real_open(*a, **k)))
    offs = full["sample_offsets"].tolist()
    for i in torch.randperm(len(reader), generator=torch.Generator().manual_seed(1)).tolist():
        got = reader.get(i)
        a, b = offs[i], offs[i + 1]
        assert torch.equal(got.input_ids, full["input_ids"][a:b].long())
        assert torch.equal(
            got.aux_hidden, dequantize_fp8(full["aux_hidden"][a:b], full["aux_scale"][a:b])
        )
        assert torch.equal(
            got.last_hidden, dequantize_fp8(full["last_hidden"][a:b], full["last_scale"][a:b])
        )
        assert torch.equal(got.topk_ids, full["topk_ids"][a:b].long())
    assert calls and not any(c.startswith("get_tensor") for c in calls)


def test_reader_pickles_without_open_handles(tmp_path):
    make_dataset(tmp_path)
    reader = DatasetReader(tmp_path)
    first = reader.get(1)
    clone = pickle.loads(pickle.dumps(reader))
    assert torch.equal(clone.get(1).aux_hidden, first.aux_hidden) and clone.sample_ids == reader.sample_ids


def _edit_manifest(root: Path, fn) -> None:
    m = json.loads((root / MANIFEST_NAME).read_text())
    fn(m)
    (root / MANIFEST_NAME).write_text(json.dumps(m))


@pytest.mark.parametrize("bad", ["../outside/shard.safetensors", "/etc/passwd", "shards/../../x.safetensors"])
def test_reader_refuses_paths_leaving_the_root(tmp_path, bad):
    root = tmp_path / "ds"
    make_dataset(root)
    _edit_manifest(root, lambda m: m["shards"][0].update(path=bad))
    with pytest.raises(DatasetError, match="leaves the dataset root") as e:
        DatasetReader(root)
    assert bad in str(e.value)


def test_reader_refuses_symlink_out_but_follows_symlink_in(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(root / shard_relpath(1), outside)
    os.symlink(outside, root / shard_relpath(1))
    with pytest.raises(DatasetError, match="shard-000001.*outside"):
        DatasetReader(root)
    os.unlink(root / shard_relpath(1))
    os.replace(outside, root / "real.safetensors")
    os.symlink(root / "real.safetensors", root / shard_relpath(1))
    assert len(DatasetReader(root)) == 3


def _rewrite_shard(path: Path, fn) -> None:
    """Re-save a shard after editing its tensors/metadata (simulates a buggy or foreign writer)."""
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(path)
    fn(tensors, meta)
    path.write_bytes(save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta))


def test_reader_errors_name_the_file_and_key(tmp_path):
    root = tmp_path / "ds"
    make_dataset(root, last_hidden=True)
    shard0 = root / shard_relpath(0)
    good = shard0.read_bytes()

    def expect(match: str) -> None:
        with pytest.raises(DatasetError, match=match):
            DatasetReader(root)

    (root / MANIFEST_NAME).rename(root / "m.json")
    expect("manifest.json.*missing")
    (root / "m.json").rename(root / MANIFEST_NAME)

    shard0.write_bytes(good[: len(good) // 2])
    expect("shard-000000.*truncated")
    shard0.unlink()
    expect("shard-000000.*missing")

    shard0.write_bytes(good)
    _rewrite_shard(shard0, lambda t, m: t.pop("aux_hidden"))
    expect("shard-000000.*'aux_hidden'")

    shard0.write_bytes(good)
    _rewrite_shard(shard0, lambda t, m: t.update(last_hidden=t["last_hidden"][:-1]))
    expect("shard-000000.*'last_hidden' has 11 rows.*12 tokens")

    shard0.write_bytes(good)
    _rewrite_shard(shard0, lambda t, m: t.update(topk_logprobs=t["topk_logprobs"][:, :2]))
    expect("shard-000000.*topk_ids.*topk_logprobs")

    def lie(t, m):
        samples = json.loads(m["samples"])
        samples[0]["num_tokens"] += 1
        m["samples"] = json.dumps(samples)

    shard0.write_bytes(good)
    _rewrite_shard(shard0, lie)
    expect(r"shard-000000.*samples\[0\] num_tokens 6 disagrees with sample_offsets \(5\)")

    shard0.write_bytes(good)
    _rewrite_shard(shard0, lambda t, m: m.update(format_version="99"))
    expect("shard-000000.*format_version")

    shard0.write_bytes(good)
    _edit_manifest(root, lambda m: m["shards"][0].update(num_tokens=13))
    expect("shard-000000.*num_tokens 12 disagrees")
    _edit_manifest(root, lambda m: m.update(format_version=2))
    expect("manifest.json.*format_version 2")


def test_verify_checksums_option(tmp_path):
    make_dataset(tmp_path)
    _edit_manifest(tmp_path, lambda m: m["shards"][1].update(sha256="0" * 64))
    DatasetReader(tmp_path)  # checksums are opt-in: opening stays cheap
    with pytest.raises(DatasetError, match="shard-000001.*sha256"):
        DatasetReader(tmp_path, verify_checksums=True)


@pytest.mark.parametrize(
    "hidden_dtype,kinds", [("bf16", ("topk",)), ("fp8", ("topk", "last_hidden")), ("fp8", ("last_hidden",))]
)
def test_bytes_per_token_matches_real_shards(tmp_path, hidden_dtype, kinds):
    topk = 8 if "topk" in kinds else None
    info = write_shard(
        tmp_path,
        0,
        [
            make_sample(f"x{i}", 50, hidden=32, topk=topk, last_hidden="last_hidden" in kinds, seed=i)
            for i in range(4)
        ],
        hidden_dtype=hidden_dtype,
        num_aux=3,
    )
    data = (tmp_path / info.path).read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    payload = len(data) - 8 - header_len - 8 * (info.num_samples + 1)  # minus sample_offsets
    assert payload / info.num_tokens == bytes_per_token(32, 3, hidden_dtype, kinds, topk or 0)
    assert bytes_per_token(7168, 3, "bf16", ("topk",), 64) == 5 + 3 * 7168 * 2 + 64 * 8


# ----------------------------------------------------------------------------- streamed writing


def _in_memory_shard(samples, hidden_dtype: str) -> bytes:
    """The shard as one in-memory serialisation of the concatenated rows (what the writer must stream)."""
    from redraft.core.dataset.format import clamp_logprobs
    from redraft.core.dataset.fp8 import encode_hidden, put_hidden

    tensors = {"sample_offsets": torch.tensor([0, *torch.tensor([len(s.input_ids) for s in samples]).cumsum(0)])}
    tensors["input_ids"] = torch.cat([s.input_ids.to(torch.int32) for s in samples])
    tensors["loss_mask"] = torch.cat([s.loss_mask.to(torch.uint8) for s in samples])
    put_hidden(tensors, "aux", [encode_hidden(s.aux_hidden, hidden_dtype, 3) for s in samples])
    tensors["topk_ids"] = torch.cat([s.topk_ids.to(torch.int32) for s in samples])
    tensors["topk_logprobs"] = torch.cat([clamp_logprobs(s.topk_logprobs) for s in samples])
    put_hidden(tensors, "last", [encode_hidden(s.last_hidden, hidden_dtype, 1) for s in samples])
    meta = [{"id": s.sample_id, "source": s.source, "category": s.category, "num_tokens": len(s.input_ids),
             "num_loss_tokens": int(s.loss_mask.sum()), "truncated": False} for s in samples]
    return serialize(tensors, {"format_version": "1", "hidden_dtype": hidden_dtype, "num_aux": "3",
                               "samples": json.dumps(meta, sort_keys=True, separators=(",", ":")),
                               "skipped": json.dumps({"x": 1}, separators=(",", ":"))})


@pytest.mark.parametrize("hidden_dtype", ["bf16", "fp8"])
def test_streamed_shard_equals_the_in_memory_layout_whatever_the_arrival_order(tmp_path, hidden_dtype):
    # 300 rows cross the writer's 256-row encoding blocks; a 0-token sample is legal
    samples = [make_sample(f"s{i}", n, last_hidden=True, seed=i) for i, n in enumerate([7, 1, 300, 3, 9, 0])]
    want = _in_memory_shard(samples, hidden_dtype)
    for name, order in (("in-order", [0, 1, 2, 3, 4, 5]), ("shuffled", [2, 5, 4, 0, 3, 1])):
        with ShardWriter(tmp_path / name, 0, hidden_dtype=hidden_dtype, num_aux=3) as w:
            for i in order:
                w.add(samples[i], position=10 * i)  # positions order the file; gaps are fine
            info = w.finish({"x": 1})
        data = (tmp_path / name / info.path).read_bytes()
        assert data == want, name
        assert info.sha256 == hashlib.sha256(data).hexdigest() and info.num_tokens == 320
        assert read_shard_info(tmp_path / name, 0) == info


def test_writer_spills_next_to_the_shard_keeps_no_rows_and_cleans_up(tmp_path):
    shards = tmp_path / "shards"
    w = ShardWriter(tmp_path, 3, hidden_dtype="fp8", num_aux=3)
    sample = make_sample("a", 6, last_hidden=True)
    rows = sample.aux_hidden.numpy().copy()
    sample.aux_hidden = torch.from_numpy(rows)  # the tensor, and any view of it, keeps `rows` alive
    alive = weakref.ref(rows)
    del rows
    w.add(sample)
    del sample
    assert alive() is None  # the writer kept nothing of the sample's features, not even a view
    spills = sorted(p.name for p in shards.iterdir())
    # hidden temp names the pipeline's stale-temp cleanup (".shard-NNNNNN.safetensors.tmp-*") matches
    assert spills and all(p.startswith(".shard-000003.safetensors.tmp-") for p in spills), spills
    assert {p.rsplit(".", 1)[1] for p in spills} == {"input_ids", "loss_mask", "aux_hidden", "aux_scale",
                                                      "topk_ids", "topk_logprobs", "last_hidden", "last_scale"}
    w.add(make_sample("b", 2, last_hidden=True, seed=1))
    w.finish()
    assert sorted(p.name for p in shards.iterdir()) == ["shard-000003.record.json", "shard-000003.safetensors"]
    with pytest.raises(RuntimeError, match="closed"):
        w.add(make_sample("c", 2, last_hidden=True))

    w = ShardWriter(tmp_path, 4, hidden_dtype="bf16", num_aux=3)
    w.add(make_sample("a", 3))
    with pytest.raises(ValueError, match="'b'.*topk width"):
        w.add(make_sample("b", 3, topk=5))  # a bad sample aborts the shard: nothing of it stays
    assert sorted(p.name for p in shards.iterdir()) == ["shard-000003.record.json", "shard-000003.safetensors"]
    with ShardWriter(tmp_path, 5, hidden_dtype="bf16", num_aux=3) as w, pytest.raises(ValueError, match="taken"):
        w.add(make_sample("a", 3), position=0)
        w.add(make_sample("b", 3), position=0)
    assert sorted(p.name for p in shards.iterdir()) == ["shard-000003.record.json", "shard-000003.safetensors"]


def test_disk_full_while_spilling_names_the_shard_and_leaves_nothing(tmp_path, monkeypatch):
    import redraft.core.dataset.writer as writer_module

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.f.close()

    monkeypatch.setattr(writer_module, "open", lambda *a, **kw: Full(open(*a, **kw)), raising=False)
    with pytest.raises(OSError, match="No space left") as e:
        write_shard(tmp_path, 2, [make_sample("a", 4)], hidden_dtype="bf16", num_aux=3)
    assert e.value.filename == str(tmp_path / shard_relpath(2))
    assert list((tmp_path / "shards").iterdir()) == []
