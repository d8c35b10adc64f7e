"""The dataset folder's format (design.md, Contract 1): names, layout, manifest header, shard headers.

A dataset folder is ``manifest.json`` + ``token_counts.safetensors`` + ``shards/shard-NNNNNN.safetensors``.
A shard packs its samples' rows one after another (``sample_offsets`` marks where each starts) and
describes them in its safetensors metadata, so a reader indexes a dataset from headers alone.
This module knows the layout; :mod:`redraft.core.dataset.writer` writes it, :mod:`redraft.core.dataset.reader`
reads it, :mod:`redraft.core.dataset.fp8` encodes hidden states, :mod:`redraft.core.dataset.safetensors_bytes`
serialises canonically.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from redraft.core.errors import UserError
from redraft.core.layers import AUX_LAYER_CONVENTION

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
COUNTS_NAME = "token_counts.safetensors"
SHARD_DIR = "shards"
HIDDEN_DTYPES = ("bf16", "fp8")

_SHARD_NAME = "shard-{:06d}.safetensors"
_BASE_KEYS = ("input_ids", "loss_mask", "sample_offsets")
_LOGPROB_FLOOR = torch.finfo(torch.float32).min  # stored in place of -inf (exp() of it is 0.0)
_HASH_CHUNK = 8 << 20


class DatasetError(UserError):
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


def bytes_per_token(
    hidden_size: int, num_aux: int, hidden_dtype: str, teacher_kinds: tuple[str, ...] | list[str], topk: int
) -> float:
    """Bytes one token costs in a shard, from the layout table (per-sample offsets and headers excluded)."""
    check_hidden_dtype(hidden_dtype)
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
    self_prompts: Mapping[str, Any] | None = None,
    decontamination: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The dataset-level manifest fields, for :func:`finalize_dataset` (which adds shards and totals).

    The one place these names are spelled: the extraction writes its header with it, and so does
    every synthetic dataset (tests, benchmarks), so readers never meet a second dialect.
    ``target`` is the extraction's TargetInfo as a dict (hand-made datasets give at least name,
    path, config_hash and architecture). ``regeneration`` is the check of the samples captured from
    generated ids (``extract.generated.ExactnessCounts``), known once every shard is written.
    ``self_prompts``: the recipe and counts of the prompts the target wrote itself (``--data self``,
    ``extract.self_prompts``); the key is present only when they were used. ``decontamination``: the
    check of every input record against evaluation prompts (``--decontaminate``,
    ``extract.decontaminate``); the key is present only when it ran.
    """
    kinds = list(teacher)
    bad = [k for k in kinds if k not in TEACHER_KINDS]
    if bad or not kinds:
        raise ValueError(f"dataset_header: teacher must name {TEACHER_KINDS}, got {kinds}")
    if ("topk" in kinds) != (topk is not None):
        raise ValueError(f"dataset_header: topk={topk} does not fit teacher {kinds}")
    check_hidden_dtype(hidden_dtype)
    extra = {} if self_prompts is None else {"self_prompts": dict(self_prompts)}
    if decontamination is not None:
        extra["decontamination"] = dict(decontamination)
    return {
        **extra,
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


def clamp_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """Replace -inf (tokens the target gives zero probability) by the float32 minimum.

    Log-softmax legitimately produces -inf, but stored data must be finite so that one
    isfinite check catches corruption; exp(float32 min) is exactly 0.0, so nothing changes.
    NaN and +inf are left alone, so the finiteness check still rejects them.
    """
    lp = logprobs.float()
    return torch.where(lp == float("-inf"), torch.full_like(lp, _LOGPROB_FLOOR), lp)


ROW_BLOCK = 256  # rows checked or encoded at a time: temporaries stay small however long a sample is


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in `t`, checked block by block (a 4k-token Kimi sample is 350 MB of fp32 features)."""
    return all(bool(torch.isfinite(block).all()) for block in t.split(ROW_BLOCK))


def non_finite_fields(sample: SampleFeatures) -> list[str]:
    bad = []
    if not all_finite(sample.aux_hidden):
        bad.append("aux_hidden")
    if sample.last_hidden is not None and not all_finite(sample.last_hidden):
        bad.append("last_hidden")
    if sample.topk_logprobs is not None and not all_finite(clamp_logprobs(sample.topk_logprobs)):
        bad.append("topk_logprobs")
    return bad


def features_are_finite(sample: SampleFeatures) -> bool:
    """True when the sample may be written: no NaN/Inf in hidden states, logprobs finite or -inf."""
    return not non_finite_fields(sample)


def check_hidden_dtype(hidden_dtype: str) -> None:
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"hidden_dtype must be one of {HIDDEN_DTYPES}, got {hidden_dtype!r}")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


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


def feature_layout(h: ShardHeader) -> tuple[int | None, int | None, int | None]:
    """(aux width, top-k K or None, last_hidden width or None): what must agree across shards."""
    k = h.shapes["topk_ids"][1] if h.has_topk else None
    last = h.shapes["last_hidden"][1] if h.has_last_hidden else None
    return h.aux_width, k, last


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
