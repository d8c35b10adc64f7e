"""The dataset folder (design.md, Contract 1): the only code that knows the on-disk format.

The extraction pipeline writes shards through `write_shard` and closes a dataset with
`finalize_dataset`; the trainer and evaluator read it through `DatasetReader`.

Why it looks like this:
- A shard is the unit of resume, so it is written atomically (temp name in the same
  folder, fsync, rename): a file at a final name is always complete.
- Reruns must be byte-identical, so shard bytes depend only on the inputs
  (`safetensors.torch.save` with sorted metadata, no timestamps) and the manifest is
  canonical JSON.
- Datasets are far larger than memory, so the reader builds its index from each shard's
  header, `sample_offsets` and metadata only, and `get` slices one sample's rows out of
  the memory-mapped file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from extract.atomic import atomic_write_bytes
from extract.layers import AUX_LAYER_CONVENTION

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
COUNTS_NAME = "token_counts.safetensors"
SHARD_DIR = "shards"
HIDDEN_DTYPES = ("bf16", "fp8")

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_FP8 = torch.float8_e4m3fn
_STORE_DTYPE = {"bf16": torch.bfloat16, "fp8": _FP8}
_SHARD_NAME = "shard-{:06d}.safetensors"
_BASE_KEYS = ("input_ids", "loss_mask", "sample_offsets")
_LOGPROB_FLOOR = torch.finfo(torch.float32).min  # stored in place of -inf (exp() of it is 0.0)
_HASH_CHUNK = 8 << 20


class DatasetError(Exception):
    """A dataset folder is missing, corrupt or inconsistent; the message names the file (and key)."""


@dataclass
class SampleFeatures:
    """Everything stored for one sample (one sequence of T tokens)."""

    sample_id: str
    source: str
    category: str | None
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool or uint8 [T]; the reader returns bool
    aux_hidden: (
        torch.Tensor
    )  # float [T, n_aux*H]; the writer accepts float32/bf16, the reader returns float32
    topk_ids: torch.Tensor | None = None  # int64 [T, K]
    topk_logprobs: torch.Tensor | None = None  # float32 [T, K]; -inf is stored as the float32 minimum
    last_hidden: torch.Tensor | None = None  # float [T, H]
    truncated: bool = False


@dataclass
class ShardInfo:
    """What the manifest records about one shard."""

    path: str  # relative to the dataset root, e.g. "shards/shard-000003.safetensors"
    sha256: str
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    skipped: dict[str, int] = field(default_factory=dict)


def shard_relpath(index: int) -> str:
    """Path of shard `index` relative to the dataset root."""
    if index < 0:
        raise ValueError(f"shard index must be >= 0, got {index}")
    return f"{SHARD_DIR}/{_SHARD_NAME.format(index)}"


# ----------------------------------------------------------------------------- helpers


def bytes_per_token(
    hidden_size: int, num_aux: int, hidden_dtype: str, teacher_kinds: tuple[str, ...] | list[str], topk: int
) -> float:
    """Bytes one token costs in a shard, from the layout table (per-sample offsets and headers excluded)."""
    _check_hidden_dtype(hidden_dtype)
    elem = 1 if hidden_dtype == "fp8" else 2
    scale = 4 if hidden_dtype == "fp8" else 0
    total = 4 + 1  # input_ids int32 + loss_mask uint8
    total += num_aux * (hidden_size * elem + scale)
    for kind in teacher_kinds:
        if kind == "topk":
            total += topk * (4 + 4)  # int32 ids + float32 logprobs
        elif kind == "last_hidden":
            total += hidden_size * elem + scale
        else:
            raise ValueError(f"unknown teacher kind {kind!r}; expected topk or last_hidden")
    return float(total)


TEACHER_KINDS = ("topk", "last_hidden")


def dataset_header(
    target: Mapping[str, Any],
    *,
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    aux_layer_ids: Sequence[int],
    tokenizer_hash: str,
    chat_template_hash: str,
    teacher: Sequence[str],
    topk: int | None,
    hidden_dtype: str,
    max_length: int,
    backend: str = "hf",
    generation: Mapping[str, Any] | None = None,
    regenerated: str | None = None,
    regeneration: Mapping[str, Any] | None = None,
    skipped: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The dataset-level manifest fields, for :func:`finalize_dataset` (which adds shards and totals).

    The one place these names are spelled: the extraction writes its header with it, and so does
    every synthetic dataset (tests, benchmarks), so readers never meet a second dialect.
    ``target`` is the extraction's TargetInfo as a dict (hand-made datasets give at least name,
    path, config_hash and architecture). ``regeneration`` is the check of the samples captured from
    generated ids (``extract.generated.ExactnessCounts``), known once every shard is written.
    """
    kinds = list(teacher)
    bad = [k for k in kinds if k not in TEACHER_KINDS]
    if bad or not kinds:
        raise ValueError(f"dataset_header: teacher must name {TEACHER_KINDS}, got {kinds}")
    if ("topk" in kinds) != (topk is not None):
        raise ValueError(f"dataset_header: topk={topk} does not fit teacher {kinds}")
    _check_hidden_dtype(hidden_dtype)
    return {
        "target": dict(target),
        "backend": backend,
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": chat_template_hash,
        "hidden_size": int(hidden_size),
        "num_layers": int(num_layers),
        "vocab_size": int(vocab_size),
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "teacher": {"kinds": kinds, "topk": None if topk is None else int(topk)},
        "hidden_dtype": hidden_dtype,
        "max_length": int(max_length),
        "generation": dict(generation) if generation is not None else None,
        "regenerated": regenerated,
        "regeneration": dict(regeneration) if regeneration is not None else None,
        "skipped": dict(sorted((skipped or {}).items())),
    }


