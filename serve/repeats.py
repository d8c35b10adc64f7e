"""Interleaved repeats on fresh vLLM or SGLang servers, and their pooling: the one sweep
``benchmarks/serving_gain.py`` and ``serve.tune`` both run.

Each repeat starts every server in turn (base, then each drafter or setting), measures it with
``serve.bench``'s sweep (warm-up, each concurrency, the engine's spec-decode counters around each) and stops
it; repeats interleave (a, b, c, a, b, c, ...) so that load from elsewhere on the machine hits every server
alike. Start-up is reported apart from every rate. ``run_on_one_start`` runs several measurements on one start
(``serve.tune``'s probe and its sweep's first repeat of the same setting).

Pooling over repeats:

- tokens/s (aggregate and per stream): median over repeats, with min and max;
- TTFT/TPOT percentiles: median over repeats of each repeat's percentile (serve.bench's definitions);
- acceptance: the spec-decode counters summed over repeats (vLLM: its ``/metrics`` counters' differences;
  SGLang: each answer's own ``meta_info`` counters), then τ = 1 + accepted / drafts and accepted at position k
  / drafts (vLLM's definitions, as serve.bench reads them); n/a without a drafter;
- ratio to base: median over repeats of (server / base) in the same repeat (the pairs the interleaving makes).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redraft.core.errors import Failure
from redraft.engines.driver_protocol import EngineError
from redraft.engines.vllm import EngineSettings, VLLMServer
from serve.prompts import ServingError

log = logging.getLogger(__name__)
BASE = "base"


class SweepError(Failure):
    """A server that failed to start or to answer; the message names the repeat and the server."""


@dataclass
class ServerSpec:
    """One server of a sweep: its name, the drafter in the engine's layout (None: base) and its draft steps
    (vLLM num_speculative_tokens; SGLang a chain of them: topk 1, steps + 1 draft tokens)."""

    name: str
    drafter: Path | None = None
    steps: int = 0


@dataclass
class ServerOptions:
    """How every server of a sweep is started (the engine, its options and its interpreter)."""

    target: str
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 16
    engine_python: str | None = None
    threads: int | None = None
    start_timeout: float = 900.0
    engine: str = "vllm"  # or "sglang"

    def server(self, spec: ServerSpec, extra_env: dict[str, str] | None) -> Any:
        """The started server for ``spec`` (a context manager with ``url`` and ``load_seconds``)."""
        if self.engine == "sglang":
            from redraft.engines.sglang import SGLangServer

            return SGLangServer(self.sglang_kwargs(spec), python=self.engine_python, timeout_s=self.start_timeout,
                                extra_env=extra_env)
        return VLLMServer(self.engine_settings(spec), python=self.engine_python, timeout_s=self.start_timeout,
                          extra_env=extra_env, stats=True)

    def sglang_kwargs(self, spec: ServerSpec) -> dict[str, Any]:
        """``launch_server`` settings: the request limit left to SGLang, so that its report shows what it
        chooses (48 when speculating)."""
        kw: dict[str, Any] = {"model_path": self.target, "dtype": self.dtype, "context_length": self.max_model_len}
        if spec.drafter:
            kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(spec.drafter),
                      speculative_num_steps=spec.steps, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=spec.steps + 1)
        return kw

    def engine_settings(self, spec: ServerSpec) -> EngineSettings:
        return EngineSettings(target=self.target, drafter=str(spec.drafter) if spec.drafter else None,
                              steps=spec.steps if spec.drafter else 0, dtype=self.dtype,
                              max_model_len=self.max_model_len, kv_cache_bytes=self.kv_cache_bytes,
                              max_num_seqs=self.max_num_seqs)


def measure(spec: ServerSpec, url: str, cfg: Any, prompts: Sequence[str], ids: Sequence[list[int]]) -> dict[str, Any]:
    """serve.bench's sweep against one running server (warm-up, each concurrency, counters around each)."""
    from serve.acceptance import is_cap_advice
    from serve.bench import bench_server
    from serve.client import Target

    role = BASE if spec.drafter is None else "eagle"
    result = asyncio.run(bench_server(Target(role, url, "native"), cfg, prompts, ids))
    # a base server that drafts, a drafter server that does not, no counters, concurrency above the server's limit;
    # SGLang's 48-cap advice is for production and is kept in the report (its max_running_requests) instead
    problems = [w for w in result["warnings"] if not is_cap_advice(w)]
    if problems:
        raise SweepError(f"server {spec.name} ({url}): {'; '.join(problems)}")
    for lv in result["levels"]:  # SGLang's histogram stops at the most drafts any round accepted: pad to k
        counts, missing = lv.spec_counts, spec.steps - len((lv.spec_counts or {}).get("num_accepted_tokens_per_pos", []))
        if counts and missing > 0:
            counts["num_accepted_tokens_per_pos"] = counts["num_accepted_tokens_per_pos"] + [0] * missing
            lv.accept_per_pos = (lv.accept_per_pos or []) + [0.0] * missing
    return {**result, "levels": [asdict(lv) for lv in result["levels"]]}


@dataclass(frozen=True)
class Job:
    """One measurement on a started server: the run's name in the report, serve.bench's settings, the traffic."""

    name: str
    cfg: Any
    prompts: Sequence[str]
    ids: Sequence[list[int]]


