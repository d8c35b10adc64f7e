"""Ulysses sequence parallelism for the drafter: one long sample split along T across the ranks of a group.

Why: a Kimi-K2.5 thinking conversation runs to 64K tokens and more, and a rank that holds all of it holds
T x (aux width + hidden + K steps of state) at once. With ``size`` ranks each holds T / size contiguous
rows of everything that is per token (the aux features, each step's state, the MLP, the head and the
teacher). Attention is the one part that mixes rows: before it, one all-to-all trades each rank's rows of
every head for every row of 1 / size of the heads; the TTT attention then runs unchanged (causal step-0
keys plus the diagonal, redraft.core.drafter.ttt_attention) on whole sequences of its heads, and a second
all-to-all trades back. Each all-to-all is the other's backward.

The split is by kv head (GQA keeps each kv head with its query group; MLA has one kv head per head), so
the number of kv heads must be a multiple of ``size``. T must be a multiple of ``size`` (the trainer
right-pads the batch; padding is masked as any padding is).

Gradients: each rank's loss is its rows' share of the group's loss (the denominators are the group's, one
all-reduce of counts), so the group's gradient is the sum over its ranks; a data-parallel mean over
all ranks therefore needs each rank's loss times ``size`` (train/main.py does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from redraft.core.config import ConfigError


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: ``rank`` of ``size``, over ``group`` (a process group)."""

    size: int
    rank: int
    group: Any = None

    def bounds(self, seq: int) -> tuple[int, int]:
        """The rows [start, stop) of a length-``seq`` sequence this rank holds."""
        if seq % self.size:
            raise ValueError(f"sequence parallel: a sequence of {seq} rows does not split over {self.size} ranks "
                             "(pad the batch to a multiple)")
        rows = seq // self.size
        return self.rank * rows, (self.rank + 1) * rows

    def check_heads(self, kv_heads: int) -> None:
        if kv_heads % self.size:
            raise ConfigError(f"sequence_parallel={self.size} does not divide the drafter's {kv_heads} kv heads "
                              "(attention is split by kv head)")

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The group's sum of ``x`` (no gradient: counts and denominators)."""
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out


def sequence_groups(world: int, size: int, rank: int) -> SequenceParallel | None:
    """The sequence-parallel group of ``rank``: ranks [g * size, (g + 1) * size) form group g (consecutive
    ranks, so a group sits on one node's fast links). None when ``size`` is 1. Every rank must call this
    (torch.distributed.new_group is a collective over the world)."""
    if size <= 1:
        return None
    if world % size:
        raise ValueError(f"sequence_parallel {size} does not divide the world of {world} processes")
    mine = None
    for g in range(world // size):
        ranks = list(range(g * size, (g + 1) * size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = SequenceParallel(size=size, rank=rank - g * size, group=group)
    return mine


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x [P, ...] contiguous: chunk j goes to rank j; the result's chunk i came from rank i."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _rows_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[B, T/P, H, ...] (this rank's rows, every head) -> [B, T, H/P, ...] (every row, this rank's heads)."""
    bsz, rows, heads = x.shape[:3]
    rest = x.shape[3:]
    p = sp.size
    send = x.reshape(bsz, rows, p, heads // p, *rest).movedim(2, 0).contiguous()  # chunk j: rank j's heads
    got = _all_to_all(send, sp.group)  # chunk i: rank i's rows of my heads
    return got.movedim(0, 1).reshape(bsz, p * rows, heads // p, *rest)


def _heads_to_rows(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[B, T, H/P, ...] -> [B, T/P, H, ...]: the inverse of _rows_to_heads."""
    bsz, seq, heads = x.shape[:3]
    rest = x.shape[3:]
    p = sp.size
    send = x.reshape(bsz, p, seq // p, heads, *rest).movedim(1, 0).contiguous()  # chunk j: rank j's rows
    got = _all_to_all(send, sp.group)  # chunk i: rank i's heads of my rows
    return got.movedim(0, 2).reshape(bsz, seq // p, p * heads, *rest)


class _Trade(torch.autograd.Function):
    """One all-to-all (rows -> heads, or back); its backward is the other direction's."""

    @staticmethod
    def forward(ctx, x, sp, to_heads):  # type: ignore[override]
        ctx.sp, ctx.to_heads = sp, to_heads
        return _rows_to_heads(x, sp) if to_heads else _heads_to_rows(x, sp)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        return (_heads_to_rows(grad, ctx.sp) if ctx.to_heads else _rows_to_heads(grad, ctx.sp)), None, None


def rows_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Differentiable [B, T/P, H, ...] -> [B, T, H/P, ...] (dim 2 is the head dim that is split)."""
    return _Trade.apply(x, sp, True)


def heads_to_rows(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Differentiable [B, T, H/P, ...] -> [B, T/P, H, ...]."""
    return _Trade.apply(x, sp, False)