def teacher_kinds(teacher: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Kinds named by a manifest's ``teacher`` entry (see :func:`dataset_header`)."""
    kinds = (teacher or {}).get("kinds")
    return tuple(str(k) for k in kinds) if isinstance(kinds, list | tuple) else ()


def _clamp_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """Replace -inf (tokens the target gives zero probability) by the float32 minimum.

    Log-softmax legitimately produces -inf, but stored data must be finite so that one
    isfinite check catches corruption; exp(float32 min) is exactly 0.0, so nothing changes.
    NaN and +inf are left alone, so the finiteness check still rejects them.
    """
    lp = logprobs.float()
    return torch.where(lp == float("-inf"), torch.full_like(lp, _LOGPROB_FLOOR), lp)


def _non_finite_fields(sample: SampleFeatures) -> list[str]:
    bad = []
    if not bool(torch.isfinite(sample.aux_hidden.float()).all()):
        bad.append("aux_hidden")
    if sample.last_hidden is not None and not bool(torch.isfinite(sample.last_hidden.float()).all()):
        bad.append("last_hidden")
    if sample.topk_logprobs is not None and not bool(
        torch.isfinite(_clamp_logprobs(sample.topk_logprobs)).all()
    ):
        bad.append("topk_logprobs")
    return bad


def features_are_finite(sample: SampleFeatures) -> bool:
    """True when the sample may be written: no NaN/Inf in hidden states, logprobs finite or -inf."""
    return not _non_finite_fields(sample)


def _check_hidden_dtype(hidden_dtype: str) -> None:
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype must be one of {HIDDEN_DTYPES}, got {hidden_dtype!r}")


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, groups*H] -> (float8_e4m3fn [N, groups*H], float32 scales [N, groups]).

    One scale per token and captured layer (amax / 448), because hidden-state magnitudes
    differ by orders of magnitude between layers and between tokens. An all-zero group
    gets scale 0 and dequantises to zeros.
    """
    n, width = x.shape
    g = x.float().reshape(n, groups, width // groups)
    scale = g.abs().amax(dim=-1) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (g / safe.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(_FP8)
    return q.reshape(n, width), scale.contiguous()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_fp8`, returning float32."""
    n, width = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(n, groups, width // groups) * scale.float().unsqueeze(-1)).reshape(n, width)


def _encode_hidden(
    x: torch.Tensor, hidden_dtype: str, groups: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if hidden_dtype == "bf16":
        return x.to(torch.bfloat16).contiguous(), None
    return quantize_fp8(x, groups)


def _put_hidden(
    tensors: dict[str, torch.Tensor], prefix: str, parts: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> None:
    """Store encoded pieces under `{prefix}_hidden` (and `{prefix}_scale` for fp8)."""
    tensors[f"{prefix}_hidden"] = torch.cat([h for h, _ in parts])
    scales = [sc for _, sc in parts if sc is not None]
    if scales:
        tensors[f"{prefix}_scale"] = torch.cat(scales)


def _decode_hidden(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == _FP8:
        if scale is None:
            raise ValueError("fp8 hidden states without scales")
        return dequantize_fp8(x, scale)
    return x.float()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


_ST_DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    _FP8: "F8_E4M3",
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


# ----------------------------------------------------------------------------- writing


def _validate_sample(s: SampleFeatures, num_aux: int) -> None:
    where = f"sample {s.sample_id!r}"
    if s.input_ids.dim() != 1:
        raise ValueError(f"{where}: input_ids must be 1-D, got shape {tuple(s.input_ids.shape)}")
    t = s.input_ids.shape[0]
    if s.input_ids.dtype.is_floating_point or s.input_ids.dtype == torch.bool:
        raise ValueError(f"{where}: input_ids must be integer, got {s.input_ids.dtype}")
    if t and (int(s.input_ids.min()) < 0 or int(s.input_ids.max()) > torch.iinfo(torch.int32).max):
        raise ValueError(f"{where}: input_ids out of the int32 range")
    if tuple(s.loss_mask.shape) != (t,):
        raise ValueError(f"{where}: loss_mask shape {tuple(s.loss_mask.shape)} != ({t},)")
    if s.aux_hidden.dim() != 2 or s.aux_hidden.shape[0] != t or s.aux_hidden.shape[1] % num_aux:
        raise ValueError(f"{where}: aux_hidden shape {tuple(s.aux_hidden.shape)} is not [{t}, {num_aux}*H]")
    if (s.topk_ids is None) != (s.topk_logprobs is None):
        raise ValueError(f"{where}: topk_ids and topk_logprobs must be given together")
    if s.topk_ids is not None and s.topk_logprobs is not None:
        if s.topk_ids.dim() != 2 or s.topk_ids.shape[0] != t or s.topk_ids.shape != s.topk_logprobs.shape:
            raise ValueError(
                f"{where}: topk_ids {tuple(s.topk_ids.shape)} / topk_logprobs {tuple(s.topk_logprobs.shape)}"
                f" are not both [{t}, K]"
            )
    if s.last_hidden is not None and (s.last_hidden.dim() != 2 or s.last_hidden.shape[0] != t):
        raise ValueError(f"{where}: last_hidden shape {tuple(s.last_hidden.shape)} is not [{t}, H]")
    bad = _non_finite_fields(s)
    if bad:
        raise ValueError(
            f"{where}: non-finite values in {', '.join(bad)} (filter it and count it as 'non_finite')"
        )


def _check_uniform(samples: list[SampleFeatures], num_aux: int) -> None:
    """All samples of a shard must share widths and teacher kinds, since rows are packed."""
    first = samples[0]
    aux_w = first.aux_hidden.shape[1]
    k = None if first.topk_ids is None else first.topk_ids.shape[1]
    last_w = None if first.last_hidden is None else first.last_hidden.shape[1]
    if last_w is not None and last_w * num_aux != aux_w:
        raise ValueError(
            f"sample {first.sample_id!r}: last_hidden width {last_w} != aux_hidden width {aux_w} / {num_aux}"
        )
    seen: set[str] = set()
    for s in samples:
        if s.sample_id in seen:
            raise ValueError(f"sample id {s.sample_id!r} appears twice in one shard")
        seen.add(s.sample_id)
        if s.aux_hidden.shape[1] != aux_w:
            raise ValueError(f"sample {s.sample_id!r}: aux_hidden width {s.aux_hidden.shape[1]} != {aux_w}")
        sk = None if s.topk_ids is None else s.topk_ids.shape[1]
        if sk != k:
            raise ValueError(f"sample {s.sample_id!r}: topk width {sk} != {k} of sample {first.sample_id!r}")
        sl = None if s.last_hidden is None else s.last_hidden.shape[1]
        if sl != last_w:
            raise ValueError(
                f"sample {s.sample_id!r}: last_hidden width {sl} != {last_w} of sample {first.sample_id!r}"
            )


def encode_shard(
    samples: list[SampleFeatures],
    *,
    hidden_dtype: str,
    num_aux: int,
    skipped: Mapping[str, int] | None = None,
) -> tuple[bytes, dict[str, int]]:
    """Pack samples into safetensors bytes; returns (bytes, counts). Deterministic for equal inputs."""
    _check_hidden_dtype(hidden_dtype)
    if num_aux < 1:
        raise ValueError(f"num_aux must be >= 1, got {num_aux}")
    for s in samples:
        _validate_sample(s, num_aux)
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    if samples:
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors: dict[str, torch.Tensor] = {"sample_offsets": offsets}
    masks = [s.loss_mask.to(torch.bool).to(torch.uint8) for s in samples]
    if samples:
        _check_uniform(samples, num_aux)
        tensors["input_ids"] = torch.cat([s.input_ids.to(torch.int32) for s in samples])
        tensors["loss_mask"] = torch.cat(masks)
        # Encode sample by sample (scales are per token, so this equals encoding the concatenation)
        # so that only storage-dtype copies of the shard are ever concatenated.
        _put_hidden(tensors, "aux", [_encode_hidden(s.aux_hidden, hidden_dtype, num_aux) for s in samples])
        topk = [(s.topk_ids, s.topk_logprobs) for s in samples if s.topk_ids is not None]
        if topk:
            tensors["topk_ids"] = torch.cat([ids.to(torch.int32) for ids, _ in topk])
            tensors["topk_logprobs"] = torch.cat([_clamp_logprobs(lp) for _, lp in topk if lp is not None])
        last = [s.last_hidden for s in samples if s.last_hidden is not None]
        if last:
            _put_hidden(tensors, "last", [_encode_hidden(h, hidden_dtype, 1) for h in last])
        # Inputs were checked finite; fp8 is clamped to +-448, but bf16 rounding can still overflow to inf
        # for |x| near the float32 maximum.
        for key in ("aux_hidden", "last_hidden"):
            if (
                key in tensors
                and tensors[key].dtype == torch.bfloat16
                and not bool(torch.isfinite(tensors[key]).all())
            ):
                raise ValueError(f"{key} overflows bfloat16 (|value| near the float32 maximum)")
    else:
        # An empty shard holds only the index keys: there is no row to give the hidden keys a width.
        tensors["input_ids"] = torch.zeros(0, dtype=torch.int32)
        tensors["loss_mask"] = torch.zeros(0, dtype=torch.uint8)
    meta_samples = [
        {
            "id": s.sample_id,
            "source": s.source,
            "category": s.category,
            "num_tokens": n,
            "num_loss_tokens": int(m.sum()),
            "truncated": bool(s.truncated),
        }
        for s, n, m in zip(samples, lengths, masks, strict=True)
    ]
    skipped_clean = {str(k): int(v) for k, v in sorted((skipped or {}).items())}
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "hidden_dtype": hidden_dtype,
        "num_aux": str(num_aux),
        "samples": json.dumps(meta_samples, sort_keys=True, separators=(",", ":")),
        "skipped": json.dumps(skipped_clean, sort_keys=True, separators=(",", ":")),
    }
    data = serialize(tensors, metadata)
    counts = {
        "num_samples": len(samples),
        "num_tokens": int(sum(lengths)),
        "num_loss_tokens": int(sum(m["num_loss_tokens"] for m in meta_samples)),
    }
    return data, counts


def write_shard(
    root: Path,
    index: int,
    samples: list[SampleFeatures],
    *,
    hidden_dtype: str,
    num_aux: int,
    skipped: Mapping[str, int] | None = None,
) -> ShardInfo:
    """Write shard `index` atomically and return what the manifest needs about it.

    Raises ValueError (naming the sample) on inconsistent shapes or NaN/Inf features; the
    pipeline filters those first with `features_are_finite` and counts them as skipped.
    """
    rel = shard_relpath(index)
    data, counts = encode_shard(samples, hidden_dtype=hidden_dtype, num_aux=num_aux, skipped=skipped)
    atomic_write_bytes(Path(root) / rel, data)
    info = ShardInfo(
        path=rel,
        sha256=hashlib.sha256(data).hexdigest(),
        skipped={str(k): int(v) for k, v in sorted((skipped or {}).items())},
        **counts,
    )
    logger.debug("wrote %s: %d samples, %d tokens", rel, info.num_samples, info.num_tokens)
    return info


# ----------------------------------------------------------------------------- shard parsing


@dataclass
class ShardHeader:
    """A parsed, internally consistent shard: keys/shapes, metadata and sample offsets (no feature rows)."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    samples: list[dict[str, Any]]
    skipped: dict[str, int]
    offsets: list[int]
    hidden_dtype: str
    num_aux: int

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_loss_tokens(self) -> int:
        return sum(int(s["num_loss_tokens"]) for s in self.samples)

    @property
    def aux_width(self) -> int | None:
        return self.shapes["aux_hidden"][1] if "aux_hidden" in self.shapes else None

    @property
    def has_topk(self) -> bool:
        return "topk_ids" in self.shapes

    @property
    def has_last_hidden(self) -> bool:
        return "last_hidden" in self.shapes


_DTYPE_NAMES = {
    "I32": "int32",
    "U8": "uint8",
    "I64": "int64",
    "BF16": "bf16",
    "F8_E4M3": "fp8",
    "F32": "float32",
}


def read_shard_header(path: Path) -> ShardHeader:
    """Parse and cross-check one shard without reading feature rows; DatasetError names the file and key."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: shard file is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
            if "sample_offsets" not in shapes:
                raise DatasetError(f"{path}: missing key 'sample_offsets'")
            offsets = [int(x) for x in f.get_tensor("sample_offsets").tolist()]
    except SafetensorError as e:
        raise DatasetError(f"{path}: not a readable safetensors file (truncated or corrupt): {e}") from e
    return _check_header(path, meta, shapes, dtypes, offsets)


def _meta_json(path: Path, meta: Mapping[str, str], key: str) -> Any:
    if key not in meta:
        raise DatasetError(f"{path}: metadata key {key!r} is missing")
    try:
        return json.loads(meta[key])
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: metadata key {key!r} is not valid JSON: {e}") from e


def _check_header(
    path: Path,
    meta: Mapping[str, str],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, str],
    offsets: list[int],
) -> ShardHeader:
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise DatasetError(
            f"{path}: metadata format_version {version!r}, this reader handles {FORMAT_VERSION}"
        )
    hidden_dtype = meta.get("hidden_dtype", "")
    if hidden_dtype not in HIDDEN_DTYPES:
        raise DatasetError(f"{path}: metadata hidden_dtype {hidden_dtype!r} is not one of {HIDDEN_DTYPES}")
    try:
        num_aux = int(meta.get("num_aux", ""))
    except ValueError as e:
        raise DatasetError(f"{path}: metadata num_aux {meta.get('num_aux')!r} is not an integer") from e
    samples = _meta_json(path, meta, "samples")
    skipped = _meta_json(path, meta, "skipped")
    if not isinstance(samples, list) or not isinstance(skipped, dict):
        raise DatasetError(f"{path}: metadata 'samples' must be a list and 'skipped' an object")
    for key in _BASE_KEYS:
        if key not in shapes:
            raise DatasetError(f"{path}: missing key {key!r}")
    n = len(samples)
    if shapes["sample_offsets"] != (n + 1,):
        raise DatasetError(
            f"{path}: key 'sample_offsets' has shape {shapes['sample_offsets']}, metadata lists {n} samples"
        )
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise DatasetError(f"{path}: key 'sample_offsets' is not a non-decreasing sequence from 0")
    total = offsets[-1]
    for i, s in enumerate(samples):
        want = offsets[i + 1] - offsets[i]
        if not isinstance(s, dict) or "id" not in s or int(s.get("num_tokens", -1)) != want:
            got = s.get("num_tokens") if isinstance(s, dict) else s
            raise DatasetError(
                f"{path}: metadata samples[{i}] num_tokens {got!r} disagrees with sample_offsets ({want})"
            )
    expected = {"input_ids": ("int32", 1), "loss_mask": ("uint8", 1)}
    if n:
        expected["aux_hidden"] = (hidden_dtype, 2)
        if hidden_dtype == "fp8":
            expected["aux_scale"] = ("float32", 2)
    if "topk_ids" in shapes or "topk_logprobs" in shapes:
        expected.update({"topk_ids": ("int32", 2), "topk_logprobs": ("float32", 2)})
    if "last_hidden" in shapes:
        expected["last_hidden"] = (hidden_dtype, 2)
        if hidden_dtype == "fp8":
            expected["last_scale"] = ("float32", 2)
    for key, (dtype, ndim) in expected.items():
        if key not in shapes:
            raise DatasetError(f"{path}: missing key {key!r}")
        got = _DTYPE_NAMES.get(dtypes[key], dtypes[key])
        if got != dtype or len(shapes[key]) != ndim:
            raise DatasetError(
                f"{path}: key {key!r} is {got} {list(shapes[key])}, expected {dtype} with {ndim} dims"
            )
        if shapes[key][0] != total:
            raise DatasetError(
                f"{path}: key {key!r} has {shapes[key][0]} rows, sample_offsets say {total} tokens"
            )
    if "aux_hidden" in shapes and shapes["aux_hidden"][1] % num_aux:
        raise DatasetError(
            f"{path}: key 'aux_hidden' width {shapes['aux_hidden'][1]} is not a multiple of num_aux {num_aux}"
        )
    if "aux_scale" in expected and shapes["aux_scale"][1] != num_aux:
        raise DatasetError(
            f"{path}: key 'aux_scale' has {shapes['aux_scale'][1]} columns, expected num_aux {num_aux}"
        )
    if "topk_ids" in expected and shapes["topk_ids"] != shapes["topk_logprobs"]:
        raise DatasetError(
            f"{path}: keys 'topk_ids' {shapes['topk_ids']} and 'topk_logprobs' "
            f"{shapes['topk_logprobs']} differ"
        )
    if (
        "last_hidden" in expected
        and "aux_hidden" in shapes
        and shapes["last_hidden"][1] * num_aux != shapes["aux_hidden"][1]
    ):
        raise DatasetError(
            f"{path}: key 'last_hidden' width {shapes['last_hidden'][1]} does not match aux_hidden / num_aux"
        )
    if "last_scale" in expected and shapes["last_scale"][1] != 1:
        raise DatasetError(f"{path}: key 'last_scale' has {shapes['last_scale'][1]} columns, expected 1")
    return ShardHeader(
        path=path,
        shapes=shapes,
        dtypes=dtypes,
        samples=samples,
        skipped={str(k): int(v) for k, v in skipped.items()},
        offsets=offsets,
        hidden_dtype=hidden_dtype,
        num_aux=num_aux,
    )


def shard_loss_tokens(path: Path) -> list[int]:
    """Loss tokens per sample counted from the `loss_mask` rows themselves (not the metadata)."""
    hdr = read_shard_header(path)
    with safe_open(str(path), framework="pt") as f:
        mask = f.get_tensor("loss_mask")
    return [int(mask[a:b].sum()) for a, b in zip(hdr.offsets, hdr.offsets[1:], strict=False)]


def read_shard_info(root: Path, index: int) -> ShardInfo | None:
    """For resume: None when shard `index` is absent, else its ShardInfo (sha256 computed).

    Raises DatasetError when a file at the final name does not parse or is inconsistent;
    writes are atomic, so that means outside damage: delete the file to recompute it.
    """
    rel = shard_relpath(index)
    path = Path(root) / rel
    if not path.exists():
        return None
    hdr = read_shard_header(path)
    loss = shard_loss_tokens(path)
    if loss != [int(s["num_loss_tokens"]) for s in hdr.samples]:
        raise DatasetError(f"{path}: metadata num_loss_tokens disagree with key 'loss_mask'")
    return ShardInfo(
        path=rel,
        sha256=sha256_file(path),
        num_samples=len(hdr.samples),
        num_tokens=hdr.num_tokens,
        num_loss_tokens=sum(loss),
        skipped=hdr.skipped,
    )


def count_tokens(shard_paths: list[Path], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size] counts of loss-masked tokens, reading only input_ids/loss_mask of each shard."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in shard_paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                ids = f.get_tensor("input_ids").long()
                mask = f.get_tensor("loss_mask").bool()
        except SafetensorError as e:
            raise DatasetError(f"{path}: not a readable safetensors file (truncated or corrupt): {e}") from e
        sel = ids[mask]
        if sel.numel() and (int(sel.max()) >= vocab_size or int(sel.min()) < 0):
            raise DatasetError(
                f"{path}: key 'input_ids' holds id {int(sel.max())} outside vocab_size {vocab_size}"
            )
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


# ----------------------------------------------------------------------------- finalize


def _sum_skipped(*parts: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[str(k)] = out.get(str(k), 0) + int(v)
    return dict(sorted(out.items()))


def finalize_dataset(root: Path, *, num_shards: int, header: Mapping[str, Any], vocab_size: int) -> dict:
    """Write token_counts.safetensors then manifest.json (both atomically) once every shard exists.

    `header` holds the dataset-level facts (target, tokenizer_hash, chat_template_hash,
    hidden_size, num_layers, vocab_size, aux_layer_ids, aux_layer_convention, teacher,
    hidden_dtype, max_length, generation, and parse-time skip counts under "skipped").
    Shard facts and totals are computed here. Returns the manifest as written.
    """
    root = Path(root)
    if "vocab_size" in header and int(header["vocab_size"]) != vocab_size:
        raise ValueError(f"header vocab_size {header['vocab_size']} != vocab_size {vocab_size}")
    for i in range(num_shards):
        if not (root / shard_relpath(i)).is_file():
            raise FileNotFoundError(f"{root / shard_relpath(i)}: shard {i} of {num_shards} is missing")
    infos: list[ShardInfo] = []
    headers: list[ShardHeader] = []
    for i in range(num_shards):
        info = read_shard_info(root, i)
        assert info is not None  # checked above
        infos.append(info)
        headers.append(read_shard_header(root / info.path))
    _check_shards_agree(headers, header)
    counts = count_tokens([root / info.path for info in infos], vocab_size)

    manifest: dict[str, Any] = dict(header)
    manifest.update(
        format_version=FORMAT_VERSION,
        vocab_size=vocab_size,
        num_samples=sum(i.num_samples for i in infos),
        num_tokens=sum(i.num_tokens for i in infos),
        num_loss_tokens=sum(i.num_loss_tokens for i in infos),
        skipped=_sum_skipped(header.get("skipped") or {}, *(i.skipped for i in infos)),
        shards=[
            {
                "path": i.path,
                "sha256": i.sha256,
                "num_samples": i.num_samples,
                "num_tokens": i.num_tokens,
                "num_loss_tokens": i.num_loss_tokens,
            }
            for i in infos
        ],
    )
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(root / COUNTS_NAME, serialize({"counts": counts}))
    atomic_write_bytes(root / MANIFEST_NAME, text.encode())
    logger.info(
        "finalized %s: %d shards, %d samples, %d tokens",
        root,
        num_shards,
        manifest["num_samples"],
        manifest["num_tokens"],
    )
    return json.loads(text)


def _check_shards_agree(headers: list[ShardHeader], header: Mapping[str, Any]) -> None:
    """Every shard must match the header's hidden dtype/size and share one teacher layout."""
    want_dtype = header.get("hidden_dtype")
    hidden = header.get("hidden_size")
    aux_ids = header.get("aux_layer_ids")
    first: ShardHeader | None = None
    for h in headers:
        if want_dtype is not None and h.hidden_dtype != want_dtype:
            raise DatasetError(
                f"{h.path}: hidden_dtype {h.hidden_dtype!r} != header hidden_dtype {want_dtype!r}"
            )
        if aux_ids is not None and h.num_aux != len(aux_ids):
            raise DatasetError(f"{h.path}: num_aux {h.num_aux} != {len(aux_ids)} aux_layer_ids in the header")
        if not h.samples:
            continue
        if hidden is not None and h.aux_width != h.num_aux * int(hidden):
            raise DatasetError(
                f"{h.path}: aux_hidden width {h.aux_width} != num_aux {h.num_aux} * hidden_size {hidden}"
            )
        if first is None:
            first = h
        elif _layout(h) != _layout(first):
            raise DatasetError(
                f"{h.path}: feature keys/widths {_layout(h)} differ from {first.path} {_layout(first)}"
            )


def _layout(h: ShardHeader) -> tuple[int | None, int | None, int | None]:
    """(aux width, top-k K or None, last_hidden width or None): what must agree across shards."""
    k = h.shapes["topk_ids"][1] if h.has_topk else None
    last = h.shapes["last_hidden"][1] if h.has_last_hidden else None
    return h.aux_width, k, last


# ----------------------------------------------------------------------------- reading


def load_manifest(root: Path) -> dict:
    """Parse ROOT/manifest.json; DatasetError names the file when it is missing or invalid."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise DatasetError(f"{path}: manifest is missing (the dataset was not finalized)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(manifest, dict):
        raise DatasetError(f"{path}: expected a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetError(f"{path}: format_version {version!r}, this reader handles {FORMAT_VERSION}")
    for key in ("shards", "vocab_size", "hidden_size"):
        if key not in manifest:
            raise DatasetError(f"{path}: key {key!r} is missing")
    if not isinstance(manifest["shards"], list):
        raise DatasetError(f"{path}: key 'shards' must be a list")
    return manifest


def resolve_inside(root: Path, rel: Any) -> Path:
    """ROOT/rel, refusing paths that leave the root (absolute, '..', symlinks pointing outside)."""
    if not isinstance(rel, str) or not rel:
        raise DatasetError(f"{Path(root) / MANIFEST_NAME}: shard path {rel!r} is not a non-empty string")
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or rel.startswith(("/", "\\")):
        raise DatasetError(f"{Path(root) / MANIFEST_NAME}: shard path {rel!r} leaves the dataset root")
    full = Path(root) / p
    real_root = Path(root).resolve()
    if not full.resolve().is_relative_to(real_root):
        raise DatasetError(
            f"{Path(root) / MANIFEST_NAME}: shard path {rel!r} resolves to {full.resolve()}, "
            f"outside {real_root}"
        )
    return full


class DatasetReader:
    """Random access to the samples of a finalized dataset folder.

    The index (sample -> shard, row range) is built from shard headers, `sample_offsets`
    and metadata only; `get` reads one sample's rows through memory-mapped slices.
    Picklable (open handles are dropped), so it can go to DataLoader workers.
    """

    _MAX_OPEN = 64

    def __init__(self, root: str | Path, *, verify_checksums: bool = False) -> None:
        self.root = Path(root)
        self.manifest: dict = load_manifest(self.root)
        self._paths: list[Path] = []
        self._headers: list[ShardHeader] = []
        self.sample_ids: list[str] = []
        self.sources: list[str] = []
        self.categories: list[str | None] = []
        self.lengths: list[int] = []
        self.num_loss_tokens: list[int] = []
        self.truncated: list[bool] = []
        self._loc: list[tuple[int, int, int]] = []
        mpath = self.root / MANIFEST_NAME
        for si, entry in enumerate(self.manifest["shards"]):
            if not isinstance(entry, dict) or "path" not in entry:
                raise DatasetError(f"{mpath}: shards[{si}] has no 'path'")
            path = resolve_inside(self.root, entry["path"])
            if not path.is_file():
                raise DatasetError(f"{path}: shard file is missing (listed in {mpath})")
            if verify_checksums:
                digest = sha256_file(path)
                if digest != entry.get("sha256"):
                    raise DatasetError(f"{path}: sha256 {digest} != manifest {entry.get('sha256')}")
            hdr = read_shard_header(path)
            for key in ("num_samples", "num_tokens"):
                got = len(hdr.samples) if key == "num_samples" else hdr.num_tokens
                if key in entry and int(entry[key]) != got:
                    raise DatasetError(f"{path}: {key} {got} disagrees with {mpath} ({entry[key]})")
            self._check_layout(hdr)
            self._paths.append(path)
            self._headers.append(hdr)
            for j, s in enumerate(hdr.samples):
                self.sample_ids.append(str(s["id"]))
                self.sources.append(str(s.get("source", "")))
                self.categories.append(s.get("category"))
                self.lengths.append(int(s["num_tokens"]))
                self.num_loss_tokens.append(int(s.get("num_loss_tokens", 0)))
                self.truncated.append(bool(s.get("truncated", False)))
                self._loc.append((si, hdr.offsets[j], hdr.offsets[j + 1]))
        self._check_totals(mpath)
        self._index: dict[str, int] = {}
        for i, sid in enumerate(self.sample_ids):
            if sid in self._index:
                raise DatasetError(
                    f"{mpath}: sample id {sid!r} appears twice (samples {self._index[sid]} and {i})"
                )
            self._index[sid] = i
        self._open: dict[int, Any] = {}

    def _check_totals(self, mpath: Path) -> None:
        """The manifest totals must equal the sum of its shards (cheap: headers are already parsed)."""
        got = {"num_samples": len(self.sample_ids), "num_tokens": sum(self.lengths),
               "num_loss_tokens": sum(self.num_loss_tokens)}
        for key, value in got.items():
            if key in self.manifest and int(self.manifest[key]) != value:
                raise DatasetError(f"{mpath}: {key} {self.manifest[key]} disagrees with its shards ({value})")

    def _check_layout(self, hdr: ShardHeader) -> None:
        if not hdr.samples:
            return
        want = int(self.manifest["hidden_size"]) * hdr.num_aux
        if hdr.aux_width != want:
            raise DatasetError(
                f"{hdr.path}: key 'aux_hidden' width {hdr.aux_width} != num_aux {hdr.num_aux} * hidden_size "
                f"{self.manifest['hidden_size']} from the manifest"
            )
        ref = next((h for h in self._headers if h.samples), None)
        if ref is not None and _layout(ref) != _layout(hdr):
            raise DatasetError(
                f"{hdr.path}: feature keys/widths {_layout(hdr)} differ from {ref.path} {_layout(ref)}"
            )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = {}
        return state

    def __len__(self) -> int:
        return len(self.sample_ids)

    def index_of(self, sample_id: str) -> int:
        try:
            return self._index[sample_id]
        except KeyError:
            raise KeyError(f"sample id {sample_id!r} is not in {self.root}") from None

    def _handle(self, si: int) -> Any:
        f = self._open.get(si)
        if f is None:
            if len(self._open) >= self._MAX_OPEN:
                self._open.pop(next(iter(self._open)))
            try:
                f = safe_open(str(self._paths[si]), framework="pt")
            except SafetensorError as e:
                raise DatasetError(f"{self._paths[si]}: not a readable safetensors file: {e}") from e
            self._open[si] = f
        return f

    def get(self, i: int) -> SampleFeatures:
        """Sample `i` with int64 ids, bool loss mask, float32 hidden states (fp8 dequantised)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        i %= len(self)
        si, a, b = self._loc[i]
        hdr = self._headers[si]
        f = self._handle(si)

        def rows(key: str) -> torch.Tensor:
            return f.get_slice(key)[a:b]

        aux = _decode_hidden(rows("aux_hidden"), rows("aux_scale") if "aux_scale" in hdr.shapes else None)
        last = None
        if hdr.has_last_hidden:
            last = _decode_hidden(
                rows("last_hidden"), rows("last_scale") if "last_scale" in hdr.shapes else None
            )
        sample = SampleFeatures(
            sample_id=self.sample_ids[i],
            source=self.sources[i],
            category=self.categories[i],
            input_ids=rows("input_ids").long(),
            loss_mask=rows("loss_mask").bool(),
            aux_hidden=aux,
            topk_ids=rows("topk_ids").long() if hdr.has_topk else None,
            topk_logprobs=rows("topk_logprobs").float() if hdr.has_topk else None,
            last_hidden=last,
            truncated=self.truncated[i],
        )
        self._check_values(sample, hdr.path, a, b)
        return sample

    def _check_values(self, s: SampleFeatures, path: Path, a: int, b: int) -> None:
        """Damage the header checks cannot see (flipped data bytes): NaN/Inf, ids outside the vocab.

        The writer refuses both, so either means the file changed after it was written; failing
        here names the file instead of training on it (a NaN loss, or an index error in the embedding).
        """
        where = f"{path}: sample {s.sample_id!r} (rows {a}..{b})"
        vocab = self.vocab_size
        for key, ids in (("input_ids", s.input_ids), ("topk_ids", s.topk_ids)):
            if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise DatasetError(f"{where}: key {key!r} holds ids outside 0..{vocab - 1}; "
                                   "run python -m extract.verify on the dataset")
        bad = _non_finite_fields(s)
        if bad:
            raise DatasetError(f"{where}: non-finite values in {', '.join(bad)}; "
                               "run python -m extract.verify --deep on the dataset")

    def __getitem__(self, i: int) -> SampleFeatures:
        return self.get(i)

    def token_counts(self) -> torch.Tensor:
        """int64 [vocab_size] loss-masked token counts (for draft-vocabulary selection)."""
        path = self.root / COUNTS_NAME
        if not path.is_file():
            raise DatasetError(f"{path}: token counts file is missing")
        try:
            counts = load_file(str(path))
        except SafetensorError as e:
            raise DatasetError(f"{path}: not a readable safetensors file: {e}") from e
        vocab = int(self.manifest["vocab_size"])
        c = counts.get("counts")
        if c is None:
            raise DatasetError(f"{path}: missing key 'counts'")
        if c.dtype != torch.int64 or tuple(c.shape) != (vocab,):
            raise DatasetError(f"{path}: key 'counts' is {c.dtype} {list(c.shape)}, expected int64 [{vocab}]")
        return c

    def _first_nonempty(self) -> ShardHeader | None:
        return next((h for h in self._headers if h.samples), None)

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def num_aux(self) -> int:
        if self._headers:
            return self._headers[0].num_aux
        return len(self.manifest.get("aux_layer_ids") or [])

    @property
    def hidden_dtype(self) -> str:
        return str(self.manifest.get("hidden_dtype", ""))

    @property
    def teacher(self) -> dict:
        return dict(self.manifest.get("teacher") or {})

    @property
    def has_topk(self) -> bool:
        h = self._first_nonempty()
        return h.has_topk if h is not None else "topk" in teacher_kinds(self.teacher)

    @property
    def has_last_hidden(self) -> bool:
        h = self._first_nonempty()
        return h.has_last_hidden if h is not None else "last_hidden" in teacher_kinds(self.teacher)

    @property
    def topk(self) -> int | None:
        """K of the stored top-k teacher, or None without one."""
        h = self._first_nonempty()
        if h is not None:
            return h.shapes["topk_ids"][1] if h.has_topk else None
        k = self.teacher.get("topk")
        return int(k) if self.has_topk and k is not None else None
