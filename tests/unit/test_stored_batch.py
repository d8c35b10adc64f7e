"""The training loader's path: stored rows, checked at storage width, decoded on the device, equal to the
decoded path (``DatasetReader.get`` + ``collate``) bit for bit."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch
from helpers_store import make_dataset

from redraft.core.dataset.batch import collate
from redraft.core.dataset.format import DatasetError, shard_relpath
from redraft.core.dataset.reader import DatasetReader
from redraft.core.dataset.stored import collate_stored


@pytest.fixture(params=["bf16", "fp8"])
def reader(tmp_path, request) -> DatasetReader:
    make_dataset(tmp_path, shard_lengths=[[5, 9, 1], [7, 3]], hidden_dtype=request.param, last_hidden=True)
    return DatasetReader(tmp_path)


@pytest.mark.parametrize("max_length", [0, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_on_the_device_equals_decoded_on_the_host(reader, max_length, dtype):
    for chunk in ([0, 1, 2], [3, 4], [2]):
        want = collate([reader.get(i) for i in chunk], max_length=max_length).to("cpu", dtype)
        got = collate_stored([reader.get_stored(i) for i in chunk], max_length=max_length).to("cpu", dtype)
        for f in fields(want):
            a, b = getattr(want, f.name), getattr(got, f.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), f.name
            else:
                assert a == b, f.name


def test_stored_rows_are_not_widened(reader):
    s = reader.get_stored(0)
    assert s.input_ids.dtype == torch.int32 and s.loss_mask.dtype == torch.uint8
    assert s.aux_hidden.dtype in (torch.bfloat16, torch.float8_e4m3fn)
    assert s.aux_hidden.element_size() == (2 if s.aux_hidden.dtype == torch.bfloat16 else 1)


def _poke(root, key: str, row: int, value: bytes) -> None:
    """Overwrite the first bytes of ``row`` of ``key`` in shard 0 (as outside damage would)."""
    path = root / shard_relpath(0)
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])[key]
    start, end = meta["data_offsets"]
    row_bytes = (end - start) // meta["shape"][0]
    at = 8 + n + start + row * row_bytes
    data[at : at + len(value)] = value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,key,pattern", [
    ("nan", "aux_hidden", r"non-finite values in aux_hidden; run python -m extract.verify --deep"),
    ("inf", "last_hidden", r"non-finite values in last_hidden"),
    ("big_id", "input_ids", r"key 'input_ids' holds ids outside 0\.\.99; run python -m extract.verify on"),
])
def test_damage_is_found_on_the_stored_bytes(reader, damage, key, pattern):
    root, fp8 = reader.root, reader.hidden_dtype == "fp8"
    value = {"nan": b"\x7f" if fp8 else b"\xc0\x7f", "inf": b"\x7f" if fp8 else b"\x80\x7f",  # fp8 has no inf: NaN
             "big_id": (1000).to_bytes(4, "little")}[damage]
    _poke(root, key, 2, value)
    fresh = DatasetReader(root)
    fresh.get_stored(1)  # the next sample (rows 5..13) is sound
    with pytest.raises(DatasetError, match=rf"{shard_relpath(0)}: sample 's0' \(rows 0\.\.5\): {pattern}"):
        fresh.get_stored(0)
