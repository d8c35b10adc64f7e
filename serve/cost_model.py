"""The speed-up each speculative setting should give, from offline acceptance and a few measured step costs.

Why a model: on a cluster every server start of a Kimi-sized target takes minutes, and a full sweep (every
setting x every concurrency x repeats) takes hours. The model needs two things only:

- tau(k), the tokens per verify round of a chain of k drafts, from ``eval.acceptance`` (offline, no engine);
- the cost of an engine step at each concurrency c, measured in short *probes*: the base server (one target
  step per token) and speculative servers at a couple of k (here 1 and the largest), each run briefly.

Cost per generated token. A probe at concurrency c gives aggregate tokens/s ``r`` and the engine's own tau.
``u = tau / r`` is the time of one engine step per concurrent stream (a step yields tau tokens per stream);
for base ``u0 = 1 / r``. Across k the step is fitted as ``u(k) = a + b k``: ``a`` the fixed cost of a
speculative step (the target's verify of one token, the drafter's first pass over the accepted tokens, the
rejection sampler), ``b`` the cost of one more draft token (one more draft forward and one more verified
position). With one speculative probe, ``a`` is taken as base's step (``u0``). The predicted speed-up of k
at c is ``tau(k) * u0 / (a + b k)``: tau(k) is the offline number, not the probe's, so a drafter change is
predicted without new probes as long as the step costs stay the same.

Not modelled: requests finishing unevenly (a batch shrinks at its tail), prefill interleaved with decoding,
and tau changing with concurrency (greedy verify gives the same tokens at any batch size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from redraft.core.errors import UserError


class ModelError(UserError):
    """Probes that cannot define the model (no base, no speculative probe, a rate of zero); says which."""


@dataclass
class StepCost:
    """The fitted step cost at one concurrency (seconds per engine step per stream)."""

    concurrency: int
    base: float  # u0: one target step
    fixed: float  # a: a speculative step with no draft token
    per_draft: float  # b: one more draft token
    probes: dict[int, float]  # k -> the measured u(k) (0: base)

    def speculative(self, k: int) -> float:
        return self.fixed + self.per_draft * k


def step_time(aggregate_tok_s: float, tau: float | None) -> float:
    """Seconds of one engine step per concurrent stream: tau tokens per stream per step (1 for base)."""
    if not aggregate_tok_s or aggregate_tok_s <= 0:
        raise ModelError(f"a probe measured {aggregate_tok_s} tokens/s")
    return (tau or 1.0) / aggregate_tok_s


def fit(concurrency: int, probes: Mapping[int, float]) -> StepCost:
    """Fit u(k) = a + b k through the speculative probes (least squares; one probe: a = base's step)."""
    if 0 not in probes:
        raise ModelError(f"concurrency {concurrency}: no base probe")
    spec = sorted((k, u) for k, u in probes.items() if k > 0)
    if not spec:
        raise ModelError(f"concurrency {concurrency}: no speculative probe")
    u0 = probes[0]
    if len(spec) == 1:
        k, u = spec[0]
        a, b = u0, (u - u0) / k
    else:
        n = len(spec)
        mk = sum(k for k, _ in spec) / n
        mu = sum(u for _, u in spec) / n
        b = sum((k - mk) * (u - mu) for k, u in spec) / sum((k - mk) ** 2 for k, _ in spec)
        a = mu - b * mk
    return StepCost(concurrency, u0, a, b, dict(probes))


def costs_from_probes(probe_summary: Mapping[str, Any], names: Mapping[int, str]) -> dict[int, StepCost]:
    """StepCost per concurrency from pooled probe servers (``serve.repeats.pool_server`` output per name);
    ``names`` maps k (0 = base) to the probe server's name."""
    by_c: dict[int, dict[int, float]] = {}
    for k, name in names.items():
        for lv in probe_summary[name]["levels"]:
            rate = lv["aggregate_tok_s"]["median"]
            if rate is None:
                raise ModelError(f"probe {name}, concurrency {lv['concurrency']}: no successful request")
            tau = lv["accept_length"] if k else None
            if k and tau is None:
                raise ModelError(f"probe {name}, concurrency {lv['concurrency']}: the engine reported no acceptance")
            by_c.setdefault(lv["concurrency"], {})[k] = step_time(rate, tau)
    return {c: fit(c, p) for c, p in sorted(by_c.items())}


def predict(costs: Mapping[int, StepCost], tau: Mapping[int, float], ks: Sequence[int]) -> dict[int, dict[int, float]]:
    """Predicted speed-up over base, per concurrency and k: tau(k) u0 / (a + b k)."""
    out: dict[int, dict[int, float]] = {}
    for c, cost in costs.items():
        out[c] = {}
        for k in ks:
            if k not in tau:
                raise ModelError(f"no offline tau for a chain of {k} drafts (have {sorted(tau)})")
            out[c][k] = tau[k] * cost.base / cost.speculative(k)
    return out


def as_dict(costs: Mapping[int, StepCost]) -> dict[str, Any]:
    return {str(c): asdict(s) for c, s in costs.items()}


def chain_taus(steps: int, accept_length: float, accept_per_pos: Sequence[float] | None) -> dict[int, float]:
    """tau(k) for k = 0..steps from one speculative probe. With the engine's acceptance per draft position (rounds
    that accepted position i / rounds: vLLM's per-position counters; SGLang's per-request histogram of drafts
    accepted per round, which stops at the most any round accepted, so a missing position is 0), a chain of k keeps
    the first k positions, tau(k) = 1 + the sum of the first k rates (greedy chains accept a prefix); without it
    (SGLang's OpenAI API) just tau(0) = 1 and tau(steps)."""
    if accept_per_pos:
        rates = list(accept_per_pos[:steps]) + [0.0] * max(0, steps - len(accept_per_pos))
        return {k: 1.0 + sum(rates[:k]) for k in range(steps + 1)}
    return {0: 1.0, steps: float(accept_length)}


def best_chain(concurrency: int, base_tok_s: float, spec_tok_s: float, steps: int,
               taus: Mapping[int, float]) -> dict[str, Any]:
    """The chain length the probe's own costs predict fastest at one concurrency: the step fitted through base and
    the running setting (``fit`` with one probe), tau(k) from :func:`chain_taus`. k = 0 is no drafting (speed-up
    1 by construction). Returns the prediction per k and the best k."""
    cost = fit(concurrency, {0: step_time(base_tok_s, None), steps: step_time(spec_tok_s, taus[steps])})
    predicted = {k: tau * cost.base / cost.speculative(k) for k, tau in sorted(taus.items())}
    best = max(predicted, key=lambda k: (predicted[k], -k))  # ties: the shorter chain
    return {"concurrency": concurrency, "predicted": predicted, "best_k": best, "cost": asdict(cost)}
