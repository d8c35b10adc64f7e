"""The one writer of dataset folders: validated shards written atomically, then the manifest.

Why it looks like this: a shard is the unit of resume, so it is written atomically (temporary
name, fsync, rename) and a file at a final name is always complete; reruns must be
byte-identical, so shard bytes depend only on the inputs and the manifest is canonical JSON.
A shard can be far larger than memory (tens of GB at Kimi-K2.5's hidden size), so it is written
as its samples arrive (:class:`ShardWriter`): each is encoded and spilled to disk at once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open

from redraft.core.atomic import atomic_open, atomic_write_bytes, temp_name
from redraft.core.dataset.format import (
    COUNTS_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ROW_BLOCK,
    DatasetError,
    SampleFeatures,
    ShardHeader,
    ShardInfo,
    all_finite,
    check_hidden_dtype,
    clamp_logprobs,
    feature_layout,
    non_finite_fields,
    read_shard_header,
    sha256_file,
    shard_relpath,
)
from redraft.core.dataset.fp8 import encode_hidden, put_hidden
from redraft.core.dataset.safetensors_bytes import data_order, header_bytes, serialize, tensor_bytes
from redraft.core.dataset.shard_record import recorded_info, write_record
from redraft.core.dataset.token_counts import count_tokens

logger = logging.getLogger(__name__)

_COPY_CHUNK = 8 << 20  # bytes per read when a spill file is copied into the shard


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


class ShardWriter:
    """Writes one shard as its samples arrive, keeping none of their rows in memory.

    ``add`` validates a sample, encodes it to the storage dtype at once and appends its rows to
    per-key spill files next to the shard (``.shard-NNNNNN.safetensors.tmp-PID.KEY``); ``finish``
    streams the header and then each key's rows, in sample order, into the shard's temporary name
    (sha256 computed on the way), fsyncs and renames it. Samples may arrive in any order (the
    pipeline captures them in length-sorted batches): each carries its ``position`` in the shard, and
    the file is the same whatever the arrival order. On any error, or ``abort``, the spill files and
    the temporary shard are removed, so nothing half-written is ever left at a final name; a killed
    process leaves only hidden ``.NAME.tmp-*`` files, which the next run removes.
    """

    def __init__(self, root: Path, index: int, *, hidden_dtype: str, num_aux: int) -> None:
        check_hidden_dtype(hidden_dtype)
        if num_aux < 1:
            raise ValueError(f"num_aux must be >= 1, got {num_aux}")
        self.root, self.index = Path(root), index
        self.rel = shard_relpath(index)
        self.path = Path(root) / self.rel
        self.hidden_dtype = hidden_dtype
        self.num_aux = num_aux
        self._layout: tuple[int, int | None, int | None] | None = None  # widths every sample must share
        self._first_id = ""
        self._specs: dict[str, tuple[torch.dtype, int]] = {}  # per-token key -> (dtype, row bytes)
        self._spills: dict[str, BinaryIO] = {}
        self._rows = 0  # rows spilled so far (arrival order)
        self._entries: dict[int, tuple[int, int, dict[str, Any]]] = {}  # position -> (first row, rows, meta)
        self._ids: set[str] = set()
        self._closed = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()

    def _spill_path(self, key: str) -> Path:
        return temp_name(self.path).with_name(f"{temp_name(self.path).name}.{key}")

    def add(self, sample: SampleFeatures, position: int | None = None) -> None:
        """Validate, encode and spill one sample; ``position`` is its place in the shard (default: next)."""
        if self._closed:
            raise RuntimeError(f"{self.path}: the shard writer is closed")
        pos = len(self._entries) if position is None else int(position)
        try:
            _validate_sample(sample, self.num_aux)
            self._check_uniform(sample)
            if pos in self._entries:
                raise ValueError(f"sample {sample.sample_id!r}: position {pos} is taken")
            n = int(sample.input_ids.shape[0])
            loss_tokens = 0
            # Block by block: the encoders' temporaries (fp8 makes three fp32 copies) stay small whatever
            # the sample's length, and scales are per token, so the bytes equal encoding it whole.
            for a in range(0, max(n, 1), ROW_BLOCK):
                tensors = self._encode(sample, a, a + ROW_BLOCK)
                loss_tokens += int(tensors["loss_mask"].sum())
                for key, t in tensors.items():
                    self._spill(key, t)
                del tensors
        except BaseException:
            self.abort()
            raise
        self._ids.add(sample.sample_id)
        meta = {
            "id": sample.sample_id,
            "source": sample.source,
            "category": sample.category,
            "num_tokens": n,
            "num_loss_tokens": loss_tokens,
            "truncated": bool(sample.truncated),
        }
        self._entries[pos] = (self._rows, n, meta)
        self._rows += n

    def _check_uniform(self, s: SampleFeatures) -> None:
        """All samples of a shard must share widths and teacher kinds, since rows are packed."""
        if s.sample_id in self._ids:
            raise ValueError(f"sample id {s.sample_id!r} appears twice in one shard")
        layout = (s.aux_hidden.shape[1], None if s.topk_ids is None else s.topk_ids.shape[1],
                  None if s.last_hidden is None else s.last_hidden.shape[1])
        if self._layout is None:
            last_w = layout[2]
            if last_w is not None and last_w * self.num_aux != layout[0]:
                raise ValueError(
                    f"sample {s.sample_id!r}: last_hidden width {last_w} != aux_hidden width {layout[0]} / {self.num_aux}"
                )
            self._layout, self._first_id = layout, s.sample_id  # widths only: no feature rows are kept
            return
        first = self._first_id
        if layout[0] != self._layout[0]:
            raise ValueError(f"sample {s.sample_id!r}: aux_hidden width {layout[0]} != {self._layout[0]}")
        if layout[1] != self._layout[1]:
            raise ValueError(f"sample {s.sample_id!r}: topk width {layout[1]} != {self._layout[1]} of sample {first!r}")
        if layout[2] != self._layout[2]:
            raise ValueError(
                f"sample {s.sample_id!r}: last_hidden width {layout[2]} != {self._layout[2]} of sample {first!r}"
            )

    def _encode(self, s: SampleFeatures, a: int, b: int) -> dict[str, torch.Tensor]:
        """Rows [a, b) of the sample's every per-token key, in the storage dtypes."""
        out: dict[str, torch.Tensor] = {
            "input_ids": s.input_ids[a:b].to(torch.int32),
            "loss_mask": s.loss_mask[a:b].to(torch.bool).to(torch.uint8),
        }
        # Scales are per token, so encoding block by block equals encoding the concatenation.
        put_hidden(out, "aux", [encode_hidden(s.aux_hidden[a:b], self.hidden_dtype, self.num_aux)])
        if s.topk_ids is not None and s.topk_logprobs is not None:
            out["topk_ids"] = s.topk_ids[a:b].to(torch.int32)
            out["topk_logprobs"] = clamp_logprobs(s.topk_logprobs[a:b])
        if s.last_hidden is not None:
            put_hidden(out, "last", [encode_hidden(s.last_hidden[a:b], self.hidden_dtype, 1)])
        # Inputs were checked finite; fp8 is clamped to +-448, but bf16 rounding can still overflow to inf
        # for |x| near the float32 maximum.
        for key in ("aux_hidden", "last_hidden"):
            t = out.get(key)
            if t is not None and t.dtype == torch.bfloat16 and not all_finite(t):
                raise ValueError(f"sample {s.sample_id!r}: {key} overflows bfloat16 (|value| near the float32 maximum)")
        return out

    def _spill(self, key: str, t: torch.Tensor) -> None:
        row_bytes = t.dtype.itemsize * (t.shape[1] if t.dim() == 2 else 1)
        spec = self._specs.setdefault(key, (t.dtype, row_bytes))
        if spec != (t.dtype, row_bytes):  # cannot happen after _check_uniform; guards the byte layout
            raise ValueError(f"key {key!r}: {t.dtype} rows of {row_bytes} bytes, the shard has {spec}")
        f = self._spills.get(key)
        if f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self._spills[key] = open(self._spill_path(key), "wb")  # closed in finish/abort
        try:
            f.write(tensor_bytes(t))
        except OSError as e:
            if e.filename is not None:
                raise
            # write() errors (ENOSPC, EIO) carry no file name; name the shard they were for
            raise OSError(e.errno, e.strerror or str(e), str(self.path)) from e

    def finish(self, skipped: Mapping[str, int] | None = None) -> ShardInfo:
        """Assemble the shard from the spill files (streamed, hashed), rename it into place, clean up."""
        if self._closed:
            raise RuntimeError(f"{self.path}: the shard writer is closed")
        try:
            info = self._assemble(skipped or {})
        except BaseException:
            self.abort()
            raise
        self.abort()  # only removes what is left: the spill files
        write_record(self.root, self.index, info)  # the hash just computed, so resume and finalize need not redo it
        logger.debug("wrote %s: %d samples, %d tokens", self.rel, info.num_samples, info.num_tokens)
        return info

    def _assemble(self, skipped: Mapping[str, int]) -> ShardInfo:
        for f in self._spills.values():
            f.close()
        order = sorted(self._entries)
        entries = [self._entries[p] for p in order]
        lengths = [n for _, n, _ in entries]
        offsets = torch.zeros(len(entries) + 1, dtype=torch.int64)
        if entries:
            offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        total = int(offsets[-1])
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {"sample_offsets": (torch.int64, (len(entries) + 1,))}
        if entries:
            for key, (dtype, row_bytes) in self._specs.items():
                width = row_bytes // dtype.itemsize
                specs[key] = (dtype, (total,) if key in ("input_ids", "loss_mask") else (total, width))
        else:
            # An empty shard holds only the index keys: there is no row to give the hidden keys a width.
            specs.update(input_ids=(torch.int32, (0,)), loss_mask=(torch.uint8, (0,)))
        meta_samples = [m for _, _, m in entries]
        skipped_clean = {str(k): int(v) for k, v in sorted(skipped.items())}
        metadata = {
            "format_version": str(FORMAT_VERSION),
            "hidden_dtype": self.hidden_dtype,
            "num_aux": str(self.num_aux),
            "samples": json.dumps(meta_samples, sort_keys=True, separators=(",", ":")),
            "skipped": json.dumps(skipped_clean, sort_keys=True, separators=(",", ":")),
        }
        digest = hashlib.sha256()
        with atomic_open(self.path, "wb") as out:

            def emit(data: bytes | memoryview) -> None:
                out.write(data)
                digest.update(data)

            emit(header_bytes(specs, metadata))
            for key in data_order(specs):
                if key == "sample_offsets":
                    emit(tensor_bytes(offsets))
                elif entries:
                    self._copy_rows(key, entries, emit)
        return ShardInfo(
            path=self.rel,
            sha256=digest.hexdigest(),
            num_samples=len(entries),
            num_tokens=total,
            num_loss_tokens=sum(int(m["num_loss_tokens"]) for m in meta_samples),
            skipped=skipped_clean,
        )

    def _copy_rows(self, key: str, entries: list[tuple[int, int, dict[str, Any]]], emit: Any) -> None:
        """Stream one key's rows from its spill file in sample order, in bounded reads."""
        row_bytes = self._specs[key][1]
        fd = os.open(self._spill_path(key), os.O_RDONLY)
        try:
            for first, n, _ in entries:
                pos, end = first * row_bytes, (first + n) * row_bytes
                while pos < end:
                    chunk = os.pread(fd, min(_COPY_CHUNK, end - pos), pos)
                    if not chunk:
                        raise OSError(errno.EIO, f"spill file of {key!r} ends early", str(self.path))
                    emit(chunk)
                    pos += len(chunk)
        finally:
            os.close(fd)
        self._spill_path(key).unlink()  # frees its disk space before the next key is copied

    def abort(self) -> None:
        """Remove the spill files (the temporary shard is atomic_open's to remove); idempotent."""
        self._closed = True
        for key, f in self._spills.items():
            f.close()
            self._spill_path(key).unlink(missing_ok=True)
        self._spills.clear()


