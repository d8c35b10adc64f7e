"""Draft vocabulary: the N most frequent loss-masked target tokens, as the engines' d2t/t2d pair.

Conventions (SpecForge/SGLang/vLLM): draft ids are the selected target ids in ascending
order; ``d2t[i] = used[i] - i`` is an offset (target id = draft id + d2t[draft id]) and
``t2d`` is a bool mask over the target vocab. Selection is deterministic: higher count
first, ties to the lower token id, and zero-count ids (ascending) fill any shortfall, so
the same counts always give the same map.
"""

from __future__ import annotations

import torch


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [V]) for the N = min(draft_vocab_size, V) most frequent ids."""
    if counts.dim() != 1:
        raise ValueError(f"build_vocab_mapping: counts must be 1-D [vocab_size], got shape {tuple(counts.shape)}")
    if draft_vocab_size <= 0:
        raise ValueError(f"build_vocab_mapping: draft_vocab_size must be positive, got {draft_vocab_size}")
    if counts.is_floating_point() or counts.is_complex():
        raise ValueError(f"build_vocab_mapping: counts must be integers, got {counts.dtype}")
    counts = counts.to(torch.int64).cpu()
    if counts.numel() and int(counts.min()) < 0:
        bad = int(torch.nonzero(counts < 0)[0])
        raise ValueError(f"build_vocab_mapping: negative count {int(counts[bad])} at token id {bad}")
    vocab_size = counts.numel()
    n = min(draft_vocab_size, vocab_size)
    # stable sort on -count keeps ascending ids within equal counts (zeros included)
    order = torch.sort(-counts, stable=True).indices
    used = torch.sort(order[:n]).values
    d2t = used - torch.arange(n, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless d2t and t2d describe the same ascending, in-range, unique map."""
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise ValueError(f"vocab mapping: d2t and t2d must be 1-D, got {tuple(d2t.shape)} and {tuple(t2d.shape)}")
    if d2t.is_floating_point():
        raise ValueError(f"vocab mapping: d2t must be an integer tensor, got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise ValueError(f"vocab mapping: t2d must be bool, got {t2d.dtype}")
    if t2d.numel() != vocab_size:
        raise ValueError(f"vocab mapping: t2d has {t2d.numel()} entries, vocab_size is {vocab_size}")
    n = d2t.numel()
    if n == 0:
        raise ValueError("vocab mapping: d2t is empty")
    ids = d2t.to(torch.int64).cpu() + torch.arange(n, dtype=torch.int64)
    out = (ids < 0) | (ids >= vocab_size)
    if bool(out.any()):
        i = int(torch.nonzero(out)[0])
        raise ValueError(f"vocab mapping: draft id {i} maps to target id {int(ids[i])}, outside [0, {vocab_size})")
    if n > 1:
        steps = ids[1:] - ids[:-1]
        if bool((steps <= 0).any()):
            i = int(torch.nonzero(steps <= 0)[0])
            raise ValueError(
                f"vocab mapping: target ids must be strictly increasing (unique, ascending); draft ids {i} and "
                f"{i + 1} map to {int(ids[i])} and {int(ids[i + 1])}"
            )
    t2d_cpu = t2d.cpu()
    n_t2d = int(t2d_cpu.sum())
    if n_t2d != n:
        raise ValueError(f"vocab mapping: t2d selects {n_t2d} tokens but d2t has {n}")
    not_marked = ~t2d_cpu[ids]
    if bool(not_marked.any()):
        i = int(torch.nonzero(not_marked)[0])
        raise ValueError(f"vocab mapping: draft id {i} maps to target id {int(ids[i])}, which t2d does not select")


def draft_token_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocab, in draft order: arange(N) + d2t."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)


def shared_draft_rows(old_d2t: torch.Tensor, new_d2t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(new draft ids, old draft ids) of the target tokens both draft vocabularies hold, in new draft order.

    A warm start that rebuilds the vocabulary moves the old lm_head row of each such token to its
    new draft id (:mod:`train.warm_start`); both maps are ascending, so this is one sorted lookup.
    """
    old_ids, new_ids = draft_token_ids(old_d2t.cpu()), draft_token_ids(new_d2t.cpu())
    pos = torch.searchsorted(old_ids, new_ids).clamp(max=old_ids.numel() - 1)
    hit = old_ids[pos] == new_ids
    return torch.nonzero(hit).flatten(), pos[hit]
