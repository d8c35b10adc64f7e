"""Chunked top-k teacher: equals the full-logits computation and never builds more than chunk_tokens rows."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from extract.teacher import chunked_topk_logprobs

N, H, V, K = 37, 24, 300, 8


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, generator=g)


def _full(hidden, weight, bias, k):
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    logp = torch.log_softmax(logits, dim=-1)
    return logp, torch.topk(logp, k, dim=-1)


@pytest.mark.parametrize("chunk", [1, 7, N, 512])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_full_log_softmax(data, chunk, with_bias):
    hidden, weight, bias = data
    bias = bias if with_bias else None
    ids, lps = chunked_topk_logprobs(hidden, weight, K, chunk_tokens=chunk, lm_head_bias=bias)
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32
    assert ids.shape == (N, K) and lps.shape == (N, K)
    logp, top = _full(hidden, weight, bias, K)
    torch.testing.assert_close(lps.double(), top.values, atol=1e-4, rtol=0)
    # The returned ids carry the returned log-probabilities (robust to near-ties in the ordering).
    torch.testing.assert_close(logp.gather(1, ids), lps.double(), atol=1e-4, rtol=0)
    assert torch.all(lps[:, :-1] >= lps[:, 1:])  # descending
    assert torch.all(lps <= 0)


def test_chunk_sizes_agree(data):
    hidden, weight, _ = data
    results = [chunked_topk_logprobs(hidden, weight, K, chunk_tokens=c) for c in (1, 7, N)]
    for ids, lps in results[1:]:
        torch.testing.assert_close(lps, results[0][1], atol=1e-5, rtol=0)
        assert torch.equal(ids, results[0][0])


def test_bf16_weight_is_computed_in_fp32(data):
    hidden, weight, _ = data
    w16 = weight.to(torch.bfloat16)
    ids, lps = chunked_topk_logprobs(hidden.to(torch.bfloat16), w16, K, chunk_tokens=5)
    assert lps.dtype == torch.float32
    _, top = _full(hidden.to(torch.bfloat16).float(), w16.float(), None, K)
    torch.testing.assert_close(lps.double(), top.values, atol=1e-4, rtol=0)


class _LargestVocabTensor(TorchFunctionMode):
    """Records the most rows of any tensor with a vocab-sized last dimension that a torch op produced."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.max_rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == self.vocab:
                self.max_rows = max(self.max_rows, t.shape[0])
        return out


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_logits_never_exceed_chunk_rows(data, chunk):
    hidden, weight, _ = data
    with _LargestVocabTensor(V) as probe:
        chunked_topk_logprobs(hidden, weight, K, chunk_tokens=chunk)
    assert probe.max_rows == chunk  # the weight itself is [V, H], so only logits count here


def test_rejects_bad_arguments(data):
    hidden, weight, _ = data
    with pytest.raises(ValueError, match="top-k"):
        chunked_topk_logprobs(hidden, weight, V + 1)
    with pytest.raises(ValueError, match="hidden size"):
        chunked_topk_logprobs(hidden[:, :-1], weight, K)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_topk_logprobs(hidden, weight, K, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        chunked_topk_logprobs(hidden[None], weight, K)
