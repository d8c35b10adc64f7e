"""serve.cost_model and serve.tune_report on numbers made here: the cost fit, the prediction, the answer's rules."""

from __future__ import annotations

import pytest

from serve import cost_model as tm
from serve.tune_report import answer, pays_sentence, recommendation


def test_the_fit_recovers_a_linear_step_cost_and_predicts_from_offline_tau():
    base, a, b = 0.060, 0.068, 0.007
    probes = {0: base, 1: a + b, 3: a + 3 * b, 5: a + 5 * b}
    cost = tm.fit(1, probes)
    assert cost.fixed == pytest.approx(a) and cost.per_draft == pytest.approx(b) and cost.base == base
    tau = {1: 1.6, 2: 1.9, 3: 2.05}
    pred = tm.predict({1: cost}, tau, [1, 2, 3])[1]
    for k, t in tau.items():
        assert pred[k] == pytest.approx(t * base / (a + b * k))
    assert pred[2] > pred[1]  # with these costs the second draft still pays


def test_one_speculative_probe_puts_the_fixed_cost_at_base():
    cost = tm.fit(4, {0: 0.1, 4: 0.14})
    assert cost.fixed == pytest.approx(0.1) and cost.per_draft == pytest.approx(0.01)


def test_probes_become_step_costs_per_stream():
    def lv(c, rate, tau):
        return {"concurrency": c, "aggregate_tok_s": {"median": rate}, "accept_length": tau}

    summary = {"b": {"levels": [lv(1, 20.0, None), lv(4, 60.0, None)]},
               "s2": {"levels": [lv(1, 25.0, 1.5), lv(4, 50.0, 1.5)]}}
    costs = tm.costs_from_probes(summary, {0: "b", 2: "s2"})
    assert costs[1].probes == {0: pytest.approx(1 / 20), 2: pytest.approx(1.5 / 25)}
    assert costs[4].probes[2] == pytest.approx(1.5 / 50)
    with pytest.raises(tm.ModelError, match="no base probe"):
        tm.fit(1, {2: 0.1})
    with pytest.raises(tm.ModelError, match="reported no acceptance"):
        tm.costs_from_probes({"b": summary["b"], "s2": {"levels": [lv(1, 25.0, None)]}}, {0: "b", 2: "s2"})
    with pytest.raises(tm.ModelError, match="no offline tau"):
        tm.predict(costs, {1: 1.2}, [2])


def _run(repeat, server, rates):
    return {"repeat": repeat, "server": server, "startup_s": 1.0, "result": {"levels": [
        {"concurrency": c, "ok": True, "requests": 4, "errors": 0, "output_tokens": 64, "aggregate_tok_s": r,
         "per_stream_tok_s": r / c, "ttft_ms": {}, "tpot_ms": {}, "spec_counts": None}
        for c, r in rates.items()]}}


def test_the_answer_picks_the_best_paying_setting_and_the_crossover():
    runs = []
    for rep, jitter in ((0, 1.0), (1, 1.1)):
        runs += [_run(rep, "base", {1: 10 * jitter, 4: 30 * jitter, 16: 80 * jitter}),
                 _run(rep, "k1", {1: 12 * jitter, 4: 31 * jitter, 16: 60 * jitter}),
                 _run(rep, "k2", {1: 13 * jitter, 4: 29 * jitter, 16: 50 * jitter})]
    ans = answer(runs, [1, 2], {1: 1.3, 2: 1.4}, {1: {1: 1.25, 2: 1.2}})
    best = {e["concurrency"]: e["best"] for e in ans["per_concurrency"]}
    assert best == {1: 2, 4: 1, 16: None} and ans["no_gain_from"] == 16
    row = next(r for r in ans["per_concurrency"][0]["settings"] if r["k"] == 2)
    assert row["speedup"]["median"] == pytest.approx(1.3) and row["error"] == pytest.approx(1.2 / 1.3 - 1)
    rec = recommendation(ans, "/models/t", {"sglang": "/drafts/d-sglang", "vllm": "/drafts/d-vllm"})
    # k2 is best at concurrency 1 and pays nowhere else: served up to 1 request, limits explicit in both lines
    assert rec["k"] == 2 and rec["max_running_requests"] == 1
    assert "--speculative-num-steps 2" in rec["sglang"] and "--speculative-num-draft-tokens 3" in rec["sglang"]
    assert "--max-running-requests 1" in rec["sglang"] and "--max-num-seqs 1" in rec["vllm"]
    assert '"num_speculative_tokens": 2' in rec["vllm"]
    # each engine at its own export: their aux layer ids differ by one for the same drafter (redraft.core.layers)
    assert "/drafts/d-sglang" in rec["sglang"] and "/drafts/d-vllm" not in rec["sglang"]
    assert "/drafts/d-vllm" in rec["vllm"] and "/drafts/d-sglang" not in rec["vllm"]


def test_the_sentence_says_where_a_setting_pays_of_exactly_the_concurrencies_measured():
    def ans(best_by_c, ngf):
        return {"per_concurrency": [{"concurrency": c, "best": b} for c, b in best_by_c.items()],
                "no_gain_from": ngf}

    # the SGLang tune report's case: nothing pays at 1 stream, k1 does at 4 (the sentence once said "every")
    assert pays_sentence(ans({1: None, 4: 1}, None)) == ("A setting beats base at concurrency 4; none does at 1.")
    assert pays_sentence(ans({1: 2, 4: 1}, None)) == "A setting beats base at every concurrency measured."
    assert pays_sentence(ans({1: None, 4: None}, 1)).startswith("No setting beats base at any concurrency")
    assert pays_sentence(ans({1: 2, 4: None, 16: None}, 4)).endswith("None beats base from concurrency 4 on.")


def test_a_recommendation_without_an_engines_export_leaves_its_line_out():
    runs = [_run(0, "base", {1: 10}), _run(0, "k1", {1: 12})]
    rec = recommendation(answer(runs, [1], {1: 1.3}, None), "/models/t", {"vllm": "/drafts/d-vllm"})
    assert rec["sglang"] is None and "/drafts/d-vllm" in rec["vllm"]
