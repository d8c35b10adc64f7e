"""Attention inside a training-time-test (TTT) unroll: a cache of each step's keys and its kernels.

The first step's keys are attended causally (plus key padding); every later step adds only its
own same-position ("diagonal") key. That is also the pattern of chain drafting in an engine (the
drafter's keys for positions <= t come from the target's features, the later ones are its own),
so training and offline evaluation share this code. Three implementations of the same math:
``eager`` (a hand-written autograd kernel over blocks of query rows, the reference numerics; it
keeps no [T, T] scores for the backward; the CPU default), ``sdpa`` (torch SDPA over the concatenated
step keys with a boolean [T, (k+1)T] mask, for GPU kernels that take masks) and ``flex`` (FlexAttention
over the same keys with the TTT pattern as a block mask: the causal step-0 keys and each later step's
diagonal, so the kernel skips the blocks nothing sees; compiled on CUDA, where it is fused forward and
backward; on a CPU it runs forward only, for tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_IMPLS = ("eager", "sdpa", "flex")


def default_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), written as SpecForge and the engines compute it (the reference's exact rounding)."""
    return 1.0 / math.sqrt(head_dim)


@dataclass
class TTTCache:
    """Keys/values of the steps run so far, unrepeated over GQA groups: [B, n_kv, T, head_dim] each.

    Entry 0 holds the first step's keys (attended causally); entry j >= 1 holds step j's keys,
    which later steps attend only at the same position (the "diagonal").
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    # (attention_mask it was built from, seq, dtype, additive mask [B|1, 1, 1, T, T], rows with no step-0 key
    # [B|1, 1, 1, T, 1] or None): the step-0 causal + key-padding mask is the same at every step of an
    # unroll, so it is built once.
    mask_bias: tuple[Any, int, torch.dtype, torch.Tensor, torch.Tensor | None] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def causal_bias(self, seq: int, attention_mask: torch.Tensor | None, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Additive mask (0 allowed, dtype's min elsewhere) for the step-0 keys and its all-masked rows
        (None without an attention mask), cached per unroll."""
        cached = self.mask_bias
        if cached is not None and cached[0] is attention_mask and cached[1] == seq and cached[2] == dtype:
            return cached[3], cached[4]
        allowed = _causal_allowed(seq, attention_mask, device)
        allowed = allowed[:, None, None] if allowed.dim() == 3 else allowed[None, None, None]
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        dead = None if attention_mask is None else ~allowed.any(-1, keepdim=True)
        self.mask_bias = (attention_mask, seq, dtype, bias, dead)
        return bias, dead


def ttt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TTTCache, attention_mask: torch.Tensor | None,
    impl: str = "eager", scale: float | None = None,
) -> torch.Tensor:
    """Append this step's k [B, T, n_kv, hd], v [B, T, n_kv, hd_v] to ``cache`` and attend with q [B, T, n_kv, g, hd].

    Returns [B, T, heads * hd_v]. With an empty cache the step attends causally over its own keys
    (masked by ``attention_mask`` [B, T], 1 = real token); otherwise over the cached first-step keys
    plus the same-position keys of every later step, this one included. ``scale`` multiplies q.k
    (default ``hd ** -0.5``; MLA's differs, and its values are narrower than its keys).
    """
    bsz, seq = q.shape[:2]
    qh = q.permute(0, 2, 3, 1, 4)  # [B, n_kv, groups, T, hd]
    cache.keys.append(k.transpose(1, 2))  # [B, n_kv, T, hd]
    cache.values.append(v.transpose(1, 2))
    if impl == "sdpa":
        out = _sdpa_attention(qh, cache, attention_mask, scale=scale)
    elif impl == "flex":
        out = _flex_attention(qh, cache, attention_mask, scale=scale)
    else:
        out = _eager_attention(qh, cache, attention_mask, scale=scale)
    return out.permute(0, 3, 1, 2, 4).reshape(bsz, seq, -1)


