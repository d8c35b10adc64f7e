"""The teacher as the drafter's loss and the acceptance check see it: draft-vocab targets from a dataset.

A dataset stores the target's next-token distribution either as top-k log-probabilities or as
the post-norm last hidden state (the lm_head is applied here, in chunks). Both become
:class:`TeacherTargets` in RAW alignment (row t predicts token t+1): the full-vocab argmax (what
the target's greedy verification compares against) and the distribution on the draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from redraft.core.drafter.vocab import draft_token_ids

# t2d tensor -> (its version, device, nonzero(t2d) there): nonzero is a host sync on GPUs, and the
# training loop calls teacher_from_last_hidden with the same t2d buffer every step.
_DRAFT_COLUMNS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass
class TeacherTargets:
    """Teacher rows in raw alignment (row t predicts token t+1), restricted to the draft vocab."""

    target_p: torch.Tensor  # [B, T, Vd] teacher distribution renormalised over the draft vocab (0 rows: no mass)
    target_ids: torch.Tensor  # [B, T] int64 teacher full-vocab argmax of row t
    p_on_draft: torch.Tensor | None = None  # [B, T, Vd] unrenormalised teacher prob on draft tokens


def topk_argmax(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [...]: the stored id with the highest log-prob among the valid ones (0 <= id < vocab_size).

    It is the full-vocab argmax, because the top-k hold the largest entries (k >= 1); negative
    padding ids and ids outside the vocab are never chosen.
    """
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab_size)
    best = topk_logprobs.float().masked_fill(~valid, float("-inf")).argmax(-1, keepdim=True)
    return ids.gather(-1, best).squeeze(-1)


def teacher_from_topk(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, t2d: torch.Tensor, d2t: torch.Tensor
) -> TeacherTargets:
    """Dense draft-vocab teacher from top-k log-probs [B, T, K] (exp scattered onto draft ids).

    The argmax is taken over the top-k entries (it is the full-vocab argmax when k >= 1); ids
    outside the draft vocab (or negative padding ids) only lose their mass.
    """
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError(f"teacher_from_topk: ids {tuple(topk_ids.shape)} vs logprobs {tuple(topk_logprobs.shape)}")
    vocab = t2d.numel()
    n_draft = d2t.numel()
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    t_to_d = torch.full((vocab,), -1, dtype=torch.int64, device=ids.device)
    t_to_d[draft_token_ids(d2t).to(ids.device)] = torch.arange(n_draft, device=ids.device)
    didx = torch.where(valid, t_to_d[ids.clamp(0, vocab - 1)], torch.full_like(ids, -1))
    keep = didx >= 0
    probs = torch.where(keep, topk_logprobs.float().exp(), torch.zeros((), device=ids.device))
    # renormalise the K kept entries, then scatter: no pass over [B, T, Vd] besides the two fills + scatters
    mass = probs.sum(-1, keepdim=True)
    renorm = torch.where(mass > 0, probs / mass.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(probs))
    index = didx.clamp(min=0)
    dense = (*ids.shape[:-1], n_draft)
    p_on_draft = torch.zeros(dense, dtype=torch.float32, device=ids.device).scatter_add_(-1, index, probs)
    target_p = torch.zeros(dense, dtype=torch.float32, device=ids.device).scatter_add_(-1, index, renorm)
    target_ids = topk_argmax(ids, topk_logprobs, vocab)
    return TeacherTargets(target_p=target_p, target_ids=target_ids, p_on_draft=p_on_draft)


@torch.no_grad()
def teacher_from_last_hidden(
    last_hidden: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor, chunk_tokens: int = 512
) -> TeacherTargets:
    """Teacher from the target's post-final-norm hidden [B, T, H] and its lm_head [V, H].

    Logits exist for at most ``chunk_tokens`` tokens at a time (the matmul runs in the
    head's dtype, like the target); only the draft columns, the logsumexp and the argmax
    are kept.
    """
    if chunk_tokens < 1:
        raise ValueError(f"teacher_from_last_hidden: chunk_tokens must be >= 1, got {chunk_tokens}")
    if last_hidden.shape[-1] != lm_head_weight.shape[1] or lm_head_weight.shape[0] != t2d.numel():
        raise ValueError(
            f"teacher_from_last_hidden: last_hidden {tuple(last_hidden.shape)}, lm_head {tuple(lm_head_weight.shape)} "
            f"and t2d [{t2d.numel()}] do not fit together"
        )
    lead = last_hidden.shape[:-1]
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    device = lm_head_weight.device
    cols = _draft_columns(t2d, device)
    n_tok, n_draft = flat.shape[0], cols.numel()
    target_p = torch.empty((n_tok, n_draft), dtype=torch.float32, device=device)
    p_on_draft = torch.empty((n_tok, n_draft), dtype=torch.float32, device=device)
    target_ids = torch.empty((n_tok,), dtype=torch.int64, device=device)
    for start in range(0, n_tok, chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        logits = (flat[sl].to(device=device, dtype=lm_head_weight.dtype) @ lm_head_weight.T).float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        target_ids[sl] = logits.argmax(-1)
        draft_logits = logits[:, cols]
        del logits
        p_on_draft[sl] = torch.exp(draft_logits - lse)
        target_p[sl] = torch.softmax(draft_logits, dim=-1)
    return TeacherTargets(
        target_p=target_p.view(*lead, n_draft),
        target_ids=target_ids.view(*lead),
        p_on_draft=p_on_draft.view(*lead, n_draft),
    )


def _draft_columns(t2d: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Target ids of the draft vocab (ascending) on ``device``, cached while t2d is unchanged in place."""
    try:
        version = t2d._version
    except RuntimeError:  # inference tensors carry no version counter: do not cache
        return torch.nonzero(t2d.to(device)).squeeze(-1)
    hit = _DRAFT_COLUMNS.get(t2d)
    if hit is not None and hit[0] == version and hit[1] == device:
        return hit[2]
    cols = torch.nonzero(t2d.to(device)).squeeze(-1)
    _DRAFT_COLUMNS[t2d] = (version, device, cols)
    return cols
