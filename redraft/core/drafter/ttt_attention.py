"""Attention inside a training-time-test (TTT) unroll: a cache of each step's keys and its kernels.

The first step's keys are attended causally (plus key padding); every later step adds only its
own same-position ("diagonal") key. That is also the pattern of chain drafting in an engine (the
drafter's keys for positions <= t come from the target's features, the later ones are its own),
so training and offline evaluation share this code. Three implementations of the same math, each
with memory linear in the sequence length T (no [T, T] tensor anywhere: Kimi-K2.5's conversations
run to 64K tokens and more, where one [T, T] fp32 mask is 16 GiB):

- ``eager``: a hand-written autograd kernel over blocks of query rows, each block masked as it is
  scored; the reference numerics and the CPU default.
- ``sdpa``: torch SDPA, causal with no mask tensor (its fused flash kernels on CUDA and CPU), the
  diagonal keys joined through one extra key every query sees (see ``_sdpa_attention``); it reads
  key padding as right padding, which is how every batch here is built.
- ``flex``: FlexAttention with the TTT pattern as a block mask (compiled on CUDA, fused forward and
  backward; on a CPU forward only, for tests).
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
    # sdpa: the step-0 keys and values with the joining key in front, built once per unroll (they do not change),
    # and the attention mask whose right padding was checked (one host sync per unroll, not per step)
    sdpa_step0: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    sdpa_checked_mask: Any = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)


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


def _real_keys(attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """bool [B, T], True for a real token; None when every token is real."""
    return None if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)


def _block_allowed(a: int, e: int, real: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """bool [B|1, 1, 1, e - a, e]: query row i in [a, e) may see step-0 key j iff j <= i and j is real.
    Built per block of rows as it is scored, so no [T, T] mask exists."""
    allowed = torch.arange(e, device=device)[None, :] <= torch.arange(a, e, device=device)[:, None]
    if real is not None:
        return (allowed[None] & real[:, None, :e])[:, None, None]
    return allowed[None, None, None]


def _dead_rows(real: torch.Tensor | None) -> torch.Tensor | None:
    """bool [B, 1, 1, T, 1]: query rows with no real step-0 key at or before them (None without padding)."""
    return None if real is None else (real.cumsum(-1) == 0)[:, None, None, :, None]


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
    real = _real_keys(attention_mask, q.device)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return _TTTAttention.apply(q, real, len(cache.keys) - 1, rows, scale, *cache.keys, *cache.values)


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
    def forward(ctx, q, real, n_diag, block_rows, scale, *kv):  # type: ignore[override]
        bsz, nkv, groups, seq, hd = q.shape
        keys, values = kv[: n_diag + 1], kv[n_diag + 1:]
        hv = values[0].shape[-1]
        dt, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
        qs = q * scale
        k0 = keys[0].reshape(bsz * nkv, seq, hd)
        v0 = values[0].reshape(bsz * nkv, seq, hv)
        blocks = _blocks(seq, block_rows)
        outs, lses = [], []
        kept = None
        for a, e in blocks:
            n = e - a
            s0 = torch.bmm(qs[..., a:e, :].reshape(bsz * nkv, groups * n, hd), k0[:, :e].transpose(1, 2))
            s0 = s0.view(bsz, nkv, groups, n, e).to(acc)
            s0.masked_fill_(~_block_allowed(a, e, real, q.device), torch.finfo(acc).min)
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
        ctx.dead = _dead_rows(real) if n_diag == 0 else None  # with diagonal keys no row is empty
        ctx.real = real
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
        real, dead = ctx.real, ctx.dead
        bsz, nkv, groups, seq, hd = qs.shape
        dt, acc = qs.dtype, torch.promote_types(qs.dtype, torch.float32)
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
                p0 = torch.softmax(s0.masked_fill_(~_block_allowed(a, e, real, qs.device), torch.finfo(acc).min), -1)
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
        return (dq, None, None, None, None, *dkeys, *dvalues)


def _sdpa_attention(
    q: torch.Tensor, cache: TTTCache, attention_mask: torch.Tensor | None, *, scale: float | None = None
) -> torch.Tensor:
    """Same attention as _eager_attention through one causal F.scaled_dot_product_attention, no mask tensor.

    The diagonal keys are joined through one extra "joining" key placed before the step-0 keys (with
    one extra query row in front, so that the square causal pattern still lets query i see keys 0..i).
    The joining key scores lse_i = logsumexp_j(q_i . k_j[i] * scale) for each query (two extra
    head-dimension coordinates: lse_i / scale on the query side, 1 on the key side, 0 on every real
    key) and its value is the unit vector of one extra value column. The kernel's own softmax then
    gives the step-0 keys their share of the joint softmax, and the extra column the diagonal keys'
    share u_i; the diagonal keys' output is u_i * sum_j softmax_j * v_j[i], all [T]-sized.
    Queries, keys and values are padded to one head width, a multiple of 8, so that the fused kernels
    run (not the math path, which builds [T, T] scores).

    Key padding is read as right padding: a real query row sees only real keys at or before it, and
    a padded row (ignored by every loss and walk) stays finite. A mask with a hole is refused.
    """
    bsz, nkv, groups, seq, hd = q.shape
    scale = default_scale(hd) if scale is None else float(scale)
    if attention_mask is not None and cache.sdpa_checked_mask is not attention_mask:
        if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("attention_impl 'sdpa' reads key padding as right padding; this batch's attention_mask "
                             "has a real token after a padded one (use eager)")
        cache.sdpa_checked_mask = attention_mask
    n_diag = len(cache.keys) - 1
    hv = cache.values[0].shape[-1]
    if n_diag == 0:
        width = _round8(max(hd, hv))  # one width for q, k and v (MLA's values are narrower than its keys)
        keys = F.pad(cache.keys[0], (0, width - hd)).repeat_interleave(groups, dim=1)  # [B, heads, T, width]
        values = F.pad(cache.values[0], (0, width - hv)).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(F.pad(q, (0, width - hd)).reshape(bsz, nkv * groups, seq, width), keys,
                                             values, is_causal=True, scale=scale)
        return out[..., :hv].reshape(bsz, nkv, groups, seq, hv)
    width = _round8(max(hd + 2, hv + 1))  # the joining coordinates (keys) and column (values) included
    if cache.sdpa_step0 is None:
        k0 = F.pad(cache.keys[0], (0, width - hd, 1, 0))  # [B, n_kv, 1 + T, width], the joining key first
        k0[:, :, 0, hd : hd + 2] = 1.0
        v0 = F.pad(cache.values[0], (0, width - hv, 1, 0))
        v0[:, :, 0, hv] = 1.0
        cache.sdpa_step0 = (k0.repeat_interleave(groups, dim=1), v0.repeat_interleave(groups, dim=1))
    keys, values = cache.sdpa_step0
    diag = torch.stack([(q * kj[:, :, None]).sum(-1) for kj in cache.keys[1:]], dim=-1) * scale  # [.., T, k]
    lse = torch.logsumexp(diag.to(torch.promote_types(q.dtype, torch.float32)), dim=-1)
    # lse / scale as two numbers of q's dtype (high part + rest): in bf16 one alone carries 8 bits of mantissa, so the
    # split between step-0 and diagonal keys would move by up to ~0.2% of lse (about 1% at lse = 5)
    joint = lse.to(torch.promote_types(q.dtype, torch.float32)) / scale
    high = joint.to(q.dtype)
    low = (joint - high).to(q.dtype)
    qx = F.pad(torch.cat((q, high[..., None], low[..., None]), dim=-1), (0, width - hd - 2, 1, 0))  # [.., 1 + T, w]
    out = F.scaled_dot_product_attention(qx.reshape(bsz, nkv * groups, seq + 1, width), keys, values,
                                         is_causal=True, scale=scale)[:, :, 1:]
    out = out.reshape(bsz, nkv, groups, seq, width)
    share = out[..., hv : hv + 1]  # the diagonal keys' share of the joint softmax
    probs = torch.softmax(diag, dim=-1)
    vdiag = sum(probs[..., j : j + 1] * vj[:, :, None] for j, vj in enumerate(cache.values[1:]))
    return out[..., :hv] + share * vdiag


def _round8(n: int) -> int:
    return -(-n // 8) * 8


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