def write_shard(
    root: Path,
    index: int,
    samples: list[SampleFeatures],
    *,
    hidden_dtype: str,
    num_aux: int,
    skipped: Mapping[str, int] | None = None,
) -> ShardInfo:
    """Write shard `index` from samples in memory (tests, synthetic datasets), through :class:`ShardWriter`.

    Raises ValueError (naming the sample) on inconsistent shapes or NaN/Inf features; the
    pipeline filters those first with `features_are_finite` and counts them as skipped.
    """
    with ShardWriter(root, index, hidden_dtype=hidden_dtype, num_aux=num_aux) as writer:
        for s in samples:
            writer.add(s)
        return writer.finish(skipped)


def shard_loss_tokens(path: Path) -> list[int]:
    """Loss tokens per sample counted from the `loss_mask` rows themselves (not the metadata)."""
    hdr = read_shard_header(path)
    with safe_open(str(path), framework="pt") as f:
        mask = f.get_tensor("loss_mask")
    return [int(mask[a:b].sum()) for a, b in zip(hdr.offsets, hdr.offsets[1:], strict=False)]


def read_shard_info(root: Path, index: int, *, rehash: bool = False) -> ShardInfo | None:
    """For resume and finalize: None when shard `index` is absent, else its ShardInfo.

    The writer's record (``redraft.core.dataset.shard_record``) is trusted while the file is the one it recorded, so a
    shard is hashed once, when written; ``rehash`` (or no usable record) reads and hashes the file, and leaves
    a record for the next caller. Raises DatasetError when a file at the final name does not parse or is
    inconsistent; writes are atomic, so that means outside damage: delete the file to recompute it.
    """
    rel = shard_relpath(index)
    path = Path(root) / rel
    if not path.exists():
        return None
    if not rehash and (info := recorded_info(root, index)) is not None:
        return info
    hdr = read_shard_header(path)
    loss = shard_loss_tokens(path)
    if loss != [int(s["num_loss_tokens"]) for s in hdr.samples]:
        raise DatasetError(f"{path}: metadata num_loss_tokens disagree with key 'loss_mask'")
    info = ShardInfo(
        path=rel,
        sha256=sha256_file(path),
        num_samples=len(hdr.samples),
        num_tokens=hdr.num_tokens,
        num_loss_tokens=sum(loss),
        skipped=hdr.skipped,
    )
    write_record(root, index, info)
    return info


def _sum_skipped(*parts: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[str(k)] = out.get(str(k), 0) + int(v)
    return dict(sorted(out.items()))


def finalize_dataset(root: Path, *, num_shards: int, header: Mapping[str, Any], vocab_size: int,
                     rehash: bool = False) -> dict:
    """Write token_counts.safetensors then manifest.json (both atomically) once every shard exists.

    `header` holds the dataset-level facts (target, tokenizer_hash, chat_template_hash,
    hidden_size, num_layers, vocab_size, aux_layer_ids, aux_layer_convention, teacher,
    hidden_dtype, max_length, generation, and parse-time skip counts under "skipped").
    Shard facts and totals are computed here, each shard's sha256 from its writer's record unless ``rehash``
    (``read_shard_info``). Returns the manifest as written.
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
        info = read_shard_info(root, i, rehash=rehash)
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
