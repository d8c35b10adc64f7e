"""Samples and batches in the shard's stored dtypes: what the training loader moves, decoded on the device.

Why: at Kimi-K2.5's width a token is ~22 KB stored (3 x 7168 fp8 + scales + top-64) and ~86 KB decoded to fp32.
Decoding and scanning on the host would move and touch four times the bytes per token, on host cores the GPU
then waits for. Here the loader reads rows as stored (int32 ids, uint8 masks, fp8 or bf16 hidden states with
their fp32 scales), checks them on the stored bytes (NaN/Inf bit patterns, ids in the vocabulary: a pass at
storage width, no fp32 copy), pads them into a batch in pinned memory, and ``StoredBatch.to`` copies that to
the device without blocking and decodes there, to exactly what ``collate`` of decoded samples gives.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from redraft.core.dataset.batch import Batch, sequence_shard
from redraft.core.dataset.format import all_finite, clamp_logprobs
from redraft.core.dataset.fp8 import FP8

_NONFINITE_BITS = {FP8: (torch.uint8, 0x7F, 0x7F), torch.bfloat16: (torch.int16, 0x7F80, 0x7F80)}  # view, mask, hit


@dataclass
class StoredSample:
    """One sample's rows as the shard stores them (redraft.core.dataset.format's table)."""

    sample_id: str
    input_ids: torch.Tensor  # int32 [n]
    loss_mask: torch.Tensor  # uint8 [n]
    aux_hidden: torch.Tensor  # bf16 or fp8 [n, G*H]
    aux_scale: torch.Tensor | None  # fp32 [n, G] (fp8)
    topk_ids: torch.Tensor | None  # int32 [n, K]
    topk_logprobs: torch.Tensor | None  # fp32 [n, K]
    last_hidden: torch.Tensor | None  # bf16 or fp8 [n, H]
    last_scale: torch.Tensor | None  # fp32 [n, 1] (fp8)


def _non_finite(x: torch.Tensor) -> bool:
    """NaN or Inf in a stored float tensor, read off its bit patterns (exponent all ones) at its own width."""
    bits = _NONFINITE_BITS.get(x.dtype)
    if bits is None:
        return not all_finite(x)
    view, mask, hit = bits
    return bool((x.view(view) & mask).eq(hit).any())


def stored_problems(s: StoredSample, vocab_size: int) -> list[str]:
    """What the writer refuses, found in a read sample: ids outside the vocabulary, NaN/Inf features."""
    bad = []
    for key, ids in (("input_ids", s.input_ids), ("topk_ids", s.topk_ids)):
        if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad.append(f"key {key!r} holds ids outside 0..{vocab_size - 1}")
    nonfinite = [key for key, x, scale in (("aux_hidden", s.aux_hidden, s.aux_scale),
                                           ("last_hidden", s.last_hidden, s.last_scale))
                 if x is not None and (_non_finite(x) or (scale is not None and not all_finite(scale)))]
    if s.topk_logprobs is not None and not all_finite(clamp_logprobs(s.topk_logprobs)):
        nonfinite.append("topk_logprobs")
    if nonfinite:
        bad.append(f"non-finite values in {', '.join(nonfinite)}")
    return bad


@dataclass
class StoredBatch:
    """Right-padded [B, T, ...] rows in stored dtypes; ``to`` gives the decoded :class:`Batch` on a device."""

    input_ids: torch.Tensor  # int32
    attention_mask: torch.Tensor  # uint8
    loss_mask: torch.Tensor  # uint8
    aux_hidden: torch.Tensor
    aux_scale: torch.Tensor | None
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    last_hidden: torch.Tensor | None
    last_scale: torch.Tensor | None
    sample_ids: list[str]
    shard: tuple[int, int] | None = None  # a sequence-parallel rank's rows (redraft.core.dataset.batch.sequence_shard)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def _tensors(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def pin_memory(self) -> StoredBatch:
        """Page-locked copies (the DataLoader's pin_memory calls this), so ``to`` copies without blocking."""
        return StoredBatch(**{k: v.pin_memory() if isinstance(v, torch.Tensor) else v
                              for k, v in self._tensors().items()})

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Batch:
        """Copy to ``device`` as stored and decode there: ids and masks int64, hidden states (fp8 times their
        scales, in fp32) in ``dtype``, teacher log-probs fp32: what ``collate(...).to(device, dtype)`` gives."""
        moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                 for k, v in self._tensors().items()}
        return Batch(
            input_ids=moved["input_ids"].long(),
            attention_mask=moved["attention_mask"].long(),
            loss_mask=moved["loss_mask"].long(),
            aux_hidden=_decode(moved["aux_hidden"], moved["aux_scale"]).to(dtype),
            topk_ids=moved["topk_ids"].long() if moved["topk_ids"] is not None else None,
            topk_logprobs=moved["topk_logprobs"].float() if moved["topk_logprobs"] is not None else None,
            last_hidden=(_decode(moved["last_hidden"], moved["last_scale"]).to(dtype)
                         if moved["last_hidden"] is not None else None),
            sample_ids=self.sample_ids,
            shard=self.shard,
        )

    def sequence_shard(self, rank: int, size: int, halo: int) -> StoredBatch:
        """Rank ``rank`` of ``size``'s share for sequence-parallel training, still in stored dtypes
        (redraft.core.dataset.batch.sequence_shard)."""
        return sequence_shard(self, rank, size, halo)


