"""Numbers and outputs of ``benchmarks/serving_gain.py``: repeats pooled per server and concurrency, ratios to base.

Kept apart from the runner so the arithmetic can be read (and checked) without a server. The pooling over
the interleaved repeats is ``serve.repeats``' (shared with ``serve.tune``); start-up (server start until
``/v1/models`` answers) stays apart from every rate, median with min and max.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from redraft.core.atomic import atomic_write_text
from redraft.core.plotting import atomic_write_png, pyplot
from serve.repeats import BASE, pool_server
from serve.report import render_markdown_table as markdown_table
from serve.report import tokens_axes

DEFINITIONS = {
    "aggregate_tok_s": "sum of completion tokens / wall time of the setting (serve.bench); median over repeats",
    "per_stream_tok_s": "mean over requests of completion tokens / latency (serve.bench); median over repeats",
    "single_stream_tok_s": "per-stream tokens/s at concurrency 1 (the seed's 'single stream')",
    "peak_tok_s": "highest aggregate tokens/s over the concurrency sweep (the seed's 'peak')",
    "ttft_ms, tpot_ms": "serve.bench's percentiles per repeat, median over repeats",
    "accept_length": "tau = 1 + accepted / drafts of the /metrics spec-decode counters' differences around each "
                     "setting, summed over repeats (the engine's own number); n/a: no drafter",
    "accept_per_pos": "accepted at draft position k / drafts, same counters",
    "ratio_to_base": "per concurrency: median over repeats of server / base in the same repeat (above 1: faster "
                     "than base); in the headline (single stream, peak): the ratio of the medians",
    "startup_s": "server process start until /v1/models answers, per start; not in any rate",
}


def summarize(runs: list[dict[str, Any]], servers: list[str]) -> dict[str, Any]:
    """Per server: start-up, pooled levels with ratios to base, and the seed-style headline."""
    out: dict[str, Any] = {}
    for name in servers:
        pooled = pool_server(runs, name)
        levels = pooled["levels"]
        single = next((lv for lv in levels if lv["concurrency"] == 1), None)
        peak = max(levels, key=lambda lv: lv["aggregate_tok_s"]["median"] or 0.0) if levels else None
        out[name] = {
            "startup_s": pooled["startup_s"],
            "levels": levels,
            "single_stream_tok_s": single["per_stream_tok_s"]["median"] if single else None,
            "peak_tok_s": peak["aggregate_tok_s"]["median"] if peak else None,
            "peak_concurrency": peak["concurrency"] if peak else None,
            "accept_length": single["accept_length"] if single else None,
        }
    base = out.get(BASE)
    for name, s in out.items():
        if base and name != BASE:
            s["single_stream_ratio"] = _div(s["single_stream_tok_s"], base["single_stream_tok_s"])
            s["peak_ratio"] = _div(s["peak_tok_s"], base["peak_tok_s"])
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ----------------------------------------------------------------------------- rendering


def _f(v: Any, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def _x(v: Any) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _range(s: dict[str, Any], digits: int = 1) -> str:
    if s["median"] is None:
        return "n/a"
    if len(s["values"]) == 1:
        return _f(s["median"], digits)
    return f"{_f(s['median'], digits)} ({_f(s['min'], digits)}-{_f(s['max'], digits)})"


def headline_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [["server", "drafter", "single stream tok/s", "x base", "peak tok/s (conc)", "x base",
             "tau (conc 1)", "start-up s"]]
    for name, s in report["summary"].items():
        rows.append([name, report["servers"][name]["label"], _f(s["single_stream_tok_s"]),
                     _x(s.get("single_stream_ratio")) if name != BASE else "1.00x",
                     f"{_f(s['peak_tok_s'])} ({s['peak_concurrency']})",
                     _x(s.get("peak_ratio")) if name != BASE else "1.00x",
                     _f(s["accept_length"], 3), _range(s["startup_s"], 0)])
    return rows


def detail_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [["conc", "server", "tok/s", "x base", "per-stream tok/s", "x base", "TTFT p50/p90/p99 ms",
             "TPOT p50/p90/p99 ms", "tau", "accept/pos", "tokens", "errors"]]
    concs = sorted({lv["concurrency"] for s in report["summary"].values() for lv in s["levels"]})
    for c in concs:
        for name, s in report["summary"].items():
            lv = next((x for x in s["levels"] if x["concurrency"] == c), None)
            if lv is None:
                continue
            ratio = lv.get("ratio_to_base")
            rows.append([
                str(c), name, _range(lv["aggregate_tok_s"]),
                _x(ratio["aggregate_tok_s"]["median"]) if ratio else "",
                _range(lv["per_stream_tok_s"]), _x(ratio["per_stream_tok_s"]["median"]) if ratio else "",
                "/".join(_f(lv["ttft_ms"][p], 0) for p in ("p50", "p90", "p99")),
                "/".join(_f(lv["tpot_ms"][p], 1) for p in ("p50", "p90", "p99")),
                _f(lv["accept_length"], 3),
                "/".join(f"{a:.3f}" for a in lv["accept_per_pos"]) if lv["accept_per_pos"] else "n/a",
                str(lv["output_tokens"]), str(lv["errors"]),
            ])
    return rows


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = ["# Serving gain: base, A, B in vLLM", "",
             f"Target `{s['target']}`, vLLM {report.get('vllm_version') or '?'} ({s['engine_python']}), dtype "
             f"{s['dtype']}, {s['steps']} draft tokens; {s['num_prompts']} MT-bench first turns, max {s['max_tokens']} "
             f"new tokens, greedy; concurrency {s['concurrency']}; {s['repeats']} interleaved repeat(s) "
             f"({' -> '.join(s['servers'])}), each on a freshly started server.", "",
             f"Command: `{s.get('command', '?')}`; {s.get('cpus')} CPUs, load average at start "
             f"{'/'.join(f'{x:.1f}' for x in s.get('loadavg_at_start') or [])}.", ""]
    for name, srv in report["servers"].items():
        lines.append(f"- **{name}**: {srv['label']}" + (f" (`{srv['source']}`; {srv['how']})" if srv["source"] else ""))
    lines += ["", "## The seed's table in miniature", "", markdown_table(headline_rows(report)), "",
              "## Per concurrency (median over repeats, min-max in brackets)", "",
              markdown_table(detail_rows(report)), "", "Definitions:", ""]
    lines += [f"- {k}: {v}" for k, v in report["definitions"].items()]
    return "\n".join(lines) + "\n"


def write_json(report: dict[str, Any], path: Path) -> None:
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Aggregate and per-stream tokens/s against concurrency (median, min-max bars), one line per server."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, s in report["summary"].items():
        levels = [lv for lv in s["levels"] if lv["aggregate_tok_s"]["median"] is not None]
        xs = [lv["concurrency"] for lv in levels]
        label = f"{name} (tau {_f(s['accept_length'], 2)})" if s["accept_length"] else name
        for ax, key in zip(axes, ("aggregate_tok_s", "per_stream_tok_s"), strict=True):
            med = [lv[key]["median"] or 0.0 for lv in levels]
            lo = [m - (lv[key]["min"] or m) for m, lv in zip(med, levels, strict=True)]
            hi = [(lv[key]["max"] or m) - m for m, lv in zip(med, levels, strict=True)]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    tokens_axes(axes)
    st = report["settings"]
    fig.suptitle(f"{Path(st['target']).name} in vLLM {report.get('vllm_version') or ''}: {st['num_prompts']} MT-bench prompts, "
                 f"max {st['max_tokens']} tokens, {st['repeats']} repeat(s)", fontsize=9)
    fig.tight_layout()
    atomic_write_png(fig, path)
