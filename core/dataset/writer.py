"""The one writer of dataset folders: validated shards written atomically, then the manifest.

Why it looks like this: a shard is the unit of resume, so it is written atomically (temporary
name, fsync, rename) and a file at a final name is always complete; reruns must be
byte-identical, so shard bytes depend only on the inputs and the manifest is canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from core.atomic import atomic_write_bytes
from core.dataset.format import (
    COUNTS_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    DatasetError,
    SampleFeatures,
    ShardHeader,
    ShardInfo,
    check_hidden_dtype,
    clamp_logprobs,
    feature_layout,
    non_finite_fields,
    read_shard_header,
    sha256_file,
    shard_relpath,
)
from core.dataset.fp8 import encode_hidden, put_hidden
from core.dataset.safetensors_bytes import serialize

logger = logging.getLogger(__name__)


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
    bad = non_finite_fields(s)
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
    check_hidden_dtype(hidden_dtype)
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
        put_hidden(tensors, "aux", [encode_hidden(s.aux_hidden, hidden_dtype, num_aux) for s in samples])
        topk = [(s.topk_ids, s.topk_logprobs) for s in samples if s.topk_ids is not None]
        if topk:
            tensors["topk_ids"] = torch.cat([ids.to(torch.int32) for ids, _ in topk])
            tensors["topk_logprobs"] = torch.cat([clamp_logprobs(lp) for _, lp in topk if lp is not None])
        last = [s.last_hidden for s in samples if s.last_hidden is not None]
        if last:
            put_hidden(tensors, "last", [encode_hidden(h, hidden_dtype, 1) for h in last])
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
        elif feature_layout(h) != feature_layout(first):
            raise DatasetError(
                f"{h.path}: feature keys/widths {feature_layout(h)} differ from {first.path} {feature_layout(first)}"
            )
