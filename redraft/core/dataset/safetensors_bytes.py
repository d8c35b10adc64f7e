"""Byte-exact safetensors serialisation: equal inputs give equal bytes, so reruns are byte-identical.

Two entry points share one layout: :func:`serialize` for tensors in memory (small files: token
counts, tests) and :func:`header_bytes` for writers that stream the data themselves (shards, which
can be far larger than memory): it gives the header and the order the data must follow.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from redraft.core.dataset.fp8 import FP8

_ST_DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    FP8: "F8_E4M3",
}


def _check_host() -> None:
    if sys.byteorder != "little":
        raise RuntimeError(
            "safetensors files are little-endian; this writer only runs on little-endian hosts"
        )


def data_order(specs: Mapping[str, tuple[torch.dtype, Sequence[int]]]) -> list[str]:
    """Keys in data order: element size (largest first), then name, so every tensor stays aligned."""
    return sorted(specs, key=lambda k: (-specs[k][0].itemsize, k))


def header_bytes(
    specs: Mapping[str, tuple[torch.dtype, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The file's first bytes (u64 header length + JSON header padded with spaces to 8 bytes) for
    tensors `{key: (dtype, shape)}` whose raw data follows in :func:`data_order`.

    `safetensors.torch.save` emits `__metadata__` in hash-map order, which varies between calls, so
    equal inputs would not give equal bytes; this header is canonical (sorted keys, fixed order).
    """
    _check_host()
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    pos = 0
    for key in data_order(specs):
        dtype, shape = specs[key]
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r}: dtype {dtype} is not part of the shard format")
        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is already contiguous."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """safetensors bytes of tensors in memory, with the canonical header of :func:`header_bytes`."""
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    head = header_bytes(specs, metadata)
    return b"".join([head, *(bytes(tensor_bytes(tensors[k])) for k in data_order(specs))])
