"""Paged attention for SGLang 0.5.23's ``intel_amx`` attention backend, in plain PyTorch.

The backend (``sglang/srt/layers/attention/intel_amx_backend.py``) is SGLang's own CPU attention path, the one
that serves EAGLE on CPUs; it calls two ops, written here with their argument lists as that backend passes
them:

- :func:`extend_attention`: new tokens (a prefill, a chunk, or the draft tokens under verification) attend to
  the request's cached prefix in the KV pool and causally to each other, or, while verifying a draft *tree*,
  through the tree's mask;
- :func:`decode_attention`: one new token per request writes its key/value into the pool and attends to the
  whole request.

The semantics are those of SGLang's Triton ``extend_attention_fwd`` and ``decode_attention_fwd``
(``sglang/kernels/ops/attention/``), which the tests run beside these. MLA needs no case of its own: its
absorbed form is multi-query attention with one 576-wide key head whose first 512 columns are the value
(``v_buffer`` is a view into ``k_buffer``). What SGLang's compiled kernel does and this does not: fp32 here
(the compiled kernel takes bf16/fp16 only), and no sliding window, attention sinks or cross-attention (refused
by name: none of redraft's targets use them).
"""

from __future__ import annotations

import torch

# Query rows attended at a time: scores of [heads, block, keys], not [heads, T, T] (torch's CPU attention builds the
# whole score matrix when the query and value widths differ, as MLA's prefill's do: 8 GiB at 32K tokens).
QUERY_BLOCK = 2048


def _refuse_unsupported(op: str, *, sliding_window: int, is_cross: bool, sinks: torch.Tensor | None,
                        encoder_lens: torch.Tensor | None) -> None:
    if int(sliding_window) > 0:
        raise NotImplementedError(f"{op}: sliding-window attention is not in redraft's CPU stand-in")
    if is_cross or encoder_lens is not None:
        raise NotImplementedError(f"{op}: cross-attention (encoder_lens) is not in redraft's CPU stand-in")
    if sinks is not None:
        raise NotImplementedError(f"{op}: attention sinks are not in redraft's CPU stand-in")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, sm_scale: float,
            logit_cap: float) -> torch.Tensor:
    """q [M, H, D], k [N, Hkv, D], v [N, Hkv, Dv], visible [M, N] bool or None -> [M, H, Dv], in fp32.

    Grouped heads read their key/value head without copying it (``enable_gqa``); a logit cap (tanh of the
    scores, Gemma-style) needs the scores themselves, so it takes the explicit path."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, tokens, dim]
    if logit_cap <= 0:
        out = torch.nn.functional.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=visible, scale=float(sm_scale), enable_gqa=heads != kv_heads)
        return out[0].transpose(0, 1)
    group = heads // kv_heads
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * float(sm_scale)
    scores = float(logit_cap) * torch.tanh(scores / float(logit_cap))
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf)[0].transpose(0, 1)


def _cached(buffer: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    rows = buffer[slots.long()]
    return rows.float() * scale if scale != 1.0 else rows


def _tree_mask_rows(tree_mask: torch.Tensor | None, seq_lens: torch.Tensor,
                    extend_seq_lens: torch.Tensor) -> list[torch.Tensor] | None:
    """Each request's ``[extend, seq_len]`` visibility from SGLang's flattened tree mask (requests one after
    another, rows row-major), in either of the layouts SGLang builds (``TreeMaskMode``): QLEN_ONLY, what its
    CPU path uses, covers the new tokens only (``[extend, extend]``; the cached prefix is visible to all);
    FULL_MASK covers every column. Which one is told by the mask's size."""
    if tree_mask is None:
        return None
    flat = tree_mask.reshape(-1).bool()
    totals, news = [int(t) for t in seq_lens.tolist()], [int(n) for n in extend_seq_lens.tolist()]
    qlen_only = flat.numel() == sum(n * n for n in news)
    if not qlen_only and flat.numel() != sum(n * t for n, t in zip(news, totals, strict=True)):
        raise ValueError(f"extend_attention: a tree mask of {flat.numel()} entries fits neither layout for "
                         f"extend lengths {news} and sequence lengths {totals}")
    rows, at = [], 0
    for new, total in zip(news, totals, strict=True):
        width = new if qlen_only else total
        block = flat[at:at + new * width].view(new, width)
        at += new * width
        if qlen_only:
            block = torch.cat([torch.ones((new, total - new), dtype=torch.bool), block], dim=1)
        rows.append(block)
    return rows


