"""eval.engine_walk: the offline walk counts what an engine counts, checked against a step-by-step engine emulation."""

from __future__ import annotations

import pytest
import torch
from helpers_acceptance import _chain_drafts, make_case
from helpers_drafter import tiny_drafter

from eval import engine_walk as ew
from eval import simulate as sim
from redraft.core import answers

STEPS = 3


def _emulate_engine(drafter, ids, aux, tgt, lm, steps, max_new=None):
    """A request loop as vLLM runs it, one request per assistant run, drafting from the prefix only.

    Independent of the batched simulation: each round re-runs the drafter on the committed prefix
    (helpers_acceptance._chain_drafts), verifies against the target rows, commits n + 1 tokens and
    keeps vLLM's counters (num_drafts, num_accepted_tokens, per position). Valid on greedy data
    (the committed tokens are the data tokens).
    """
    n_tok = ids.shape[0]
    rounds = accepted = requests = 0
    per_pos = [0] * steps
    t = 0
    while t < n_tok:
        if not lm[t] or t == 0:
            t += 1
            continue
        a = t
        while t + 1 < n_tok and lm[t + 1]:
            t += 1
        e = t
        stop = e if max_new is None else min(e, a + max_new - 1)
        requests += 1
        last = a  # the prefill produced token a
        while last < stop:
            d = _chain_drafts(drafter, ids, aux, last - 1, steps)
            n = 0
            while n < steps and last + n < n_tok and d[n] == int(tgt[last + n]):
                n += 1
            rounds += 1
            accepted += n
            for i in range(n):
                per_pos[i] += 1
            last += n + 1
        t += 1
    return {"rounds": rounds, "accepted": accepted, "per_pos": per_pos, "requests": requests}


@pytest.fixture(scope="module")
def greedy_case():
    drafter = tiny_drafter(3).eval()
    case = make_case(drafter, [26, 19, 15, 11], steps=STEPS, seed=7, agree=0.9, follow=1.0)
    chain, _ = sim.simulate_chain_greedy(drafter, input_ids=case["input_ids"], aux_hidden=case["aux_hidden"],
                                         attention_mask=case["attention_mask"], loss_mask=case["loss_mask"],
                                         target_ids=case["target_ids"], steps=STEPS)
    return drafter, case, chain


def _drafts_rows(chain, b, seq):
    rows = torch.full((seq, STEPS), -1, dtype=torch.int64)
    sel = chain.sample == b
    rows[chain.position[sel]] = chain.drafts[sel]
    return rows


@pytest.mark.parametrize("max_new", [None, 5])
def test_walk_equals_engine_emulation(greedy_case, max_new):
    drafter, case, chain = greedy_case
    total = ew.WalkStats(STEPS)
    ref = {"rounds": 0, "accepted": 0, "per_pos": [0] * STEPS, "requests": 0}
    for b in range(case["input_ids"].shape[0]):
        n = int(case["attention_mask"][b].sum())
        ids, tgt, lm = case["input_ids"][b, :n], case["target_ids"][b, :n], case["loss_mask"][b, :n]
        total += ew.walk_chain(_drafts_rows(chain, b, case["input_ids"].shape[1])[:n], ids, tgt, lm,
                               max_new_tokens=max_new)
        r = _emulate_engine(drafter, ids, case["aux_hidden"][b, :n], tgt, lm, STEPS, max_new)
        for k in ("rounds", "accepted", "requests"):
            ref[k] += r[k]
        ref["per_pos"] = [x + y for x, y in zip(ref["per_pos"], r["per_pos"], strict=True)]
    assert total.rounds == ref["rounds"] and total.accepted == ref["accepted"]
    assert total.accepted_per_pos == ref["per_pos"] and total.requests == ref["requests"]
    assert total.accepted > 0 and total.off_path == 0  # the case is built to accept; greedy data stays on path
    assert total.tau == pytest.approx(1 + ref["accepted"] / ref["rounds"])


def test_walk_is_not_the_per_position_mean(greedy_case):
    """Positions inside accepted runs are skipped by the engine: the two estimators differ on the same drafts."""
    _, case, chain = greedy_case
    total = ew.WalkStats(STEPS)
    for b in range(case["input_ids"].shape[0]):
        n = int(case["attention_mask"][b].sum())
        total += ew.walk_chain(_drafts_rows(chain, b, case["input_ids"].shape[1])[:n], case["input_ids"][b, :n],
                               case["target_ids"][b, :n], case["loss_mask"][b, :n])
    per_position = 1 + float(chain.accepted.double().mean())
    assert total.rounds < len(chain.sample)
    assert abs(total.tau - per_position) > 1e-3


