"""KV-cache slot bookkeeping: where each request's tokens live in SGLang's token pool.

``req_to_token[r, j]`` is the pool slot of token ``j`` of the request in row ``r``; ``out_cache_loc`` is a flat
list of freshly allocated slots, request after request. Semantics from SGLang 0.5.23's Triton kernels of the
same names (``sglang/srt/mem_cache/allocation.py``, ``sglang/kernels/ops/speculative/cache_locs.py``,
``sglang/kernels/ops/speculative/eagle.py``, ``sglang/kernels/ops/kvcache/cache_move.py``).
"""

from __future__ import annotations

import ctypes

import torch


def _spans(start: torch.Tensor, end: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, offset into the flat list) per request, offsets being the running sum of lengths."""
    out, offset = [], 0
    for s, e in zip(start.tolist(), end.tolist(), strict=True):
        out.append((int(s), int(e), offset))
        offset += int(e) - int(s)
    return out


def assign_req_to_token_pool(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
                             end_offset: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Scatter: ``req_to_token[rpi[i], start[i]:end[i]] = out_cache_loc[offset_i : offset_i + len_i]``."""
    del pool_len  # the row width, implicit in req_to_token's shape
    for row, (s, e, off) in zip(req_pool_indices.tolist(), _spans(start_offset, end_offset), strict=True):
        req_to_token[int(row), s:e] = out_cache_loc[off:off + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor,
                             end_offset: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Gather, the inverse of :func:`assign_req_to_token_pool`: ``out_cache_loc[...] = req_to_token[rpi[i], s:e]``."""
    del pool_len
    for row, (s, e, off) in zip(req_pool_indices.tolist(), _spans(start_offset, end_offset), strict=True):
        out_cache_loc[off:off + e - s] = req_to_token[int(row), s:e].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                       seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                       topk: int, num_steps: int) -> None:
    """Request ``i``'s ``topk * num_steps`` draft slots, from its ``seq_lens[i]`` on, into block ``i`` of the
    output (branch ``k`` of the tree owns slots ``seq_len + k * num_steps`` onwards)."""
    del pool_len
    n = int(topk) * int(num_steps)
    for i, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[int(row), int(s):int(s) + n].to(out_cache_loc.dtype)


def build_draft_decode_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                                topk: int, num_steps: int, pool_len: int) -> torch.Tensor:
    """A ``[bs * topk, pool_len]`` table for the draft's decode steps: row ``b * topk + k`` is request ``b``'s
    committed prefix followed by branch ``k``'s draft slots (laid out by
    :func:`assign_draft_cache_locs_contiguous`). Entries past ``seq_len + num_steps`` are left zero."""
    topk, num_steps = int(topk), int(num_steps)
    out = torch.zeros((len(seq_lens) * topk, int(pool_len)), dtype=req_to_token.dtype)
    for b, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        s = int(s)
        for k in range(topk):
            out[b * topk + k, :s] = req_to_token[int(row), :s]
            first = s + k * num_steps
            out[b * topk + k, s:s + num_steps] = req_to_token[int(row), first:first + num_steps]
    return out


def fill_bonus_tokens(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                      accept_stride: int) -> None:
    """``bonus_tokens[i]``: the last accepted token of request ``i`` (its row of width ``accept_stride``)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[int(accept_stride) * i + int(n) - 1]


def fill_accept_out_cache_loc(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                              accept_out_cache_loc: torch.Tensor) -> None:
    """Compact: the slots of the accepted draft tokens (``accept_index`` != -1, in order), side by side."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].to(torch.long)
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                            src_loc: torch.Tensor) -> None:
    """For every KV buffer (given by address and row size in bytes): rows ``src_loc`` copied onto rows
    ``tgt_loc``. Every source row is read before any target row is written, so overlapping sets move as a
    whole (SGLang's tiled Triton kernel loads a tile's sources before it stores)."""
    src, tgt = [int(i) for i in src_loc.tolist()], [int(i) for i in tgt_loc.tolist()]
    if len(src) != len(tgt):
        raise ValueError(f"copy_all_layer_kv_cache: {len(src)} source rows for {len(tgt)} target rows")
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        base, stride = int(base), int(stride)
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)
