"""benchmarks/serving_gain_report.py pools interleaved repeats: counters summed (not τ averaged), paired ratios.

The per-repeat levels are made by serve.bench's own statistics (summarize, apply_counter_delta) from
request results and counter differences chosen here, so the pooled numbers can be worked out by hand.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
from serving_gain_report import detail_rows, headline_rows, markdown, summarize

from serve.acceptance import SpecDelta
from serve.report import RequestResult, apply_counter_delta
from serve.report import summarize as level_stats


def _level(c: int, tokens: int, seconds: float, counts: tuple[int, int, list[int]] | None) -> dict:
    results = [RequestResult(ok=True, latency_s=seconds, ttft_s=0.1, completion_tokens=tokens) for _ in range(c)]
    stats = level_stats(results, c, seconds)
    if counts is not None:
        drafts, accepted, per_pos = counts
        stats = apply_counter_delta(stats, SpecDelta(drafts, 3 * drafts, accepted, per_pos, 1 + accepted / drafts,
                                                     [a / drafts for a in per_pos], accepted / (3 * drafts)))
    return asdict(stats)


def _run(repeat: int, server: str, startup: float, levels: list[dict]) -> dict:
    return {"repeat": repeat, "server": server, "startup_s": startup,
            "result": {"levels": levels, "info": {"version": "x"}, "warnings": []}}


def test_repeats_pool_by_counters_and_pair_by_repeat():
    runs = [
        _run(0, "base", 30.0, [_level(1, 100, 10.0, None), _level(4, 100, 5.0, None)]),
        _run(0, "A", 40.0, [_level(1, 100, 20.0, (90, 10, [9, 1, 0])), _level(4, 100, 8.0, (300, 30, [25, 5, 0]))]),
        _run(1, "base", 50.0, [_level(1, 100, 12.5, None), _level(4, 100, 4.0, None)]),
        _run(1, "A", 44.0, [_level(1, 100, 12.5, (10, 8, [6, 2, 0])), _level(4, 100, 10.0, (100, 10, [10, 0, 0]))]),
    ]
    s = summarize(runs, ["base", "A"])
    assert s["base"]["startup_s"]["values"] == [30.0, 50.0] and s["A"]["startup_s"]["median"] == 42.0
    base1, a1 = s["base"]["levels"][0], s["A"]["levels"][0]
    assert base1["accept_length"] is None and base1["spec_counts"] is None and s["base"]["accept_length"] is None
    # counters summed over repeats: (10 + 8) / (90 + 10), not the mean of the repeats' τ (1.11 and 1.8)
    assert a1["spec_counts"]["num_drafts"] == 100 and a1["spec_counts"]["num_accepted_tokens_per_pos"] == [15, 3, 0]
    assert a1["accept_length"] == pytest.approx(1.18) and a1["accept_per_pos"] == pytest.approx([0.15, 0.03, 0.0])
    assert a1["output_tokens"] == 200 and a1["requests"] == 2
    # tok/s: 10 and 8 per repeat for base, 5 and 8 for A; paired ratios 0.5 and 1.0
    assert base1["aggregate_tok_s"]["median"] == pytest.approx(9.0)
    assert a1["ratio_to_base"]["aggregate_tok_s"]["values"] == pytest.approx([0.5, 1.0])
    assert a1["ratio_to_base"]["aggregate_tok_s"]["median"] == pytest.approx(0.75)
    # concurrency 4 (4 requests of 100 tokens): base 80 and 100 tok/s, A 50 and 40; both peak there
    assert s["base"]["peak_tok_s"] == pytest.approx(90.0) and s["base"]["peak_concurrency"] == 4
    assert s["A"]["peak_tok_s"] == pytest.approx(45.0) and s["A"]["peak_ratio"] == pytest.approx(0.5)
    assert s["A"]["single_stream_ratio"] == pytest.approx(6.5 / 9.0)
    assert s["A"]["accept_length"] == pytest.approx(1.18)

    report = {"summary": s, "servers": {"base": {"label": "no drafter", "source": None, "how": ""},
                                        "A": {"label": "mismatched (A)", "source": "a", "how": "given"}},
              "settings": {"target": "t", "engine_python": "py", "dtype": "float32", "steps": 3, "num_prompts": 1,
                           "max_tokens": 100, "concurrency": [1, 4], "repeats": 2, "servers": ["base", "A"]},
              "definitions": {}, "vllm_version": "x"}
    head = headline_rows(report)
    assert head[1][:3] == ["base", "no drafter", "9.0"] and head[2][6] == "1.180"
    rows = detail_rows(report)
    assert [r[:2] for r in rows[1:]] == [["1", "base"], ["1", "A"], ["4", "base"], ["4", "A"]]
    assert rows[2][2] == "6.5 (5.0-8.0)" and rows[2][3] == "0.75x" and rows[1][8] == "n/a"
    assert "| A | mismatched (A) |" in markdown(report)