def test_walk_accepted_follows_the_counts():
    """Accept n at the visited position, move n + 1; the stop cuts the output but not the counters (vLLM)."""
    lm = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)  # one answer: tokens 2..8
    ids, argmax = torch.arange(10), torch.arange(1, 11)  # greedy data: every token is the previous argmax
    acc = torch.full((10,), -1)
    acc[1], acc[4], acc[6] = 2, 1, 3  # positions the walk visits: 1 -> 1+3=4 -> 4+2=6 -> stop
    st = ew.walk_accepted(acc, ids, argmax, lm, 3)
    assert (st.rounds, st.accepted, st.accepted_per_pos) == (3, 6, [3, 2, 1])
    assert st.output_tokens == 7  # tokens 2..8, the last round's extra accepted drafts cut
    assert st.request_tau_sum == pytest.approx(7 / 3)
    capped = ew.walk_accepted(acc, ids, argmax, lm, 3, max_new_tokens=3)  # tokens 2..4: one round is enough
    assert (capped.rounds, capped.output_tokens) == (1, 3)
    cut = argmax.clone()
    cut[7] = 0  # the stored last token (8) is not the argmax: an answer cut at generation, closed by the template
    assert answers.engine_stop(ids.tolist(), cut.tolist(), 2, 8) == 7
    st_cut = ew.walk_accepted(acc, ids, cut, lm, 3)
    assert (st_cut.rounds, st_cut.output_tokens) == (2, 6)  # 1 -> 4 -> 7, the new stop
    assert ew.argmax_agreement(ids, cut, lm) == (6, 6)  # the cut token is not one the engine returns
    with pytest.raises(ValueError, match="drafting position 1"):
        ew.walk_accepted(torch.full((10,), -1), ids, argmax, lm, 3)


def test_answer_runs_and_agreement():
    lm = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert answers.answer_runs(lm) == [(2, 3), (5, 5)]  # a run at index 0 has no prompt
    ids = torch.tensor([5, 6, 7, 8, 9, 4])
    argmax = torch.tensor([6, 0, 8, 0, 3, 0])
    # token 2 is off the argmax, 3 follows it (and ends its answer), 5 is a one-token answer (the prefill's)
    assert ew.argmax_agreement(ids, argmax, lm) == (1, 3)
    argmax[2] = 0  # now answer (2, 3) ends off the argmax: a cut answer's closing token, not counted
    assert ew.argmax_agreement(ids, argmax, lm) == (0, 2)


def test_tau_by_position_bucket_counts_each_round_where_it_drafts():
    """A 20K-token sample whose one answer starts at 1,000: chains drafted from rows below 4,096 accept 2 drafts,
    from rows below 16,384 one, beyond none. Counted by hand: the prefill commits token 1,000, so the first round
    drafts from row 999, and each round moves n + 1 rows; the last round drafts from row 19,997 (the answer's
    last token, 19,999, is produced, not drafted from)."""
    seq, start = 20_000, 1_000
    ids = torch.arange(seq) % 97
    argmax = torch.roll(ids, -1)  # every answer token is the target's argmax: no stop, no off-path
    loss_mask = torch.zeros(seq, dtype=torch.long)
    loss_mask[start:] = 1
    accepted = torch.tensor([2 if p < 4096 else 1 if p < 16_384 else 0 for p in range(seq)])
    st = ew.walk_accepted(accepted, ids, argmax, loss_mask, steps=3)
    low = range(start - 1, 4096, 3)
    mid = range(low[-1] + 3, 16_384, 2)
    high = range(mid[-1] + 2, seq - 2)
    buckets = st.tau_by_position()
    assert [buckets[name]["rounds"] for name in ("0-4K", "4K-16K", "16K+")] == [len(low), len(mid), len(high)]
    assert buckets["0-4K"]["tau"] == 3.0 and buckets["4K-16K"]["tau"] == 2.0 and buckets["16K+"]["tau"] == 1.0
    assert sum(b["rounds"] for b in buckets.values()) == st.rounds


def test_a_set_meant_to_be_long_fails_when_no_round_drafts_past_its_bucket():
    """eval.engine_truth --require-bucket: the long set's check that it reaches the positions it is for."""
    from eval.engine_truth import bucket_problem

    ids = torch.arange(600) % 97
    loss_mask = torch.zeros(600, dtype=torch.long)
    loss_mask[100:] = 1
    st = ew.walk_accepted(torch.ones(600, dtype=torch.long), ids, torch.roll(ids, -1), loss_mask, steps=3)
    off = {"engine_walk": {"tau_by_position": st.tau_by_position()}}
    assert bucket_problem(off, "0-4K") is None and bucket_problem(off, None) is None
    assert "positions 4K-16K" in bucket_problem(off, "4K-16K")