def _decode(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[B, T, G*H] stored -> fp32 (redraft.core.dataset.fp8.dequantize_fp8's arithmetic, on x's device)."""
    if x.dtype != FP8:
        return x.float()
    if scale is None:
        raise ValueError("fp8 hidden states without scales")
    groups = scale.shape[-1]
    return (x.float().unflatten(-1, (groups, -1)) * scale.float().unsqueeze(-1)).flatten(-2)


def _pad(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Zero-padded [B, length, ...] in the rows' dtype (fp8 through its bytes)."""
    first = rows[0]
    raw = first.dtype == FP8
    out = torch.zeros((len(rows), length, *first.shape[1:]), dtype=torch.uint8 if raw else first.dtype)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r.view(torch.uint8) if raw else r
    return out.view(FP8) if raw else out


def collate_stored(samples: list[StoredSample], max_length: int = 0) -> StoredBatch:
    """Right-pad stored samples to the longest (optionally truncated) one, as ``redraft.core.dataset.batch.collate``."""
    if not samples:
        raise ValueError("collate_stored got an empty batch")
    cut = (lambda t: t[:max_length]) if max_length > 0 else (lambda t: t)
    first = samples[0]
    for s in samples:
        if ((s.topk_ids is None) != (first.topk_ids is None) or (s.last_hidden is None) != (first.last_hidden is None)
                or (s.aux_scale is None) != (first.aux_scale is None)):
            raise ValueError(f"sample {s.sample_id!r} has different stored fields than {first.sample_id!r}")
    ids = [cut(s.input_ids) for s in samples]
    length = max(t.shape[0] for t in ids)

    def pad(key: str) -> torch.Tensor | None:
        rows = [getattr(s, key) for s in samples]
        return None if rows[0] is None else _pad([cut(r) for r in rows], length)

    return StoredBatch(
        input_ids=_pad(ids, length), attention_mask=_pad([torch.ones_like(t, dtype=torch.uint8) for t in ids], length),
        loss_mask=pad("loss_mask"), aux_hidden=pad("aux_hidden"), aux_scale=pad("aux_scale"),
        topk_ids=pad("topk_ids"), topk_logprobs=pad("topk_logprobs"), last_hidden=pad("last_hidden"),
        last_scale=pad("last_scale"), sample_ids=[s.sample_id for s in samples])
