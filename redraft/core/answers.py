"""Where a stored sample's answers are, where an engine stops in each, and the request it is sent for it.

One rule for every stage that compares with an engine: the offline walk (``eval.engine_walk``), the engine
runs (``eval.online``) and the serving sweep (``serve.tune``) all send or replay exactly these requests, so
their acceptance is about the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from redraft.core.errors import UserError


class AnswersError(UserError):
    """The samples give no request (no answer with a prompt, or no teacher to find the target's argmax)."""


@dataclass
class AnswerRequest:
    """One engine request per stored answer: the ids before it, the stored answer, the engine's budget."""

    id: str  # "<sample_id>#<answer index>"
    sample: int  # dataset index
    prompt: list[int]
    answer: list[int]
    max_tokens: int


def answer_runs(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[(a, e)]: each maximal run of assistant tokens (inclusive), one engine request each.

    A run starting at index 0 has no prompt and is skipped (an engine cannot be asked for it).
    """
    lm = [bool(v) for v in loss_mask.tolist()]
    runs, t = [], 0
    while t < len(lm):
        if lm[t]:
            a = t
            while t + 1 < len(lm) and lm[t + 1]:
                t += 1
            if a > 0:
                runs.append((a, t))
        t += 1
    return runs


def engine_stop(ids: list[int], argmax: list[int], a: int, e: int, max_new_tokens: int | None = None) -> int:
    """Index of the last answer token an engine returns for the answer ``[a, e]`` (rule 4 of ``eval/engine_walk.py``).

    ``e``, unless the stored last token is not the target's argmax (an answer cut at generation and
    closed by the chat template): then ``e - 1``. ``max_new_tokens`` (the engine's max_tokens) caps it.
    """
    stop = e - 1 if e > a and ids[e] != argmax[e - 1] else e
    return stop if not max_new_tokens or max_new_tokens <= 0 else min(stop, a + max_new_tokens - 1)


def sample_argmax(s: Any, lm_head: Any = None) -> list[int]:
    """The target's argmax at every position of a stored sample (top-k teacher, else last hidden x lm_head)."""
    if s.topk_ids is not None:
        lp = s.topk_logprobs.float().masked_fill(s.topk_ids < 0, float("-inf"))
        return s.topk_ids.gather(-1, lp.argmax(-1, keepdim=True)).squeeze(-1).tolist()
    if lm_head is None or s.last_hidden is None:
        raise AnswersError("the dataset stores neither a top-k teacher nor the last hidden state with a target lm_head")
    return (s.last_hidden.float() @ lm_head.float().T).argmax(-1).tolist()


def build_requests(reader: Any, indices: Sequence[int], max_new_tokens: int = 0, lm_head: Any = None) -> list[AnswerRequest]:
    """One request per answer of each sample: the token ids before it, the stored answer, its max_tokens.

    max_tokens follows the walk's stop rule (``eval.engine_engine_stop``): the stored answer's
    length, one less when its last token is not the target's argmax (an answer cut at generation
    and closed by the chat template), or ``max_new_tokens`` when given.
    """
    reqs = []
    for i in indices:
        s = reader.get(i)
        ids = [int(t) for t in s.input_ids.tolist()]
        argmax = sample_argmax(s, lm_head)
        for j, (a, e) in enumerate(answer_runs(s.loss_mask)):
            stop = engine_stop(ids, argmax, a, e, max_new_tokens or None)
            reqs.append(AnswerRequest(id=f"{reader.sample_ids[i]}#{j}", sample=i, prompt=ids[:a], answer=ids[a : stop + 1],
                                max_tokens=stop - a + 1))
    if not reqs:
        raise AnswersError(f"{reader.root}: the selected samples have no answer with a prompt before it")
    return reqs
