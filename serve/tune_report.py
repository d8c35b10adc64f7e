"""The answer of ``serve.tune``: per concurrency the best setting and its speed-up, where speculation stops
paying, the launch lines, and the cost model's prediction beside every measured ratio.

Definitions (in the report's ``definitions``): a setting's speed-up at concurrency c is the median over
repeats of its aggregate tokens/s over base's in the same repeat (serve.repeats' paired ratio), with the
min and max over repeats; a setting *pays* at c when that median is above 1. The best setting at c is the one
with the highest median. ``no_gain_from`` is the lowest concurrency of the sweep from which on no setting pays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from redraft.core.atomic import atomic_write_text
from redraft.core.plotting import atomic_write_png, pyplot
from serve import doctor_findings
from serve.repeats import BASE, pool_server
from serve.report import render_markdown_table as markdown_table

DEFINITIONS = {
    "speedup": "median over repeats of the setting's aggregate tokens/s / base's in the same repeat (min-max over "
               "repeats); above 1: faster than base",
    "per_stream_speedup": "the same for per-stream tokens/s (mean over requests of tokens / latency)",
    "tau_engine": "1 + accepted / drafts of the engine's own counters (vLLM: /metrics around the setting; SGLang: "
                  "each answer's meta_info), summed over repeats",
    "tau_offline": "eval.acceptance on the same traffic (the engine walk, chain of k drafts)",
    "max_running_requests": "each server's request limit as it reports it (SGLang /server_info: 48 when it "
                            "speculates and none was asked; vLLM reports none here)",
    "predicted": "serve.cost_model: tau_offline(k) x base step / (a + b k), the step costs from the probes",
    "error": "predicted / measured speedup - 1",
    "pays": "the median speed-up is above 1",
    "no_gain_from": "the lowest concurrency of the sweep from which on no setting pays (None: one pays at every "
                    "concurrency measured)",
}


def setting_name(k: int) -> str:
    return f"k{k}"


def answer(sweep_runs: list[dict[str, Any]], ks: list[int], tau_offline: dict[int, float],
           predicted: dict[int, dict[int, float]] | None) -> dict[str, Any]:
    """Per concurrency: every setting's measured and predicted speed-up, the best one; and the crossover."""
    pooled = {name: pool_server(sweep_runs, name) for name in [BASE] + [setting_name(k) for k in ks]}
    concs = [lv["concurrency"] for lv in pooled[BASE]["levels"]]
    per_c = []
    for i, c in enumerate(concs):
        base_lv = pooled[BASE]["levels"][i]
        rows = []
        for k in ks:
            lv = pooled[setting_name(k)]["levels"][i]
            ratio = lv["ratio_to_base"]["aggregate_tok_s"]
            pred = (predicted or {}).get(c, {}).get(k)
            rows.append({
                "k": k, "aggregate_tok_s": lv["aggregate_tok_s"], "speedup": ratio,
                "per_stream_speedup": lv["ratio_to_base"]["per_stream_tok_s"],
                "tau_engine": lv["accept_length"], "accept_per_pos": lv["accept_per_pos"],
                "tau_offline": tau_offline.get(k), "predicted": pred,
                "error": pred / ratio["median"] - 1 if pred is not None and ratio["median"] else None,
                "errors": lv["errors"],
            })
        best = max(rows, key=lambda r: r["speedup"]["median"] or 0.0) if rows else None
        if best is not None and not doctor_findings.pays(best["speedup"]["median"]):
            best = None  # the doctor's rule
        per_c.append({"concurrency": c, "base_tok_s": base_lv["aggregate_tok_s"], "settings": rows,
                      "best": best["k"] if best else None,
                      "best_speedup": best["speedup"] if best else None})
    no_gain_from = doctor_findings.where_it_pays(
        [(e["concurrency"], e["best_speedup"]["median"] if e["best_speedup"] else 0.0) for e in per_c])["no_gain_from"]
    return {"per_concurrency": per_c, "no_gain_from": no_gain_from, "pooled": pooled}


