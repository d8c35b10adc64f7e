"""The SGLang CPU stand-in's extend attention in blocks of query rows equals it in one block (causal with a cached
prefix, and through a draft tree's mask): the blocks exist for memory (MLA prefill at 32K built [heads, T, T]
scores), not to change a number. SGLang's own kernels are compared in tests/engine/sglang/test_sglang_cpu_ops.py."""

from __future__ import annotations

import pytest
import torch

from redraft.engines.sglang_cpu.ops import attention


def _case(tree: bool) -> dict:
    torch.manual_seed(0)
    heads, dim, vdim, prefix, new = 2, 24, 16, 5, 11  # MLA-like: the value narrower than the query and key
    total = prefix + new
    pool_k, pool_v = torch.randn(64, 1, dim), torch.randn(64, 1, vdim)
    slots = torch.randperm(64)[:total]
    req_to_token = torch.zeros(1, 64, dtype=torch.long)
    req_to_token[0, :total] = slots
    mask = (torch.rand(new, new) > 0.4) | torch.eye(new, dtype=torch.bool) if tree else None
    return dict(q=torch.randn(new, heads, dim), k=torch.randn(new, 1, dim), v=torch.randn(new, 1, vdim),
                o=torch.zeros(new, heads, vdim), k_buffer=pool_k, v_buffer=pool_v, k_scale=1.0, v_scale=1.0,
                req_to_token=req_to_token, req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([total]),
                extend_seq_lens=torch.tensor([new]), extend_start_loc=torch.tensor([0]), max_extend_len=new,
                sm_scale=dim ** -0.5, logit_cap=0.0, is_cross=False, sliding_window=0, encoder_lens=None, sinks=None,
                tree_mask=None if mask is None else mask.reshape(-1), is_causal=True)


@pytest.mark.parametrize("tree", [False, True])
def test_blocks_of_query_rows_equal_one_block(monkeypatch, tree):
    whole, blocked = _case(tree), _case(tree)
    attention.extend_attention(**whole)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 3)
    attention.extend_attention(**blocked)
    torch.testing.assert_close(blocked["o"], whole["o"], rtol=1e-6, atol=1e-6)
    if not tree:  # and what one row sees: its prefix and the new rows up to itself
        keys = torch.cat([whole["k_buffer"][whole["req_to_token"][0, :5]], whole["k"]])
        values = torch.cat([whole["v_buffer"][whole["req_to_token"][0, :5]], whole["v"]])
        row = 7
        scores = (whole["q"][row] @ keys[: 5 + row + 1, 0].T) * whole["sm_scale"]
        want = torch.softmax(scores, dim=-1) @ values[: 5 + row + 1, 0]
        torch.testing.assert_close(whole["o"][row], want, rtol=1e-5, atol=1e-6)
