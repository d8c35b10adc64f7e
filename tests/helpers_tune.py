"""What every redraft.pipeline.tune end-to-end test (serve.tune at its end) holds of its report, whichever engine ran the
sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS, CONC, PROMPTS, MAX_TOKENS = (2,), (1, 2), 3, 16


def tune_args(ckpt: Path, target: Path, out: Path, py: str, engine: str) -> list[str]:
    """A tiny sweep: 3 MT-bench prompts answered by the target, probe base and k2, sweep base and k2 at
    concurrency 1 and 2, one repeat (two server starts, each probed then swept; the choice among several k is
    serve.tune's unit tests')."""
    return [str(ckpt), "--target", str(target), "--prompts", "mtbench", "--engine", engine,
            "--num-prompts", str(PROMPTS), "--max-tokens", str(MAX_TOKENS), "--steps", ",".join(map(str, STEPS)),
            "--probe-steps", "2", "--probe-prompts", "2", "--concurrency", "1,2", "--repeats", "1",
            "--warmup", "1", "--regen-backend", "hf", "--max-model-len", "1024",
            "--kv-cache-bytes", str(1 << 28), "--engine-python", py, "--timeout", "120", "--out", str(out)]


def check_report(out: Path, printed: str) -> dict:
    """The report held to the engine's counters and to its own definitions; returns it."""
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] and report["engine_version"]
    assert report["traffic"]["samples"] == PROMPTS and report["traffic"]["max_tokens"] == MAX_TOKENS

    # the probes: base and k2; the sweep: base, then each k in order; one start per setting, probed then swept
    assert [r["server"] for r in report["probes"]["runs"]] == ["probe-base", "probe-k2"]
    assert [(r["repeat"], r["server"]) for r in report["sweep"]["runs"]] == [(0, "base")] + [(0, f"k{k}") for k in STEPS]
    assert [r["after"] for r in report["probes"]["runs"]] == [None, None]
    assert [r["after"] for r in report["sweep"]["runs"]] == ["probe-base", "probe-k2"]
    for run in report["probes"]["runs"] + report["sweep"]["runs"]:
        k = int(run["server"].rsplit("k", 1)[1]) if run["server"].endswith(("k1", "k2")) else 0
        assert [lv["concurrency"] for lv in run["result"]["levels"]] == list(CONC)
        for lv in run["result"]["levels"]:
            assert lv["ok"] and lv["errors"] == 0
            c = lv["spec_counts"]
            if k == 0:
                assert c is None and lv["accept_length"] is None
                continue
            assert c["num_drafts"] > 0 and c["num_draft_tokens"] == k * c["num_drafts"]
            assert len(c["num_accepted_tokens_per_pos"]) == k
            if report.get("engine") == "sglang":  # its own per-request ratio (prefill token in); tau pooled below
                assert lv["accept_source"] == "meta_info" and lv["accept_coverage"] == 1.0
            else:
                assert lv["accept_length"] == pytest.approx(1 + c["num_accepted_tokens"] / c["num_drafts"])

    # the engine walks the same prompts as eval.acceptance: tau at concurrency 1 within rounding of the counters
    ans = report["answer"]
    offline = {int(k): v for k, v in report["offline"]["tau"].items()}
    c1 = next(e for e in ans["per_concurrency"] if e["concurrency"] == 1)
    for row in c1["settings"]:
        assert row["tau_offline"] == pytest.approx(offline[row["k"]])
        assert abs(row["tau_engine"] - row["tau_offline"]) <= 0.02, row

    # the prediction is tau_offline(k) x u0 / (a + b k) from the step costs, one probe: a = u0
    for c, cost in report["costs"].items():
        assert cost["fixed"] == pytest.approx(cost["base"])
        assert cost["per_draft"] == pytest.approx((cost["probes"]["2"] - cost["base"]) / 2)
        for k in STEPS:
            expect = offline[k] * cost["base"] / (cost["fixed"] + cost["per_draft"] * k)
            assert report["predicted"][c][str(k)] == pytest.approx(expect)

    # best and crossover follow the measured medians
    for e in ans["per_concurrency"]:
        medians = {r["k"]: r["speedup"]["median"] for r in e["settings"]}
        paying = {k: m for k, m in medians.items() if m > 1}
        assert e["best"] == (max(paying, key=paying.get) if paying else None)
        for r in e["settings"]:
            assert r["error"] == pytest.approx(r["predicted"] / r["speedup"]["median"] - 1)
    concs = [e["concurrency"] for e in ans["per_concurrency"]]
    pays = [e["best"] is not None for e in ans["per_concurrency"]]
    if not any(pays):
        assert ans["no_gain_from"] == 1 and report["recommendation"] is None
    elif pays[-1]:
        assert ans["no_gain_from"] is None
    else:
        last = max(i for i, p in enumerate(pays) if p)
        assert ans["no_gain_from"] == concs[last + 1]
    if report["recommendation"]:
        rec = report["recommendation"]
        assert f"--speculative-num-steps {rec['k']} " in rec["sglang"]
        assert f"--max-running-requests {rec['max_running_requests']} " in rec["sglang"]
        assert f'"num_speculative_tokens": {rec["k"]}' in rec["vllm"]
        assert f"--max-num-seqs {rec['max_running_requests']}" in rec["vllm"]

    md = (out / "report.md").read_text()
    assert (out / "report.png").stat().st_size > 0
    for text in (printed, md):
        assert "| conc | setting |" in text and "| 1 | k2 |" in text


    return report
