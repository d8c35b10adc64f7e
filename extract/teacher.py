"""The target's next-token distribution, kept as top-k log-probabilities.

Full-vocab logits for a long sample are huge (Kimi-K2.5: 163840 x 4 bytes per token), so they are
computed for at most ``chunk_tokens`` rows at a time and reduced to top-k right away.
"""

from __future__ import annotations

import torch

from extract.timing import span


@torch.inference_mode()
def chunked_topk_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    k: int,
    chunk_tokens: int = 512,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``log_softmax(hidden @ W.T + b)`` over the full vocabulary, in float32.

    hidden: [N, H] post-final-norm states; lm_head_weight: [V, H]. Returns (ids int64 [N, k],
    logprobs float32 [N, k] descending), on hidden's device. The weight is cast to float32 once per
    call, so logits are exact fp32 even for a bf16 target.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"lm_head weight {tuple(lm_head_weight.shape)} does not match hidden size {hidden.shape[1]}"
        )
    vocab = lm_head_weight.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k must be in [1, {vocab}] (the vocabulary size), got {k}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

    n = hidden.shape[0]
    weight = lm_head_weight.to(device=hidden.device, dtype=torch.float32)
    bias = None if lm_head_bias is None else lm_head_bias.to(device=hidden.device, dtype=torch.float32)
    ids = torch.empty((n, k), dtype=torch.int64, device=hidden.device)
    logprobs = torch.empty((n, k), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk_tokens):
        stop = min(start + chunk_tokens, n)
        logits = torch.nn.functional.linear(hidden[start:stop].to(torch.float32), weight, bias)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        top = torch.topk(logits, k, dim=-1, largest=True, sorted=True)
        ids[start:stop] = top.indices
        logprobs[start:stop] = top.values - lse
        del logits, lse, top
    return ids, logprobs


def topk_per_sequence(
    final: torch.Tensor, lengths: list[int], lm_head_weight: torch.Tensor, k: int, chunk_tokens: int = 512,
    lm_head_bias: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The top-k teacher of a batch's real tokens (``final``: [sum of lengths, H], post-norm), one matmul for the
    batch, split back into per-sequence (ids, logprobs) on the CPU. Timed as the stage's ``teacher`` part."""
    with span("teacher"):
        ids, lps = chunked_topk_logprobs(final, lm_head_weight, k, chunk_tokens, lm_head_bias=lm_head_bias)
        return list(ids.cpu().split(lengths)), list(lps.cpu().split(lengths))
