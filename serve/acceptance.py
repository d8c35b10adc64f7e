"""Where each engine's acceptance comes from, for ``serve.bench``: SGLang per request, vLLM from counters.

- SGLang: every ``/generate`` answer carries ``meta_info.spec_verify_ct`` (verify rounds) next to
  ``completion_tokens``; acceptance = Σ tokens / Σ rounds (``serve/report.py``). ``/server_info``
  gives the speculative settings and ``max_running_requests``, whose default of 48 in speculative
  mode is warned about loudly.
- vLLM: no per-request numbers over HTTP. Its Prometheus ``/metrics`` carries the engine's global
  counters ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens`` and
  ``_num_accepted_tokens_per_pos`` (label ``position``), exposed with the ``_total`` suffix. They are
  read before and after each concurrency setting; the difference gives τ = 1 + accepted / drafts and
  the per-position rates, exactly as ``eval.online`` computes them from ``LLM.get_metrics()``. So the
  server must carry no other traffic during a run. A server without those counters runs no drafter
  (acceptance n/a); a server with no ``vllm:`` metric at all was started with ``--disable-log-stats``
  (acceptance unknown, said so).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from redraft.core.errors import Failure
from redraft.engines.counters import aggregate
from redraft.engines.vllm_driver import COUNTERS, PER_POS

SGLANG_SPEC_DEFAULT_MAX_RUNNING = 48  # speculative_hook._handle_eagle_family when --max-running-requests is unset
CAP_ADVICE = "SGLang's cap for speculative decoding"
SGLANG_INFO_KEYS = (
    "model_path", "version", "tp_size", "context_length", "max_running_requests", "cuda_graph_max_bs",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens",
    "speculative_adaptive", "max_total_num_tokens", "launch_command",  # serve.doctor: the fix for the 48 cap
)
VLLM_PREFIX = "vllm:"


class MetricsError(Failure):
    """``/metrics`` cannot be read or parsed; the message names the URL or the line."""


# ---------------------------------------------------------------------------------------------------------
# SGLang


def sglang_request_acceptance(meta: dict[str, Any], tokens: int) -> tuple[int | None, float | None]:
    """(verify rounds, per-request accept length) from one answer's ``meta_info``; (None, None) without a drafter."""
    verify = meta.get("spec_verify_ct")
    accept = meta.get("spec_accept_length")
    if accept is None and verify:
        accept = tokens / verify
    return (int(verify) if verify else None), (float(accept) if accept is not None else None)


