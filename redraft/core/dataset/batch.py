"""Samples -> padded batches: what the trainer and the evaluator feed the drafter.

Tensors stay in RAW alignment (row t is token t; the TTT unroll and the acceptance simulation
shift them themselves), right-padded to the longest sample, padding with masks 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch


@dataclass
class Batch:
    """RAW right-padded [B, T] tensors (ttt_forward does the alignment shift itself)."""

    input_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # int64 [B, T], 1 = real token
    loss_mask: torch.Tensor  # int64 [B, T]
    aux_hidden: torch.Tensor  # float [B, T, 3H]
    topk_ids: torch.Tensor | None  # int64 [B, T, K]
    topk_logprobs: torch.Tensor | None  # float32 [B, T, K]
    last_hidden: torch.Tensor | None  # float [B, T, H]
    sample_ids: list[str]
    # rows [start, stop) that aux_hidden holds when this is one rank's share of a sequence-parallel batch
    # (Batch.sequence_shard); None: every row
    shard: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Batch:
        """Move to ``device``; hidden states take ``dtype``, teacher log-probs stay fp32 for the loss."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                if f.name in ("aux_hidden", "last_hidden"):
                    v = v.to(device=device, dtype=dtype, non_blocking=True)
                else:
                    v = v.to(device=device, non_blocking=True)
            out[f.name] = v
        return Batch(**out)

    def sequence_shard(self, rank: int, size: int, halo: int) -> Batch:
        """Rank ``rank`` of ``size``'s share for sequence-parallel training (:func:`sequence_shard`)."""
        return sequence_shard(self, rank, size, halo)


# Which [B, T, ...] fields a sequence-parallel rank keeps whole, for its rows, or for its rows plus the halo
# (Batch and redraft.core.dataset.stored.StoredBatch name them alike)
WHOLE_FIELDS = ("input_ids", "attention_mask", "loss_mask")
ROW_FIELDS = ("aux_hidden", "aux_scale")
HALO_FIELDS = ("topk_ids", "topk_logprobs", "last_hidden", "last_scale")


def sequence_shard(batch: Any, rank: int, size: int, halo: int) -> Any:
    """Rank ``rank`` of ``size``'s share of a batch for sequence-parallel training (redraft.core.drafter.sequence_parallel).

    The batch is first right-padded to a multiple of ``size`` rows (masks 0). The [B, T] ids and masks stay whole
    (the TTT shifts read the next rows, attention reads every row's mask; they are small); the aux features keep
    this rank's T / size rows; the teacher fields keep those rows plus the next ``halo`` (the rows the last TTT
    steps are scored against), zero past the end. Works on a Batch and on a StoredBatch (before decoding: the
    other ranks' rows are never copied to the device).
    """
    seq = batch.input_ids.shape[1]
    padded = -(-seq // size) * size
    rows = padded // size
    start, stop = rank * rows, (rank + 1) * rows
    changes: dict[str, Any] = {"shard": (start, stop)}
    for name, end in [*((n, padded) for n in WHOLE_FIELDS), *((n, stop) for n in ROW_FIELDS),
                      *((n, stop + halo) for n in HALO_FIELDS)]:
        t = getattr(batch, name, None)
        if t is not None:
            changes[name] = _grow_rows(t, end)[:, 0 if name in WHOLE_FIELDS else start : end]
    return replace(batch, **changes)


def _grow_rows(t: torch.Tensor, length: int) -> torch.Tensor:
    """t [B, T, ...] with zero rows appended up to ``length`` (fp8 through its bytes)."""
    if t.shape[1] >= length:
        return t
    raw = t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t
    out = torch.cat((raw, raw.new_zeros((raw.shape[0], length - raw.shape[1], *raw.shape[2:]))), dim=1)
    return out.view(t.dtype) if raw is not t else out


def _pad(rows: list[torch.Tensor], length: int, value: float = 0) -> torch.Tensor:
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), value)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def _tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t if dtype is None else t.to(dtype)


def collate(samples: list[Any], max_length: int = 0) -> Batch:
    """Right-pad SampleFeatures to the longest (optionally truncated) sample; padding has masks 0."""
    if not samples:
        raise ValueError("collate got an empty batch")
    cut = (lambda t: t[:max_length]) if max_length > 0 else (lambda t: t)
    ids = [cut(_tensor(s.input_ids, torch.int64)) for s in samples]
    T = max(t.shape[0] for t in ids)
    has_topk = samples[0].topk_ids is not None
    has_last = samples[0].last_hidden is not None
    for s in samples:
        if (s.topk_ids is not None) != has_topk or (s.last_hidden is not None) != has_last:
            raise ValueError(f"sample {s.sample_id!r} has different teacher fields than {samples[0].sample_id!r}")
    return Batch(
        input_ids=_pad(ids, T),
        attention_mask=_pad([torch.ones_like(t) for t in ids], T),
        loss_mask=_pad([cut(_tensor(s.loss_mask, torch.int64)) for s in samples], T),
        aux_hidden=_pad([cut(_tensor(s.aux_hidden)) for s in samples], T),
        topk_ids=_pad([cut(_tensor(s.topk_ids, torch.int64)) for s in samples], T) if has_topk else None,
        topk_logprobs=(
_pad([cut(_tensor(s.topk_logprobs, torch.float32)) for s in samples], T) if has_topk else None
        ),
        last_hidden=_pad([cut(_tensor(s.last_hidden)) for s in samples], T) if has_last else None,
        sample_ids=[str(s.sample_id) for s in samples],
    )
