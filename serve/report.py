"""Serving-benchmark arithmetic and outputs: per-request results → per-setting statistics → table/JSON/Markdown/PNG.

Kept apart from the HTTP client so the maths can be tested on known answers without a server.
Conventions (stated in every output):

- TTFT: request sent → first chunk carrying generated text (needs streaming).
- TPOT: (latency − TTFT) / (completion tokens − 1); requests with one token have no TPOT.
- Per-stream tokens/s: mean over requests of completion tokens / latency (what one user sees).
- Aggregate tokens/s: Σ completion tokens / wall time of the setting (first send → last reply).
- Acceptance length, each engine's own number (tokens per verify round, bonus token included):
  SGLang: Σ completion tokens / Σ ``spec_verify_ct`` over requests that report it (weighting by
  tokens, not a mean of per-request ratios, so short answers do not dominate; the per-request mean
  of ``spec_accept_length`` is kept alongside; the first token, from prefill, is counted too, so it
  reads high on short answers). vLLM: 1 + Δaccepted / Δdrafts of the ``/metrics`` counters around
  the setting, and per position Δaccepted[k] / Δdrafts (``serve/acceptance.py``).
- A server without a drafter has no acceptance: n/a, never 1.0.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redraft.core.atomic import atomic_write_bytes
from redraft.core.plotting import atomic_write_png, pyplot

if TYPE_CHECKING:
    from serve.acceptance import SpecDelta

PERCENTILES = (50, 90, 99)
SCHEMA = "redraft.serving/2"
ROLES = ("base", "eagle")
ROLE_TITLES = {"base": "base", "eagle": "EAGLE-3"}
OPENAI_NOTE = ("* acceptance n/a: SGLang's OpenAI-compatible API returns no meta_info (spec_verify_ct); "
               "use --api native --tokenizer TARGET_FOLDER to measure it")


@dataclass
class RequestResult:
    """One request after retries: timings from the last attempt, error text if every attempt failed."""

    ok: bool
    latency_s: float = 0.0
    ttft_s: float | None = None
    completion_tokens: int = 0
    spec_verify_ct: int | None = None
    spec_accept_length: float | None = None
    spec_counts: dict[str, Any] | None = None  # SGLang: the request's own counters (sglang_driver.spec_counters)
    attempts: int = 1
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.completion_tokens < 2:
            return None
        return max(self.latency_s - self.ttft_s, 0.0) / (self.completion_tokens - 1)


@dataclass
class LevelStats:
    """One concurrency setting on one server."""

    concurrency: int
    requests: int
    ok: int
    errors: int
    retried: int
    duration_s: float
    output_tokens: int
    aggregate_tok_s: float
    per_stream_tok_s: float | None
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    tpot_ms: dict[str, float | None] = field(default_factory=dict)
    accept_length: float | None = None
    accept_length_mean: float | None = None
    accept_coverage: float = 0.0  # fraction of successful requests that reported spec_verify_ct
    accept_source: str | None = None  # "meta_info" (SGLang, per request) or "metrics" (vLLM counters)
    accept_per_pos: list[float] | None = None  # accepted at draft position k / drafts
    spec_counts: dict[str, Any] | None = None  # vLLM: the counters' differences over the setting; SGLang: the
    # requests' own counters summed
    error_samples: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def _pcts_ms(values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in PERCENTILES:
        v = percentile(values, q)
        out[f"p{q}"] = None if v is None else v * 1000.0
    return out


def acceptance_length(results: Sequence[RequestResult]) -> float | None:
    """Σ completion tokens / Σ verify steps over successful requests that report ``spec_verify_ct``."""
    tokens = sum(r.completion_tokens for r in results if r.ok and r.spec_verify_ct)
    steps = sum(r.spec_verify_ct for r in results if r.ok and r.spec_verify_ct)
    return tokens / steps if steps else None


def summarize(results: Sequence[RequestResult], concurrency: int, duration_s: float) -> LevelStats:
    """Statistics of one setting; errors are counted, never folded into the timings."""
    good = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in good)
    per_stream = [r.completion_tokens / r.latency_s for r in good if r.latency_s > 0]
    ttfts = [r.ttft_s for r in good if r.ttft_s is not None]
    tpots = [t for t in (r.tpot_s for r in good) if t is not None]
    accept_lens = [r.spec_accept_length for r in good if r.spec_accept_length is not None]
    reporting = [r for r in good if r.spec_verify_ct]
    errors = [r.error for r in results if not r.ok]
    return LevelStats(
        concurrency=concurrency,
        requests=len(results),
        ok=len(good),
        errors=len(errors),
        retried=sum(1 for r in results if r.attempts > 1),
        duration_s=duration_s,
        output_tokens=tokens,
        aggregate_tok_s=tokens / duration_s if duration_s > 0 else 0.0,
        per_stream_tok_s=sum(per_stream) / len(per_stream) if per_stream else None,
        ttft_ms=_pcts_ms(ttfts),
        tpot_ms=_pcts_ms(tpots),
        accept_length=acceptance_length(good),
        accept_length_mean=sum(accept_lens) / len(accept_lens) if accept_lens else None,
        accept_coverage=len(reporting) / len(good) if good else 0.0,
        accept_source="meta_info" if reporting else None,
        accept_per_pos=_per_pos(counts) if (counts := summed_counts(good)) else None,
        spec_counts=counts,
        error_samples=sorted(set(errors))[:3],
    )


def summed_counts(results: Sequence[RequestResult]) -> dict[str, Any] | None:
    """SGLang: the per-request counters of every answer that has them, summed (None when none has)."""
    return sum_counts([r.spec_counts for r in results if r.spec_counts])


def sum_counts(counts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Speculative counters (drafts, draft tokens, accepted, accepted per position) summed; None for none."""
    if not counts:
        return None
    k = max(len(c["num_accepted_tokens_per_pos"]) for c in counts)
    return {"num_drafts": sum(c["num_drafts"] for c in counts),
            "num_draft_tokens": sum(c["num_draft_tokens"] for c in counts),
            "num_accepted_tokens": sum(c["num_accepted_tokens"] for c in counts),
            "num_accepted_tokens_per_pos": [sum(c["num_accepted_tokens_per_pos"][i] for c in counts
                                                if i < len(c["num_accepted_tokens_per_pos"])) for i in range(k)]}