def parse_sglang_info(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields we print and check, from SGLang's ``/server_info`` (server args + scheduler info + states)."""
    info = {k: raw.get(k) for k in SGLANG_INFO_KEYS}
    states = raw.get("internal_states")
    state = states[0] if isinstance(states, list) and states else states if isinstance(states, dict) else {}
    info["avg_spec_accept_length"] = state.get("avg_spec_accept_length") if isinstance(state, dict) else None
    if info["max_running_requests"] is None and isinstance(state, dict):  # nothing asked: what the scheduler chose
        info["max_running_requests"] = state.get("effective_max_running_requests_per_dp",
                                                 state.get("max_running_requests"))
    return info


def sglang_warnings(role: str, info: dict[str, Any], concurrency: Sequence[int], found: bool) -> list[str]:
    """Loud, specific warnings: the 48 cap, concurrency above the server's limits, a mislabelled server."""
    if not found:
        return ["the server exposes neither /server_info nor /get_server_info: its speculative settings "
                "and max_running_requests are unknown"]
    out = []
    spec = info.get("speculative_algorithm")
    mrr = info.get("max_running_requests")
    top = max(concurrency) if concurrency else 0
    if spec and mrr == SGLANG_SPEC_DEFAULT_MAX_RUNNING:
        out.append(
            f"speculative server ({spec}) runs with max_running_requests = 48, {CAP_ADVICE} when --max-running-requests is not given (or it was set to 48): requests above 48 queue. "
            "This cap turned 2,370 tok/s into 849 tok/s in the write-up this project started from. Relaunch "
            "with an explicit --max-running-requests N --cuda-graph-max-bs N (slurm/serve.sh does).")
    elif spec and mrr is None:
        out.append(f"speculative server ({spec}) does not report max_running_requests: SGLang caps speculative "
                   "serving at 48 unless --max-running-requests is given")
    if isinstance(mrr, int) and top > mrr:
        out.append(f"concurrency {top} exceeds max_running_requests {mrr}: the extra requests queue, "
                   "so throughput at that setting measures the cap, not the decoder")
    cg = info.get("cuda_graph_max_bs")
    if isinstance(cg, int) and spec and top > cg:
        out.append(f"concurrency {top} exceeds cuda_graph_max_bs {cg}: larger batches run without CUDA graphs")
    out += _role_warnings(role, spec)
    return out


def is_cap_advice(warning: str) -> bool:
    """Whether a warning is the 48-cap advice for production: it changes nothing measured at concurrencies up to
    48 (a higher concurrency gets its own warning, "exceeds max_running_requests")."""
    return CAP_ADVICE in warning


def _role_warnings(role: str, spec: Any) -> list[str]:
    if role == "eagle" and not spec:
        return ["the --eagle server reports no speculative decoding: it is not running a drafter"]
    if role == "base" and spec:
        return [f"the --base server runs speculative decoding ({spec}): it is not a baseline"]
    return []


# ---------------------------------------------------------------------------------------------------------
# Prometheus text (vLLM /metrics)


@dataclass(frozen=True)
class Sample:
    """One sample line: ``name{labels} value``."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _labels(text: str, lineno: int) -> tuple[tuple[str, str], ...]:
    body = text[1:-1]
    out, pos = [], 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if not m:
            raise MetricsError(f"/metrics line {lineno}: cannot parse labels {text!r}")
        value = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], m.group(2))
        out.append((m.group(1), value))
        pos = m.end()
    return tuple(out)


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (version 0.0.4); comments and blank lines skipped."""
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise MetricsError(f"/metrics line {lineno}: not a sample: {line[:120]!r}")
        try:
            value = float(m.group(3))
        except ValueError:
            raise MetricsError(f"/metrics line {lineno}: bad value {m.group(3)!r}") from None
        out.append(Sample(m.group(1), _labels(m.group(2), lineno) if m.group(2) else (), value))
    return out


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters at one moment, summed over engines (data-parallel ranks)."""

    stats_enabled: bool  # any vllm: metric at all (none: the server runs with --disable-log-stats)
    speculative: bool  # the spec-decode counters exist (the server runs a drafter)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


def _counter(samples: Sequence[Sample], name: str) -> list[Sample]:
    """A counter's samples: ``name_total`` (prometheus_client's exposition), or ``name`` as written by others."""
    total = [s for s in samples if s.name == name + "_total"]
    return total or [s for s in samples if s.name == name]


def spec_counters(samples: Sequence[Sample]) -> SpecCounters:
    """The counters ``eval.online`` reads from ``LLM.get_metrics()``, here from ``/metrics`` samples."""
    enabled = any(s.name.startswith(VLLM_PREFIX) for s in samples)
    drafts, draft_tokens, accepted = (_counter(samples, n) for n in COUNTERS)
    if not drafts:
        return SpecCounters(stats_enabled=enabled, speculative=False)
    per_pos: dict[int, int] = {}
    for s in _counter(samples, PER_POS):
        pos = s.label("position")
        if pos is None or not pos.isdigit():
            raise MetricsError(f"{PER_POS}: sample without a numeric position label: {s.labels}")
        per_pos[int(pos)] = per_pos.get(int(pos), 0) + int(s.value)
    k = max(per_pos) + 1 if per_pos else 0
    return SpecCounters(
        stats_enabled=enabled, speculative=True,
        num_drafts=int(sum(s.value for s in drafts)),
        num_draft_tokens=int(sum(s.value for s in draft_tokens)),
        num_accepted_tokens=int(sum(s.value for s in accepted)),
        num_accepted_tokens_per_pos=[per_pos.get(i, 0) for i in range(k)],
    )


@dataclass
class SpecDelta:
    """What a run added to the counters, and vLLM's acceptance numbers for it (None: nothing was drafted)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    tau: float | None  # 1 + accepted / drafts: tokens per verify round, the bonus token included
    accept_rate_per_pos: list[float] | None  # accepted at position k / drafts
    draft_acceptance_rate: float | None  # accepted / draft tokens