def run_on_one_start(spec: ServerSpec, opts: ServerOptions, jobs: Sequence[Job], repeat: int,
                     extra_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start ``spec``'s server once and run ``jobs`` on it in order (a server start is the expensive part: minutes
    for a large target); a run each: {repeat, server, startup_s, seconds, result, after}, ``after`` naming the run
    that used the same start before it (None for the first)."""
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        with opts.server(spec, extra_env) as srv:
            startup = srv.load_seconds
            for job in jobs:
                t1 = time.perf_counter() if runs else t0
                result = measure(spec, srv.url, job.cfg, job.prompts, job.ids)
                runs.append({"repeat": repeat, "server": job.name, "startup_s": startup,
                             "seconds": time.perf_counter() - t1, "result": result,
                             "after": runs[-1]["server"] if runs else None})
                first = result["levels"][0]
                log.info("repeat %d, %s: %.1f tok/s at concurrency %d, tau %s; started in %.0f s%s", repeat + 1,
                         job.name, first["aggregate_tok_s"], first["concurrency"],
                         "n/a" if first["accept_length"] is None else f"{first['accept_length']:.3f}", startup,
                         f" (the start of {runs[0]['server']})" if len(runs) > 1 else "")
    except (EngineError, ServingError) as e:
        raise SweepError(f"repeat {repeat + 1}, server {spec.name}: {e}") from None
    return runs


def run_interleaved(specs: Sequence[ServerSpec], opts: ServerOptions, cfg: Any, prompts: Sequence[str],
                    ids: Sequence[list[int]], repeats: int,
                    on_run: Callable[[list[dict[str, Any]]], None] | None = None,
                    first_repeat: int = 0) -> list[dict[str, Any]]:
    """Every server once per repeat, in order, each freshly started; ``on_run`` sees the runs so far
    after each (to rewrite a report). A run: {repeat, server, startup_s, seconds, result, after}. Repeats are
    numbered from ``first_repeat`` (a caller that measured repeat 0 itself continues at 1)."""
    extra_env = {"OMP_NUM_THREADS": str(opts.threads)} if opts.threads else None
    runs: list[dict[str, Any]] = []
    total = repeats * len(specs)
    for r in range(first_repeat, first_repeat + repeats):
        for spec in specs:
            log.info("[%d/%d] repeat %d, server %s: starting", len(runs) + 1, total, r + 1, spec.name)
            runs += run_on_one_start(spec, opts, [Job(spec.name, cfg, prompts, ids)], r, extra_env)
            if on_run is not None:
                on_run(runs)
    return runs


# ----------------------------------------------------------------------------- pooling


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """median, min, max and the values themselves (None when there are none)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def pooled_counts(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The spec-decode counters' differences summed over repeats (None when no repeat has any)."""
    from serve.report import sum_counts

    return sum_counts([lv["spec_counts"] for lv in levels if lv.get("spec_counts")])


def pool_level(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """One server at one concurrency over its repeats (serve.bench LevelStats dicts, one per repeat)."""
    counts = pooled_counts(levels)
    drafts = counts["num_drafts"] if counts else 0
    pcts = ("p50", "p90", "p99")
    return {
        "concurrency": levels[0]["concurrency"],
        "repeats": len(levels),
        "requests": sum(lv["requests"] for lv in levels),
        "errors": sum(lv["errors"] for lv in levels),
        "output_tokens": sum(lv["output_tokens"] for lv in levels),
        "aggregate_tok_s": spread([lv["aggregate_tok_s"] for lv in levels if lv["ok"]]),
        "per_stream_tok_s": spread([lv["per_stream_tok_s"] for lv in levels if lv["ok"]]),
        "ttft_ms": {p: spread([lv["ttft_ms"].get(p) for lv in levels])["median"] for p in pcts},
        "tpot_ms": {p: spread([lv["tpot_ms"].get(p) for lv in levels])["median"] for p in pcts},
        "spec_counts": counts,
        "accept_length": 1.0 + counts["num_accepted_tokens"] / drafts if drafts else None,
        "accept_per_pos": [a / drafts for a in counts["num_accepted_tokens_per_pos"]] if drafts else None,
    }


def paired_ratios(runs: list[dict[str, Any]], name: str, c: int, key: str) -> dict[str, Any]:
    """server / base per repeat at concurrency c, for a repeat where both measured something."""
    by_repeat: dict[int, dict[str, float]] = {}
    for run in runs:
        for lv in run["result"]["levels"]:
            if lv["concurrency"] == c and lv["ok"] and lv.get(key):
                by_repeat.setdefault(run["repeat"], {})[run["server"]] = lv[key]
    return spread([v[name] / v[BASE] for v in by_repeat.values() if name in v and BASE in v and v[BASE]])


def pool_server(runs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One server's start-up and its pooled levels, each with ratios to base when base ran too."""
    mine = [r for r in runs if r["server"] == name]
    concs = sorted({lv["concurrency"] for r in mine for lv in r["result"]["levels"]})
    levels = []
    for c in concs:
        pooled = pool_level([lv for r in mine for lv in r["result"]["levels"] if lv["concurrency"] == c])
        if name != BASE and any(r["server"] == BASE for r in runs):
            pooled["ratio_to_base"] = {k: paired_ratios(runs, name, c, k)
                                       for k in ("aggregate_tok_s", "per_stream_tok_s")}
        levels.append(pooled)
    return {"startup_s": spread([r["startup_s"] for r in mine]), "levels": levels}
