"""vLLM's /metrics read by serve.acceptance, on text captured from a real vLLM CPU 0.32.0 server.

The captures (tests/data/vllm_metrics_*.txt, each with a header saying how it was made): an EAGLE-3 server
just started, the same server after 9 requests, a base server (no drafter) after the same requests, and a
server started with --disable-log-stats. The
expected values are read from the text by a deliberately naive reader here (the last field of the sample
line), not by the parser under test.
"""

from __future__ import annotations

import pytest
from helpers_paths import DATA

from serve.acceptance import (
    MetricsError,
    SpecCounters,
    counters_delta,
    parse_prometheus,
    spec_counters,
    vllm_info,
    vllm_warnings,
)
from serve.report import LevelStats, apply_counter_delta, build_report, render_report_text, summarize


def text(name: str) -> str:
    return (DATA / f"vllm_metrics_{name}.txt").read_text()


def naive(txt: str, name: str, position: int | None = None) -> float:
    """The value of the one sample of ``name`` (and ``position``), by string search."""
    hits = [line for line in txt.splitlines() if line.startswith(name + "{")
            and (position is None or f'position="{position}"' in line)]
    assert len(hits) == 1, (name, position, hits)
    return float(hits[0].rsplit(" ", 1)[1])


def test_every_sample_line_is_parsed():
    for name in ("eagle_before", "eagle_after", "base", "nostats"):
        txt = text(name)
        lines = [s for s in txt.splitlines() if s.strip() and not s.startswith("#")]
        samples = parse_prometheus(txt)
        assert len(samples) == len(lines) > 20


def test_counters_are_the_servers_numbers():
    txt = text("eagle_after")
    c = spec_counters(parse_prometheus(txt))
    assert c.stats_enabled and c.speculative
    assert c.num_drafts == naive(txt, "vllm:spec_decode_num_drafts_total") > 0
    assert c.num_draft_tokens == naive(txt, "vllm:spec_decode_num_draft_tokens_total")
    assert c.num_accepted_tokens == naive(txt, "vllm:spec_decode_num_accepted_tokens_total") > 0
    k = len(c.num_accepted_tokens_per_pos)
    assert k == 3  # the server ran num_speculative_tokens 3
    assert c.num_accepted_tokens_per_pos == [naive(txt, "vllm:spec_decode_num_accepted_tokens_per_pos_total", p)
                                             for p in range(k)]
    # the engine's own bookkeeping: K tokens per draft, accepted = the sum over positions
    assert c.num_draft_tokens == k * c.num_drafts
    assert sum(c.num_accepted_tokens_per_pos) == c.num_accepted_tokens


def test_a_fresh_server_has_zero_counters_and_the_delta_is_the_runs():
    before = spec_counters(parse_prometheus(text("eagle_before")))
    after = spec_counters(parse_prometheus(text("eagle_after")))
    assert before.speculative and before.num_drafts == 0 and before.num_accepted_tokens_per_pos == [0, 0, 0]
    d = counters_delta(before, after)
    assert (d.num_drafts, d.num_accepted_tokens) == (after.num_drafts, after.num_accepted_tokens)
    assert d.tau == pytest.approx(1 + after.num_accepted_tokens / after.num_drafts)
    assert d.accept_rate_per_pos == pytest.approx([a / after.num_drafts for a in after.num_accepted_tokens_per_pos])
    assert d.draft_acceptance_rate == pytest.approx(after.num_accepted_tokens / after.num_draft_tokens)
    # a draft token is accepted only after every earlier one was: the rates cannot rise with position
    assert all(x >= y for x, y in zip(d.accept_rate_per_pos, d.accept_rate_per_pos[1:], strict=False))


def test_no_traffic_means_no_acceptance_not_one():
    c = spec_counters(parse_prometheus(text("eagle_after")))
    d = counters_delta(c, c)
    assert d.num_drafts == 0 and d.tau is None and d.accept_rate_per_pos is None


def test_the_base_server_has_no_counters_and_acceptance_is_na():
    base = spec_counters(parse_prometheus(text("base")))
    assert base.stats_enabled and not base.speculative
    assert vllm_warnings("base", base) == []
    assert any("not running a drafter" in w for w in vllm_warnings("eagle", base))
    info = vllm_info({"data": [{"id": "m", "max_model_len": 1024}]}, "0.32.0", base)
    assert info["speculative_algorithm"] is None and info["context_length"] == 1024
    server = {"url": "u", "engine": "vllm", "api": "native", "info": info, "warnings": [],
              "levels": [summarize([], 1, 1.0)]}
    report = build_report({"max_tokens": 8}, {"base": server})
    assert report["servers"]["base"]["levels"][0]["accept_length"] is None
    out = render_report_text(report)
    assert "no drafter; acceptance n/a" in out and "1.00" not in out


def test_a_server_without_statistics_is_said_to_have_them_off():
    txt = text("nostats")  # started with --disable-log-stats
    samples = parse_prometheus(txt)
    assert samples and not any(s.name.startswith("vllm:") for s in samples)
    c = spec_counters(samples)
    assert not c.stats_enabled and not c.speculative
    assert "--disable-log-stats" in vllm_warnings("eagle", c)[0]


def test_counter_delta_sets_the_level_acceptance():
    before = spec_counters(parse_prometheus(text("eagle_before")))
    after = spec_counters(parse_prometheus(text("eagle_after")))
    stats: LevelStats = apply_counter_delta(summarize([], 1, 1.0), counters_delta(before, after))
    assert stats.accept_source == "metrics" and stats.accept_length == pytest.approx(
        1 + after.num_accepted_tokens / after.num_drafts)
    assert stats.spec_counts["num_accepted_tokens_per_pos"] == after.num_accepted_tokens_per_pos


def test_labels_with_escapes_and_bad_lines():
    (s,) = parse_prometheus('m_total{a="x\\"y",b="c\\\\d",position="2"} 4.0 1700000000\n')
    assert s.name == "m_total" and s.label("a") == 'x"y' and s.label("b") == "c\\d" and s.value == 4.0
    with pytest.raises(MetricsError, match="line 2"):
        parse_prometheus("# HELP x\nnot a sample line at all {\n")
    with pytest.raises(MetricsError, match="line 1: bad value"):
        parse_prometheus("x_total 1.0.0\n")


def test_counters_that_go_down_are_refused():
    after = spec_counters(parse_prometheus(text("eagle_after")))
    fresh = SpecCounters(stats_enabled=True, speculative=True, num_accepted_tokens_per_pos=[0, 0, 0])
    with pytest.raises(MetricsError, match="restarted"):
        counters_delta(after, fresh)