def _per_pos(counts: dict[str, Any]) -> list[float] | None:
    drafts = counts["num_drafts"]
    return [a / drafts for a in counts["num_accepted_tokens_per_pos"]] if drafts else None


def apply_counter_delta(stats: LevelStats, delta: SpecDelta) -> LevelStats:
    """vLLM: the setting's acceptance from the counters' difference around it (None when nothing was drafted)."""
    stats.accept_length = delta.tau
    stats.accept_per_pos = delta.accept_rate_per_pos
    stats.accept_length_mean = None
    stats.accept_source = "metrics"
    stats.accept_coverage = 1.0 if delta.num_drafts else 0.0
    stats.spec_counts = {"num_drafts": delta.num_drafts, "num_draft_tokens": delta.num_draft_tokens,
                         "num_accepted_tokens": delta.num_accepted_tokens,
                         "num_accepted_tokens_per_pos": delta.num_accepted_tokens_per_pos,
                         "draft_acceptance_rate": delta.draft_acceptance_rate}
    return stats


# ---------------------------------------------------------------------------------------------------------
# Report assembly


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def comparison_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per concurrency present for both servers: EAGLE-3 value / base value for each metric."""
    servers = report.get("servers", {})
    if not all(role in servers for role in ROLES):
        return []
    by_c = {role: {lv["concurrency"]: lv for lv in servers[role]["levels"]} for role in ROLES}
    rows = []
    for c in sorted(set(by_c["base"]) & set(by_c["eagle"])):
        b, e = by_c["base"][c], by_c["eagle"][c]
        rows.append({
            "concurrency": c,
            "aggregate_tok_s": {"base": b["aggregate_tok_s"], "eagle": e["aggregate_tok_s"],
                                "ratio": _ratio(e["aggregate_tok_s"], b["aggregate_tok_s"])},
            "per_stream_tok_s": {"base": b["per_stream_tok_s"], "eagle": e["per_stream_tok_s"],
                                 "ratio": _ratio(e["per_stream_tok_s"], b["per_stream_tok_s"])},
            "tpot_p50_ms": {"base": b["tpot_ms"].get("p50"), "eagle": e["tpot_ms"].get("p50"),
                            "ratio": _ratio(e["tpot_ms"].get("p50"), b["tpot_ms"].get("p50"))},
            "ttft_p50_ms": {"base": b["ttft_ms"].get("p50"), "eagle": e["ttft_ms"].get("p50"),
                            "ratio": _ratio(e["ttft_ms"].get("p50"), b["ttft_ms"].get("p50"))},
            "accept_length": e["accept_length"],
            "errors": {"base": b["errors"], "eagle": e["errors"]},
        })
    return rows


def build_report(settings: dict[str, Any], servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON document: settings, per-server info/warnings/levels, and the side-by-side rows."""
    report = {
        "schema": SCHEMA,
        "settings": settings,
        "definitions": {
            "ttft": "request sent -> first streamed chunk with generated text",
            "tpot": "(latency - ttft) / (completion_tokens - 1)",
            "per_stream_tok_s": "mean over requests of completion_tokens / latency",
            "aggregate_tok_s": "sum of completion_tokens / wall time of the setting",
            "accept_length": "tokens per verify round, bonus token included. SGLang: sum completion_tokens / sum "
                             "spec_verify_ct (meta_info); vLLM: 1 + accepted / drafts, differences of the /metrics "
                             "counters around the setting; n/a: no drafter",
            "accept_per_pos": "vLLM: accepted at draft position k / drafts (same counters)",
            "ratio": "EAGLE-3 / base (above 1 is better for tok/s, below 1 is better for latencies)",
        },
        "servers": {role: _jsonable(s) for role, s in servers.items()},
    }
    report["comparison"] = comparison_rows(report)
    return report


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, LevelStats):
        return asdict(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------------------
# Rendering


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _sglang_openai(server: dict[str, Any]) -> bool:
    return server.get("api") == "openai" and server.get("engine", "sglang") == "sglang"


def _per_pos_cell(level: dict[str, Any]) -> str:
    rates = level.get("accept_per_pos")
    return "/".join(f"{r:.2f}" for r in rates) if rates else "n/a"


def _accept_cell(level: dict[str, Any], server: dict[str, Any]) -> str:
    if level["accept_length"] is not None:
        return f"{level['accept_length']:.2f}"
    if _sglang_openai(server):
        return "n/a*"
    return "n/a"


def comparison_table(report: dict[str, Any]) -> list[list[str]]:
    header = ["conc", "tok/s base", "tok/s EAGLE-3", "ratio", "per-stream base", "per-stream EAGLE-3", "ratio",
              "TPOT p50 ms base", "TPOT p50 ms EAGLE-3", "ratio", "accept len", "errors b/e"]
    rows = [header]
    eagle = report["servers"].get("eagle", {})
    for r in report["comparison"]:
        lv = next(x for x in eagle["levels"] if x["concurrency"] == r["concurrency"])
        rows.append([
            str(r["concurrency"]),
            _fmt(r["aggregate_tok_s"]["base"]), _fmt(r["aggregate_tok_s"]["eagle"]),
            _fmt_ratio(r["aggregate_tok_s"]["ratio"]),
            _fmt(r["per_stream_tok_s"]["base"]), _fmt(r["per_stream_tok_s"]["eagle"]),
            _fmt_ratio(r["per_stream_tok_s"]["ratio"]),
            _fmt(r["tpot_p50_ms"]["base"], 2), _fmt(r["tpot_p50_ms"]["eagle"], 2),
            _fmt_ratio(r["tpot_p50_ms"]["ratio"]),
            _accept_cell(lv, eagle),
            f"{r['errors']['base']}/{r['errors']['eagle']}",
        ])
    return rows


def detail_table(server: dict[str, Any]) -> list[list[str]]:
    header = ["conc", "requests", "errors", "retried", "tok/s", "per-stream tok/s",
              "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "accept len", "accept len (mean)", "accept rate/pos"]
    rows = [header]
    for lv in server["levels"]:
        rows.append([
            str(lv["concurrency"]), str(lv["requests"]), str(lv["errors"]), str(lv["retried"]),
            _fmt(lv["aggregate_tok_s"]), _fmt(lv["per_stream_tok_s"]),
            "/".join(_fmt(lv["ttft_ms"].get(f"p{q}")) for q in PERCENTILES),
            "/".join(_fmt(lv["tpot_ms"].get(f"p{q}"), 2) for q in PERCENTILES),
            _accept_cell(lv, server), _fmt(lv["accept_length_mean"], 2), _per_pos_cell(lv),
        ])
    return rows


def render_text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def _server_lines(role: str, server: dict[str, Any]) -> list[str]:
    info = server.get("info", {})
    engine = server.get("engine", "sglang")
    spec = info.get("speculative_algorithm") or "none"
    version = f" {info['version']}" if info.get("version") else ""
    lines = [f"{ROLE_TITLES.get(role, role)}: {server['url']} ({engine}{version}, api {server.get('api')}, "
             f"model {info.get('model_path')})", f"  speculative: {spec}"]
    if engine == "vllm":
        if not info.get("stats_enabled", True):
            lines[-1] += " (unknown: no vllm: metrics at /metrics; acceptance not measured)"
        elif spec == "none":
            lines[-1] += " (no spec-decode counters at /metrics: no drafter; acceptance n/a)"
        else:
            lines[-1] += f", draft positions {info.get('speculative_num_steps')}"
        lines.append(f"  max_model_len: {info.get('context_length')}")
    else:
        if spec != "none":
            lines[-1] += (f", steps {info.get('speculative_num_steps')}, topk {info.get('speculative_eagle_topk')}, "
                          f"draft tokens {info.get('speculative_num_draft_tokens')}, "
                          f"draft {info.get('speculative_draft_model_path')}")
        lines.append(f"  max_running_requests: {info.get('max_running_requests')}, cuda_graph_max_bs: "
                     f"{info.get('cuda_graph_max_bs')}, context_length: {info.get('context_length')}")
    if info.get("avg_spec_accept_length") is not None:
        lines.append(f"  server avg_spec_accept_length (cumulative since server start): "
                     f"{info['avg_spec_accept_length']:.2f}")
    lines += [f"  WARNING: {w}" for w in server.get("warnings", [])]
    return lines


def render_report_text(report: dict[str, Any]) -> str:
    parts = []
    for role, server in report["servers"].items():
        parts += _server_lines(role, server)
    if report["comparison"]:
        parts += ["", "Side by side (ratio = EAGLE-3 / base):", render_text(comparison_table(report))]
    for role, server in report["servers"].items():
        parts += ["", f"{ROLE_TITLES.get(role, role)} details:", render_text(detail_table(server))]
    if any(_sglang_openai(srv) for srv in report["servers"].values()):
        parts += ["", OPENAI_NOTE]
    s = report["settings"]
    parts += ["", f"max_tokens {s.get('max_tokens')}, temperature {s.get('temperature')}, "
                  f"prompts: {s.get('prompts')} ({s.get('num_prompts')}); accept len = tokens per verify round "
                  "(SGLang: Σ tokens / Σ spec_verify_ct; vLLM: 1 + accepted / drafts from /metrics)"]
    return "\n".join(parts)


def render_markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    out = ["# Serving benchmark", "",
           f"Prompts: `{s.get('prompts')}` ({s.get('num_prompts')}), max tokens {s.get('max_tokens')}, "
           f"temperature {s.get('temperature')}, concurrency {s.get('concurrency')}.", ""]
    for role, server in report["servers"].items():
        out += ["    " + line for line in _server_lines(role, server)] + [""]
    if report["comparison"]:
        out += ["## Side by side (ratio = EAGLE-3 / base)", "", render_markdown_table(comparison_table(report)), ""]
    for role, server in report["servers"].items():
        out += [f"## {ROLE_TITLES.get(role, role)}", "", render_markdown_table(detail_table(server)), ""]
    if any(_sglang_openai(srv) for srv in report["servers"].values()):
        out += [OPENAI_NOTE, ""]
    out += ["Definitions: " + "; ".join(f"{k}: {v}" for k, v in report["definitions"].items()), ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Files (temp name, then rename: a reader never sees half a file)


def write_json(report: dict[str, Any], path: Path) -> None:
    atomic_write_bytes(path, (json.dumps(report, indent=2, sort_keys=False) + "\n").encode())


def write_markdown(report: dict[str, Any], path: Path) -> None:
    atomic_write_bytes(path, render_markdown(report).encode())


def tokens_axes(axes: Any) -> None:
    """The two panels of a serving plot (aggregate, per-stream tokens/s) against concurrency on a log2 axis."""
    for ax, title in zip(axes, ("aggregate output tokens/s", "per-stream output tokens/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Aggregate and per-stream tokens/s against concurrency (log2 x axis), one line per server."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for role, server in report["servers"].items():
        levels = [lv for lv in server["levels"] if lv["ok"] > 0]
        xs = [lv["concurrency"] for lv in levels]
        label = f"{ROLE_TITLES.get(role, role)} ({server['url']})"
        axes[0].plot(xs, [lv["aggregate_tok_s"] for lv in levels], marker="o", label=label)
        axes[1].plot(xs, [lv["per_stream_tok_s"] or 0.0 for lv in levels], marker="o", label=label)
    tokens_axes(axes)
    s = report["settings"]
    fig.suptitle(f"max_tokens {s.get('max_tokens')}, prompts {Path(str(s.get('prompts'))).name}", fontsize=9)
    fig.tight_layout()
    atomic_write_png(fig, path)


def exit_for_failed_levels(named_levels: Iterable[tuple[str, list[dict[str, Any]]]]) -> int:
    """The command's exit code: 1, saying where, when any concurrency setting had no successful request."""
    failed = [(name, lv["concurrency"]) for name, levels in named_levels for lv in levels if lv["ok"] == 0]
    if failed:
        print(f"error: no successful request at {failed}", file=sys.stderr)
        return 1
    return 0