def counters_delta(before: SpecCounters, after: SpecCounters) -> SpecDelta:
    """after − before; τ and the per-position rates by ``redraft.engines.counters.aggregate`` (vLLM's definitions)."""
    if len(after.num_accepted_tokens_per_pos) < len(before.num_accepted_tokens_per_pos):
        raise MetricsError("the per-position counters shrank between two scrapes: was the server restarted?")
    k = len(after.num_accepted_tokens_per_pos)
    pb = before.num_accepted_tokens_per_pos + [0] * (k - len(before.num_accepted_tokens_per_pos))
    row = {"num_drafts": after.num_drafts - before.num_drafts,
           "num_draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
           "num_accepted_tokens": after.num_accepted_tokens - before.num_accepted_tokens,
           "num_accepted_tokens_per_pos": [a - b for a, b in zip(after.num_accepted_tokens_per_pos, pb, strict=True)],
           "output_token_ids": []}
    if min(row["num_drafts"], row["num_draft_tokens"], row["num_accepted_tokens"]) < 0:
        raise MetricsError("the spec-decode counters went down between two scrapes: was the server restarted?")
    agg = aggregate([row], k)
    drafted = agg["num_drafts"] > 0
    return SpecDelta(
        num_drafts=agg["num_drafts"], num_draft_tokens=agg["num_draft_tokens"],
        num_accepted_tokens=agg["num_accepted_tokens"], num_accepted_tokens_per_pos=agg["num_accepted_tokens_per_pos"],
        tau=agg["tau"] if drafted else None, accept_rate_per_pos=agg["accept_rate"] if drafted else None,
        draft_acceptance_rate=agg["num_accepted_tokens"] / agg["num_draft_tokens"] if agg["num_draft_tokens"] else None,
    )


async def fetch_metrics(session: aiohttp.ClientSession, url: str, timeout: float) -> str:
    """The text of ``GET url/metrics``; MetricsError naming the URL when it cannot be read."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise MetricsError(f"{url}/metrics: HTTP {resp.status}: {text[:200]}")
            return text
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise MetricsError(f"{url}/metrics: {type(e).__name__}: {e}") from e


async def read_counters(session: aiohttp.ClientSession, url: str, timeout: float, *, settle_s: float = 0.2,
                        tries: int = 10) -> SpecCounters:
    """The counters once two reads ``settle_s`` apart agree: the engine records a step's counters right after
    it hands the step's tokens out, so a read racing the last answer of a run could miss that step."""
    last = spec_counters(parse_prometheus(await fetch_metrics(session, url, timeout)))
    for _ in range(tries):
        await asyncio.sleep(settle_s)
        now = spec_counters(parse_prometheus(await fetch_metrics(session, url, timeout)))
        if now == last:
            return now
        last = now
    return last


def vllm_warnings(role: str, counters: SpecCounters) -> list[str]:
    """What cannot be measured on this vLLM server, and a mislabelled one."""
    if not counters.stats_enabled:
        return ["/metrics has no vllm: metrics (the server was started with --disable-log-stats?): "
                "acceptance cannot be measured; restart it without that flag"]
    return _role_warnings(role, "speculative decoding" if counters.speculative else None)


def vllm_info(models: Any, version: str | None, counters: SpecCounters) -> dict[str, Any]:
    """The fields we print, from ``/v1/models`` (model id, max_model_len), ``/version`` and ``/metrics``."""
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    k = len(counters.num_accepted_tokens_per_pos)
    return {"model_path": first.get("root") or first.get("id"), "version": version,
            "context_length": first.get("max_model_len"),
            "speculative_algorithm": "spec decode (vLLM counters)" if counters.speculative else None,
            "speculative_num_steps": k or None, "stats_enabled": counters.stats_enabled}