def recommendation(ans: dict[str, Any], target: str, drafters: dict[str, str], tp: int = 1,
                   trust_remote_code: bool = False) -> dict[str, Any] | None:
    """The best setting at the lowest concurrency where one pays, served up to the highest concurrency at
    which that same setting still pays: the SGLang and vLLM launch lines with those limits, each engine pointed
    at its own export (``drafters``: engine -> folder; the engines read aux layer ids differently, redraft.core.layers);
    None for an engine without an export."""
    from redraft.engines.launch import ENGINES, LaunchPlan, launch_command

    first = next((e for e in ans["per_concurrency"] if e["best"] is not None), None)
    if first is None:
        return None
    k = first["best"]
    limit = max(e["concurrency"] for e in ans["per_concurrency"]
                if any(r["k"] == k and (r["speedup"]["median"] or 0) > 1.0 for r in e["settings"]))
    plan = LaunchPlan(steps=k, topk=1, tp=tp, max_running_requests=limit, trust_remote_code=trust_remote_code)
    lines = {e: launch_command(e, target, drafters[e], plan) if e in drafters else None for e in ENGINES}
    return {"k": k, "max_running_requests": limit, **lines}


# ----------------------------------------------------------------------------- rendering


def pays_sentence(ans: dict[str, Any]) -> str:
    """Where a setting beats base, said of exactly the concurrencies measured (none, some or all), in the doctor's
    words (serve.doctor_findings: one rule, one sentence)."""
    verdict = {"pays": [e["concurrency"] for e in ans["per_concurrency"] if e["best"] is not None],
               "loses": [e["concurrency"] for e in ans["per_concurrency"] if e["best"] is None],
               "no_gain_from": ans["no_gain_from"]}
    return doctor_findings.pays_sentence(verdict)


