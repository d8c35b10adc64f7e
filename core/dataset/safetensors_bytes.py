"""Byte-exact safetensors serialisation: equal inputs give equal bytes, so reruns are byte-identical."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import torch

from core.dataset.fp8 import FP8

_ST_DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    FP8: "F8_E4M3",
}


def serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """safetensors bytes with a canonical header (sorted keys, fixed tensor order).

    `safetensors.torch.save` emits `__metadata__` in hash-map order, which varies between
    calls, so equal inputs would not give equal bytes. The layout is the documented one:
    u64 header length, JSON header padded with spaces to 8 bytes, then the raw data with
    tensors ordered by element size (largest first) so every tensor stays aligned.
    """
    if sys.byteorder != "little":
        raise RuntimeError(
            "safetensors files are little-endian; this writer only runs on little-endian hosts"
        )
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    blobs = []
    pos = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r}: dtype {t.dtype} is not part of the shard format")
        blob = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[key] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + len(blob)],
        }
        blobs.append(blob)
        pos += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([len(text).to_bytes(8, "little"), text, *blobs])