def _causal_allowed(seq: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """bool [T, T] or [B, T, T]: query i may see step-0 key j iff j <= i and j is a real token."""
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if attention_mask is not None:
        allowed = allowed[None] & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
    return allowed


# Query rows per block of the eager kernel: the [rows, keys] fp32 score block of all heads is then
# ~64 MB at most (T = 4096, 32 heads: 128 rows); at the demo shapes one block covers every row.
EAGER_BLOCK_ELEMENTS = 1 << 24
MIN_BLOCK_ROWS = 32


def eager_block_rows(bsz: int, heads: int, seq: int) -> int:
    return max(MIN_BLOCK_ROWS, EAGER_BLOCK_ELEMENTS // max(bsz * heads * seq, 1))


def _eager_attention(
    q: torch.Tensor, cache: TTTCache, attention_mask: torch.Tensor | None, block_rows: int | None = None, *,
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, n_kv, g, T, hd] -> [B, n_kv, g, T, hd_v]; causal scores over step-0 keys + diagonal columns.

    ``block_rows``: query rows per score block (default eager_block_rows).
    """
    bsz, nkv, groups, seq = q.shape[:4]
    rows = block_rows or eager_block_rows(bsz, nkv * groups, seq)
    bias, dead = cache.causal_bias(seq, attention_mask, torch.promote_types(q.dtype, torch.float32), q.device)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return _TTTAttention.apply(q, bias, dead, len(cache.keys) - 1, rows, scale, *cache.keys, *cache.values)


def _blocks(seq: int, rows: int) -> list[tuple[int, int]]:
    return [(a, min(a + rows, seq)) for a in range(0, seq, rows)]


class _TTTAttention(torch.autograd.Function):
    """One softmax over [causal step-0 keys | k diagonal keys] with a hand-written, blocked backward.

    Why: autograd over the plain expression materialises the [T, T] block five or six times per
    step and keeps it for the backward: K steps x heads x T^2 fp32, 15 GB at T = 4096 with 32 heads
    and K = 7. Here the queries run in blocks of rows; a block of rows [a, e) is scored only
    against the keys it may see (0..e-1: the causal upper triangle beyond the block is never
    computed), masked in place and passed through one ``torch.softmax`` (whose vectorised exp is
    several times faster than ``exp_`` on CPU, and not slowed by the masked entries). With several
    blocks nothing of them is kept: the backward recomputes each block's probabilities the same
    way (one more q.k matmul and softmax per block, less work than the full [T, T] block of both
    passes). A sequence that fits in one block (B * heads * T^2 <= EAGER_BLOCK_ELEMENTS) keeps its
    probabilities instead (at most 64 MB per step): recomputing them would cost time for no gain
    worth having. The diagonal keys join through the
    block's logsumexp (read off the softmax at its maximum), which rescales only [T, hd]-sized
    tensors. The backward uses FlashAttention's identity rowsum(P * dP) = rowsum(dO * O). The
    score math runs in fp32 or wider (as the reference softmax did); the matmuls run in q's dtype.
    GQA groups are folded into the matmul rows ([B*n_kv, g*rows, hd]), which also sums the
    key/value gradients over the groups. Like masked_fill, the mask passes no gradient: a query
    row with no visible key (an all-padding sample at step 0) gets uniform weights over the keys
    of its block and no score gradient.
    """

    @staticmethod
    def forward(ctx, q, bias, dead, n_diag, block_rows, scale, *kv):  # type: ignore[override]
        bsz, nkv, groups, seq, hd = q.shape
        keys, values = kv[: n_diag + 1], kv[n_diag + 1:]
        hv = values[0].shape[-1]
        dt, acc = q.dtype, bias.dtype
        qs = q * scale
        k0 = keys[0].reshape(bsz * nkv, seq, hd)
        v0 = values[0].reshape(bsz * nkv, seq, hv)
        blocks = _blocks(seq, block_rows)
        outs, lses = [], []
        kept = None
        for a, e in blocks:
            n = e - a
            s0 = torch.bmm(qs[..., a:e, :].reshape(bsz * nkv, groups * n, hd), k0[:, :e].transpose(1, 2))
            s0 = s0.view(bsz, nkv, groups, n, e).to(acc).add_(bias[..., a:e, :e])
            m0 = s0.amax(-1) if n_diag else None
            p0 = torch.softmax(s0, dim=-1)  # over the step-0 keys alone
            del s0
            if n_diag:
                lses.append(m0 - p0.amax(-1).log())  # p0's maximum is exp(m0 - lse0)
            outs.append(torch.bmm(p0.view(bsz * nkv, groups * n, e).to(dt), v0[:, :e]).view(bsz, nkv, groups, n, hv))
            if len(blocks) == 1:
                kept = p0  # one block (at most EAGER_BLOCK_ELEMENTS): keep it rather than recompute it
            del p0
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
        del outs
        w0 = pd = None
        if n_diag:
            dg = torch.stack([(qs * kj[:, :, None]).sum(-1) for kj in keys[1:]], dim=-1).to(acc)  # [.., T, k]
            lse0 = lses[0] if len(lses) == 1 else torch.cat(lses, dim=-1)
            lse = torch.logsumexp(torch.cat((lse0[..., None], dg), dim=-1), dim=-1)
            w0 = torch.exp(lse0 - lse)[..., None]  # share of the step-0 keys in the joint softmax
            pd = torch.exp(dg - lse[..., None])  # probabilities of the diagonal keys
            out = out * w0.to(dt)
            for j, vj in enumerate(values[1:]):
                out = out + pd[..., j : j + 1].to(dt) * vj[:, :, None]
        ctx.n_diag = n_diag
        ctx.block_rows = block_rows
        ctx.scale = scale
        ctx.dead = dead if n_diag == 0 else None  # with diagonal keys no row is empty
        ctx.bias = bias
        ctx.kept = kept is not None
        ctx.save_for_backward(qs, out, *(() if kept is None else (kept,)), *(() if w0 is None else (w0, pd)), *kv)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        n_diag = ctx.n_diag
        saved = ctx.saved_tensors
        qs, out = saved[:2]
        kept = saved[2] if ctx.kept else None
        saved = saved[3:] if ctx.kept else saved[2:]
        w0 = pd = None
        if n_diag:
            w0, pd = saved[:2]
        kv = saved[2:] if n_diag else saved
        keys, values = kv[: n_diag + 1], kv[n_diag + 1:]
        bias, dead = ctx.bias, ctx.dead
        bsz, nkv, groups, seq, hd = qs.shape
        dt, acc = qs.dtype, bias.dtype
        dout = dout.to(dt)
        rowdot = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # [.., T, 1] = rowsum(P * dP), all keys
        # step-0 block: P0 = w0 * p0, so scale dO (small) instead of the score block
        do0 = dout if w0 is None else dout * w0.to(dt)
        rd0 = rowdot if w0 is None else rowdot * w0
        k0 = keys[0].reshape(bsz * nkv, seq, hd)
        hv = values[0].shape[-1]
        v0 = values[0].reshape(bsz * nkv, seq, hv)
        blocks = _blocks(seq, ctx.block_rows)
        dqs_blocks = []
        dk0 = dv0 = None
        for a, e in blocks:
            n = e - a
            q3 = qs[..., a:e, :].reshape(bsz * nkv, groups * n, hd)
            if kept is not None:
                p0 = kept
            else:  # the forward's softmax again (not exp(s - lse): exp of the masked entries is slow on CPU)
                s0 = torch.bmm(q3, k0[:, :e].transpose(1, 2)).view(bsz, nkv, groups, n, e).to(acc)
                p0 = torch.softmax(s0.add_(bias[..., a:e, :e]), dim=-1)
                del s0
            p3 = p0.view(bsz * nkv, groups * n, e)
            do3 = do0[..., a:e, :].reshape(bsz * nkv, groups * n, hv)
            dv = torch.bmm(p3.to(dt).transpose(1, 2), do3)  # [B*n_kv, e, hd], summed over the groups
            dp = torch.bmm(do3, v0[:, :e].transpose(1, 2)).to(acc).view(bsz, nkv, groups, n, e)
            ds = dp.sub_(rd0[..., a:e, :]).mul_(p0)
            del p0, p3
            kept = None
            if dead is not None:
                ds.masked_fill_(dead[..., a:e, :], 0.0)
            ds3 = ds.view(bsz * nkv, groups * n, e).to(dt)
            dqs_blocks.append(torch.bmm(ds3, k0[:, :e]).view(bsz, nkv, groups, n, hd))
            dk = torch.bmm(ds3.transpose(1, 2), q3)
            del ds, ds3
            if len(blocks) == 1:
                dk0, dv0 = dk, dv
            else:
                if dk0 is None:
                    dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
                dk0[:, :e] += dk
                dv0[:, :e] += dv
            del dk, dv
        dqs = dqs_blocks[0] if len(dqs_blocks) == 1 else torch.cat(dqs_blocks, dim=-2)
        del dqs_blocks
        dkeys = [dk0.view(bsz, nkv, seq, hd)]
        dvalues = [dv0.view(bsz, nkv, seq, hv)]
        if n_diag:
            dpd = torch.stack([(dout * vj[:, :, None]).sum(-1) for vj in values[1:]], dim=-1).to(acc)
            dsd = pd * (dpd - rowdot)  # [.., T, k]
            for j in range(n_diag):
                w = dsd[..., j : j + 1].to(dt)
                dqs = dqs + w * keys[1 + j][:, :, None]
                dkeys.append((w * qs).sum(2))
                dvalues.append((pd[..., j : j + 1].to(dt) * dout).sum(2))
        dq = dqs * ctx.scale
        return (dq, None, None, None, None, None, *dkeys, *dvalues)


def _sdpa_attention(
    q: torch.Tensor, cache: TTTCache, attention_mask: torch.Tensor | None, *, scale: float | None = None
) -> torch.Tensor:
    """Same attention as _eager_attention via F.scaled_dot_product_attention over [k0 | k1 | ... | kk]."""
    bsz, nkv, groups, seq, hd = q.shape
    steps = len(cache.keys)
    allowed = _causal_allowed(seq, attention_mask, q.device)
    if allowed.dim() == 2:
        allowed = allowed[None]
    allowed = allowed.clone()
    allowed[..., 0] = True  # no-op for real rows (key 0 is real); avoids NaN rows in all-padding samples
    if steps > 1:
        eye = torch.eye(seq, dtype=torch.bool, device=q.device).expand(allowed.shape[0], seq, seq)
        allowed = torch.cat([allowed, *([eye] * (steps - 1))], dim=-1)  # [B|1, T, steps*T]
    keys = torch.cat(cache.keys, dim=2).repeat_interleave(groups, dim=1)  # [B, heads, steps*T, hd]
    values = torch.cat(cache.values, dim=2).repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.reshape(bsz, nkv * groups, seq, hd), keys, values, attn_mask=allowed[:, None],
        scale=default_scale(hd) if scale is None else float(scale),
    )
    return out.view(bsz, nkv, groups, seq, values.shape[-1])


_COMPILED_FLEX: Any = None


def _flex_kernel(device: torch.device) -> Any:
    """FlexAttention, compiled once on CUDA (its fused kernel); the uncompiled reference elsewhere."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _flex_attention(
    q: torch.Tensor, cache: TTTCache, attention_mask: torch.Tensor | None, *, scale: float | None = None
) -> torch.Tensor:
    """Same attention as _eager_attention via FlexAttention over [k0 | k1 | ... | kk] with the TTT block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    bsz, nkv, groups, seq, hd = q.shape
    if q.requires_grad and q.device.type != "cuda":
        raise ValueError("attention_impl 'flex' trains on CUDA only (FlexAttention has no backward on a CPU); use "
                         "eager or sdpa here")
    steps = len(cache.keys)
    real = (torch.ones(bsz, seq, dtype=torch.bool, device=q.device) if attention_mask is None
            else attention_mask.to(device=q.device, dtype=torch.bool))

    def ttt_mask(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        step, pos = kv_idx // seq, kv_idx % seq
        return ((step == 0) & (pos <= q_idx) & real[b, pos]) | ((step > 0) & (pos == q_idx))

    block_mask = create_block_mask(ttt_mask, bsz, None, seq, steps * seq, device=q.device)
    keys = torch.cat(cache.keys, dim=2)  # [B, n_kv, steps*T, hd]: GQA groups read in place (enable_gqa)
    values = torch.cat(cache.values, dim=2)
    out = _flex_kernel(q.device)(q.reshape(bsz, nkv * groups, seq, hd), keys, values, block_mask=block_mask,
                                 scale=default_scale(hd) if scale is None else float(scale), enable_gqa=groups > 1)
    return out.view(bsz, nkv, groups, seq, values.shape[-1])
