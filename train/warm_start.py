"""Warm start (``--init-from``): load an old drafter into a new run, its draft vocabulary rebuilt or kept.

The draft vocabulary is the N most frequent tokens of the training data (redraft.core.drafter.vocab). A
drafter retrained on other data (another target's replies, a new domain) would keep a vocabulary
fitted to the old data, so by default the warm start rebuilds it from the new data exactly as a
scratch run does (same counts, same N) and moves the old lm_head rows it can reuse:

* a draft token that was in the old vocabulary gets the old lm_head row of that target token;
* a new draft token keeps the row a scratch run gives it (nn.Linear's init under the run's seed).
  The target's own lm_head is not used: it reads the target's last hidden state, while the
  drafter's lm_head reads its own norm(h2), a space learnt only through the draft logits.

Everything else (fc, midlayer, norm) loads unchanged. ``keep`` loads the old vocabulary and
lm_head as they are (the behaviour before the rebuild existed; it needs the same N).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from redraft.core.drafter.folder import CheckpointError
from redraft.core.drafter.modeling import Eagle3Drafter
from redraft.core.drafter.vocab import build_vocab_mapping, check_vocab_mapping, shared_draft_rows

log = logging.getLogger(__name__)

WARM_START_VOCAB = ("rebuild", "keep")
HEAD_KEY = "lm_head.weight"


def warm_start(
    drafter: Eagle3Drafter,
    init_state: Mapping[str, torch.Tensor],
    counts: torch.Tensor,
    mode: str,
    source: str,
) -> dict[str, Any]:
    """Load ``init_state`` (serving weights of the old drafter) into ``drafter``; returns what was done.

    ``drafter`` is freshly built for this run (its lm_head holds the scratch init); ``counts`` are
    the new data's loss-masked token counts. The returned dict goes into the checkpoint record.
    """
    if mode not in WARM_START_VOCAB:
        raise ValueError(f"warm_start_vocab must be one of {WARM_START_VOCAB}, got {mode!r}")
    old_d2t = init_state.get("d2t")
    old_n = int(init_state[HEAD_KEY].shape[0]) if HEAD_KEY in init_state else None
    if mode == "keep":
        drafter.load_serving_state_dict(init_state)
        log.info("warm start from %s: kept its draft vocabulary and lm_head (%d tokens)", source, old_n or 0)
        return {"source": source, "vocab": "keep", "draft_vocab_size": drafter.config.draft_vocab_size,
                "old_draft_vocab_size": old_n}
    if old_d2t is None or HEAD_KEY not in init_state:
        missing = [k for k in ("d2t", HEAD_KEY) if k not in init_state]
        raise CheckpointError(f"--init-from {source}: {missing} missing from model.safetensors; the draft vocabulary "
                              "cannot be rebuilt without the old d2t and lm_head")
    old_head = init_state[HEAD_KEY]
    if old_d2t.dim() != 1 or old_d2t.numel() != old_head.shape[0]:
        raise CheckpointError(f"--init-from {source}: d2t has shape {tuple(old_d2t.shape)} but lm_head.weight has "
                              f"{old_head.shape[0]} rows")
    try:
        check_vocab_mapping(old_d2t, init_state.get("t2d", _mask(old_d2t, drafter.config.vocab_size)),
                            drafter.config.vocab_size)
    except ValueError as e:
        raise CheckpointError(f"--init-from {source}: {e}") from e
    d2t, t2d = build_vocab_mapping(counts, drafter.config.draft_vocab_size)
    new_rows, old_rows = shared_draft_rows(old_d2t, d2t)
    head = drafter.lm_head.weight.detach().to("cpu", copy=True)  # the scratch init, kept for new tokens
    if tuple(old_head.shape[1:]) != tuple(head.shape[1:]):
        raise CheckpointError(f"--init-from {source}: lm_head.weight is {tuple(old_head.shape)}, this run's drafter "
                              f"needs rows of width {head.shape[1]}")
    head[new_rows] = old_head[old_rows].to(head.dtype)
    drafter.load_serving_state_dict({**init_state, HEAD_KEY: head, "d2t": d2t, "t2d": t2d})
    n, kept = d2t.numel(), new_rows.numel()
    info = {"source": source, "vocab": "rebuild", "draft_vocab_size": n, "old_draft_vocab_size": old_n,
            "kept_rows": kept, "new_rows": n - kept, "dropped_rows": old_n - kept}
    log.info("warm start from %s: draft vocabulary rebuilt from the new data: %d of %d lm_head rows kept from the "
             "old drafter, %d new (scratch init), %d old tokens dropped", source, kept, n, n - kept, old_n - kept)
    return info


def _mask(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d of a d2t (foreign folders may ship d2t without t2d: the engines drop it)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64).cpu()
    t2d[ids.clamp(0, vocab_size - 1)] = True
    return t2d