def _f(v: Any, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def _x(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "n/a"
    if len(s["values"]) == 1:
        return f"{s['median']:.2f}x"
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def answer_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [["conc", "base tok/s", "best", "speed-up (min-max)", "pays"]]
    for e in report["answer"]["per_concurrency"]:
        rows.append([str(e["concurrency"]), _f(e["base_tok_s"]["median"], 1),
                     setting_name(e["best"]) if e["best"] else "base (none pays)", _x(e["best_speedup"]),
                     "yes" if e["best"] else "no"])
    return rows


def detail_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [["conc", "setting", "tok/s", "speed-up (min-max)", "per-stream", "predicted", "error", "tau engine",
             "tau offline", "accept/pos (engine)"]]
    for e in report["answer"]["per_concurrency"]:
        rows.append([str(e["concurrency"]), "base", _f(e["base_tok_s"]["median"], 1), "1.00x", "", "", "", "", "",
                     ""])
        for r in e["settings"]:
            rows.append([str(e["concurrency"]), setting_name(r["k"]), _f(r["aggregate_tok_s"]["median"], 1),
                         _x(r["speedup"]), _x(r["per_stream_speedup"]),
                         "n/a" if r["predicted"] is None else f"{r['predicted']:.2f}x",
                         "n/a" if r["error"] is None else f"{100 * r['error']:+.1f}%",
                         _f(r["tau_engine"], 3), _f(r["tau_offline"], 3),
                         "/".join(f"{a:.2f}" for a in r["accept_per_pos"]) if r["accept_per_pos"] else "n/a"])
    return rows


def cost_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = [["conc", "base step ms", "spec step a ms", "per draft b ms", "probes (k: ms)"]]
    for c, s in (report.get("costs") or {}).items():
        rows.append([c, _f(1e3 * s["base"], 1), _f(1e3 * s["fixed"], 1), _f(1e3 * s["per_draft"], 2),
                     ", ".join(f"{k}: {1e3 * u:.1f}" for k, u in sorted(s["probes"].items(), key=lambda x: int(x[0])))])
    return rows


def markdown(report: dict[str, Any]) -> str:
    s, t = report["settings"], report["traffic"]
    lines = ["# Speculative settings that pay: serve.tune", "",
             f"Drafter `{s['drafter']}` on target `{s['target']}`, "
             f"{'SGLang' if report.get('engine') == 'sglang' else 'vLLM'} {report.get('engine_version') or '?'}, dtype "
             f"{s['dtype']}. Traffic: {t['samples']} samples of `{t['source']}` answered by the target "
             f"({t['requests']} requests, max {t['max_tokens']} new tokens, greedy); settings "
             f"num_speculative_tokens {s['steps']}; concurrency {s['concurrency']}; {s['repeats']} interleaved "
             f"repeat(s) on fresh servers.", "", f"Command: `{s['command']}`; {s['cpus']} CPUs.", ""]
    ans = report["answer"]
    if ans is None:
        lines += ["Prediction only (`--predict-only`): no sweep was run.", ""]
    else:
        lines += ["## The answer", "", markdown_table(answer_rows(report)), ""]
        lines.append(pays_sentence(ans))
        rec = report.get("recommendation")
        if rec:
            launch = [rec[e] or f"# no {e} export given: python -m eval.export CKPT OUT --format {e}"
                      for e in ("sglang", "vllm")]
            lines += ["", f"Serve with k = {rec['k']} up to {rec['max_running_requests']} concurrent requests "
                      "(the highest concurrency measured at which it still beats base):", "", "```",
                      launch[0], "", launch[1], "```"]
        limits = report.get("max_running_requests") or {}
        if any(v is not None for v in limits.values()):
            lines += ["", "max_running_requests as each server reported it: "
                      + ", ".join(f"{name} {v}" for name, v in limits.items()) + "."]
        lines += ["", "## Every setting (median over repeats, min-max in brackets)", "",
                  markdown_table(detail_rows(report)), ""]
    if report.get("costs"):
        lines += ["## The cost model", "", "Step costs per stream from the probes (serve/cost_model.py): ", "",
                  markdown_table(cost_rows(report)), ""]
        if ans is None:
            pred = report["predicted"]
            rows = [["conc", *(setting_name(k) for k in s["steps"])]]
            rows += [[c, *(f"{pred[c][str(k)]:.2f}x" for k in s["steps"])] for c in pred]
            lines += [markdown_table(rows), ""]
    off = report["offline"]
    lines += [f"Offline tau per chain length ({off['evaluation']}, {off['samples']} samples): "
              + ", ".join(f"k{k}: {v:.3f}" for k, v in sorted(off["tau"].items(), key=lambda x: int(x[0]))), "",
              "Definitions:", ""]
    lines += [f"- {k}: {v}" for k, v in report["definitions"].items()]
    return "\n".join(lines) + "\n"


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Speed-up over base against concurrency per setting: measured (median, min-max bars) and predicted (dashed)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    per_c = report["answer"]["per_concurrency"]
    xs = [e["concurrency"] for e in per_c]
    for i, k in enumerate(report["settings"]["steps"]):
        rows = [next(r for r in e["settings"] if r["k"] == k) for e in per_c]
        med = [r["speedup"]["median"] or 0.0 for r in rows]
        lo = [m - (r["speedup"]["min"] or m) for m, r in zip(med, rows, strict=True)]
        hi = [(r["speedup"]["max"] or m) - m for m, r in zip(med, rows, strict=True)]
        color = f"C{i}"
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, color=color, label=f"k={k} measured")
        if all(r["predicted"] is not None for r in rows):
            ax.plot(xs, [r["predicted"] for r in rows], linestyle="--", color=color, alpha=0.7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s / base (dashed: predicted)")
    ax.legend(fontsize=8)
    fig.suptitle(f"serve.tune: {Path(report['settings']['drafter']).name} on {Path(report['traffic']['source']).name}",
                 fontsize=9)
    fig.tight_layout()
    atomic_write_png(fig, path)


def write_outputs(report: dict[str, Any], out: Path, plot: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / "report.md", markdown(report))
    if plot and report.get("answer"):
        write_plot(report, out / "report.png")