def extend_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, o: torch.Tensor,
                     k_buffer: torch.Tensor, v_buffer: torch.Tensor, k_scale: float, v_scale: float,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_extend_len: int | None,
                     sm_scale: float, logit_cap: float, is_cross: bool, sliding_window: int,
                     encoder_lens: torch.Tensor | None, sinks: torch.Tensor | None, tree_mask: torch.Tensor | None,
                     is_causal: bool) -> None:
    """Request ``b``'s ``extend_seq_lens[b]`` query rows (from ``extend_start_loc[b]``) attend to its
    ``seq_lens[b] - extend_seq_lens[b]`` cached tokens (``req_to_token``) and to the new keys ``k``/``v``
    (``k_buffer``/``v_buffer`` at those rows when ``k`` is None). Writes ``o`` in place.

    ``tree_mask``: the draft tree's visibility (:func:`_tree_mask_rows`); without one, new tokens see each
    other causally.
    """
    del max_extend_len  # a launch-size hint of the compiled kernel
    _refuse_unsupported("extend_attention", sliding_window=sliding_window, is_cross=is_cross, sinks=sinks,
                        encoder_lens=encoder_lens)
    mask_rows = _tree_mask_rows(tree_mask, seq_lens, extend_seq_lens)
    for b, row in enumerate(req_pool_indices.tolist()):
        total, new, start = int(seq_lens[b]), int(extend_seq_lens[b]), int(extend_start_loc[b])
        prefix = total - new
        slots = req_to_token[int(row), :total]
        if k is None or v is None:
            keys, values = _cached(k_buffer, slots, k_scale), _cached(v_buffer, slots, v_scale)
        elif prefix == 0:  # nothing cached: the new keys alone (MLA's prefill passes per-head k/v of other widths)
            keys, values = k[start:start + new], v[start:start + new]
        else:
            keys = torch.cat([_cached(k_buffer, slots[:prefix], k_scale).to(k.dtype), k[start:start + new]])
            values = torch.cat([_cached(v_buffer, slots[:prefix], v_scale).to(v.dtype), v[start:start + new]])
        for first in range(0, new, QUERY_BLOCK):
            last = min(new, first + QUERY_BLOCK)
            seen = prefix + last if mask_rows is None and is_causal else total  # the keys these rows may see
            if mask_rows is not None:
                visible = mask_rows[b][first:last]
            elif is_causal:
                visible = torch.ones((last - first, seen), dtype=torch.bool).tril(diagonal=prefix + first)
            else:
                visible = None
            out = _attend(q[start + first:start + last], keys[:seen], values[:seen], visible, sm_scale, logit_cap)
            o[start + first:start + last] = out.to(o.dtype)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, k_scale: float,
                     v_scale: float, o: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                     loc: torch.Tensor, attn_logits: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, logit_cap: float,
                     is_cross: bool, sliding_window: int, encoder_lens: torch.Tensor | None,
                     sinks: torch.Tensor | None) -> None:
    """One query row per request: first ``k``/``v`` (when given) are written to pool slots ``loc``, then row
    ``b`` attends to the request's ``seq_lens[b]`` tokens in the pool. Writes ``o`` in place.
    (``attn_logits`` is the compiled kernel's split-K scratch space; nothing reads it afterwards.)"""
    del attn_logits
    _refuse_unsupported("decode_attention", sliding_window=sliding_window, is_cross=is_cross, sinks=sinks,
                        encoder_lens=encoder_lens)
    if k is not None and v is not None:
        where = loc.long()
        k_buffer[where] = k.to(k_buffer.dtype)
        v_buffer[where] = v.to(v_buffer.dtype)
    for b, row in enumerate(req_pool_indices.tolist()):
        slots = req_to_token[int(row), :int(seq_lens[b])]
        keys, values = _cached(k_buffer, slots, k_scale), _cached(v_buffer, slots, v_scale)
        o[b:b + 1] = _attend(q[b:b + 1], keys, values, None, sm_scale, logit_cap).to(o.dtype)
