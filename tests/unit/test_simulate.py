"""eval.simulate against literal brute-force references (one position at a time, explicit key lists)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers_acceptance import make_case
from helpers_drafter import tiny_drafter

from eval import simulate as sim

STEPS = 4


# ----------------------------------------------------------------------------- brute-force reference


def ref_token(drafter, tok: int, hidden: torch.Tensor, pos: int, keys: list, values: list):
    """One midlayer application for ONE token attending to ``keys`` (explicit list) plus its own key."""
    c = drafter.config
    mid, attn = drafter.midlayer, drafter.midlayer.self_attn
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    emb = drafter.embed_tokens.weight[tok]
    x = torch.cat((mid.input_layernorm(emb), mid.hidden_norm(hidden)))
    if c.attention == "mla":  # its projection is held against transformers' DeepSeek-V3 (test_mla_drafter)
        cos, sin = drafter.rope_cos_sin(torch.tensor([[pos]]), x.dtype)
        q, k, v = (t[0, 0] for t in attn.project(x[None, None], cos, sin))
        q, scale = q[:, 0], attn.softmax_scale
    else:
        q = attn.q_proj(x).view(nh, hd)
        k = attn.k_proj(x).view(nkv, hd)
        v = attn.v_proj(x).view(nkv, hd)
        cos, sin = drafter.rope_cos_sin(torch.tensor([[pos]]), q.dtype)
        cos, sin = cos[0], sin[0]  # [1, hd]

        def rot(t):
            half = hd // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

        q, k, scale = rot(q), rot(k), 1 / math.sqrt(hd)
    ks, vs = torch.stack([*keys, k]), torch.stack([*values, v])  # [A, nkv, hd]
    out = []
    for h in range(nh):
        kv = h // (nh // nkv)
        p = torch.softmax(ks[:, kv] @ q[h] * scale, 0)
        out.append(p @ vs[:, kv])
    h1 = hidden + attn.o_proj(torch.cat(out))
    return h1 + mid.mlp(mid.post_attention_layernorm(h1)), k, v


def ref_prefix(drafter, ids, aux, p):
    """Step-0 outputs and keys at positions 0..p, each computed from scratch over its own causal prefix."""
    keys, values, h = [], [], None
    for t in range(p + 1):
        h, k, v = ref_token(drafter, int(ids[t + 1]), drafter.project(aux[t]), t, keys, values)
        keys.append(k)
        values.append(v)
    return h, keys, values


def ref_draft(drafter, ids, aux, p, k):
    """Target id of draft k at p: re-runs the whole chain from scratch."""
    h, keys, values = ref_prefix(drafter, ids, aux, p)
    tok = None
    for step in range(k + 1):
        if step > 0:
            h, kk, vv = ref_token(drafter, tok, h, p + step, keys, values)
            keys, values = keys + [kk], values + [vv]
        d = int(drafter.compute_logits(h).argmax())
        tok = d + int(drafter.d2t[d])
    return tok


def ref_evaluable(ids, lm, tgt, n_tok, p, k):
    """(answer still running, data on the argmax path) for draft k at p."""
    end = all(p + 2 + j < n_tok and bool(lm[p + 2 + j]) for j in range(k + 1))
    path = all(int(ids[p + 2 + j]) == int(tgt[p + 1 + j]) for j in range(k))
    return end, path


def ref_chain(drafter, ids, aux, lm, tgt, n_tok, p, steps):
    n = 0
    for k in range(steps):
        end, path = ref_evaluable(ids, lm, tgt, n_tok, p, k)
        if not end:
            return n, sim.END
        if not path:
            return n, sim.OFF_PATH
        if ref_draft(drafter, ids, aux, p, k) != int(tgt[p + 1 + k]):
            return n, sim.MISS
        n += 1
    return n, sim.FULL


def ref_tree_nodes(drafter, ids, aux, p, topk, num_draft_tokens, steps, attention="slots"):
    """The verified nodes of an SGLang EAGLE tree at p, built node by node with python lists.

    attention "slots" (SGLang's draft KV): the frontier node in slot j (its rank) attends to the
    prefix and the keys written by slot j at earlier depths, whatever its parent was. "ancestors"
    (the EAGLE tree mask) is kept here only to show the two differ.
    """
    h0, pre_k, pre_v = ref_prefix(drafter, ids, aux, p)
    probs = torch.softmax(drafter.compute_logits(h0).float(), -1)
    sc, di = probs.topk(topk)
    cands = []  # dict(score, tok, parent, depth)
    frontier = []
    for s, d in zip(sc.tolist(), di.tolist(), strict=True):
        node = dict(score=s, tok=d + int(drafter.d2t[d]), parent=None, depth=1, hin=h0, anc=([], []))
        cands.append(node)
        frontier.append(node)
    slot_k, slot_v = [[] for _ in range(topk)], [[] for _ in range(topk)]
    for depth in range(2, steps + 1):
        children = []
        for j, f in enumerate(frontier):
            seen_k, seen_v = (slot_k[j], slot_v[j]) if attention == "slots" else f["anc"]
            h, k, v = ref_token(drafter, f["tok"], f["hin"], p + depth - 1, pre_k + seen_k, pre_v + seen_v)
            slot_k[j], slot_v[j] = slot_k[j] + [k], slot_v[j] + [v]
            cp, ci = torch.softmax(drafter.compute_logits(h).float(), -1).topk(topk)
            for s, d in zip(cp.tolist(), ci.tolist(), strict=True):
                children.append(dict(score=f["score"] * s, tok=d + int(drafter.d2t[d]), parent=f, depth=depth,
                                     hin=h, anc=(f["anc"][0] + [k], f["anc"][1] + [v])))
        cands += children
        frontier = sorted(children, key=lambda c: -c["score"])[:topk]
    return sorted(cands, key=lambda c: -c["score"])[: num_draft_tokens - 1]


def ref_tree(drafter, ids, aux, lm, tgt, n_tok, p, topk, num_draft_tokens, steps):
    """SGLang's tree at p (slot attention), verified greedily: (accepted, reason)."""
    chosen = ref_tree_nodes(drafter, ids, aux, p, topk, num_draft_tokens, steps)
    cur, n = None, 0
    for k in range(steps):
        end, path = ref_evaluable(ids, lm, tgt, n_tok, p, k)
        if not end:
            return n, sim.END
        if not path:
            return n, sim.OFF_PATH
        nxt = [c for c in chosen if c["depth"] == k + 1 and c["parent"] is cur and c["tok"] == int(tgt[p + 1 + k])]
        if not nxt:
            return n, sim.MISS
        cur, n = nxt[0], n + 1
    return n, sim.FULL


def _path(node):
    out = []
    while node is not None:
        out.append(node["tok"])
        node = node["parent"]
    return tuple(reversed(out))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=["gqa", "mla"])
def drafter(request):
    torch.manual_seed(0)
    return tiny_drafter(3, attention=request.param).eval()


@pytest.fixture(scope="module")
def case(drafter):
    return make_case(drafter, [22, 15, 9], steps=STEPS, seed=4)


def _chain(drafter, case, steps=STEPS):
    with torch.no_grad():
        return sim.simulate_chain_greedy(drafter, input_ids=case["input_ids"], aux_hidden=case["aux_hidden"],
                                         attention_mask=case["attention_mask"], loss_mask=case["loss_mask"],
                                         target_ids=case["target_ids"], steps=steps)


def _positions(case):
    return sim.drafting_positions(case["loss_mask"], case["attention_mask"])


# ----------------------------------------------------------------------------- tests


@torch.no_grad()
def test_chain_matches_brute_force(drafter, case):
    res, _ = _chain(drafter, case)
    got = {(int(b), int(p)): (int(n), int(r)) for b, p, n, r in
           zip(res.sample, res.position, res.accepted, res.reason, strict=True)}
    want = {}
    for b in range(case["input_ids"].shape[0]):
        n_tok = int(case["attention_mask"][b].sum())
        ids, aux, lm, tgt = (case[k][b] for k in ("input_ids", "aux_hidden", "loss_mask", "target_ids"))
        for p in range(n_tok):
            if p + 2 < n_tok and lm[p + 1] and lm[p + 2]:
                want[(b, p)] = ref_chain(drafter, ids, aux, lm, tgt, n_tok, p, STEPS)
    assert got == want
    counts = [n for n, _ in want.values()]
    assert max(counts) >= 3 and sum(c > 0 for c in counts) >= 5, "case too easy/hard to test anything"
    assert {r for _, r in want.values()} >= {sim.MISS, sim.END}
    # the drafts themselves agree with the from-scratch reference
    for i in range(0, len(res.sample), 5):
        b, p = int(res.sample[i]), int(res.position[i])
        for k in range(STEPS):
            assert int(res.drafts[i, k]) == ref_draft(drafter, case["input_ids"][b], case["aux_hidden"][b], p, k)


@torch.no_grad()
def test_chain_prefix_property(drafter, case):
    full, _ = _chain(drafter, case, STEPS)
    for k in range(1, STEPS):
        short, _ = _chain(drafter, case, k)
        assert torch.equal(short.accepted, full.accepted.clamp(max=k))
        assert torch.equal(full.accept_prob[:, :k].sum(-1), short.accepted)


def test_cut_where_data_leaves_the_argmax_path():
    # tokens x0..x7; argmax row 3 predicts 99 but the data continues with x4 = 9
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    tgt = torch.tensor([[6, 7, 8, 99, 10, 11, 12, 13]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    end_ok, path_ok = sim.evaluable(ids, mask, mask, tgt, 3)
    rows = sim.rows_for_steps(tgt, 3)
    drafts = rows.clone()  # a perfect drafter
    drafts[0, 2, 0] = 98  # p=2: the first draft misses (row 3 says 99)
    n, reason = sim.score_chain(drafts, rows, end_ok, path_ok)
    # p=1: drafts 8, 99 accepted; draft 3 would be judged by row 4, but the data took 9, not 99
    assert (int(n[0, 1]), int(reason[0, 1])) == (2, sim.OFF_PATH)
    assert (int(n[0, 2]), int(reason[0, 2])) == (0, sim.MISS)
    # p=3: the first draft (10, row 4) is accepted; the data then follows the argmax again
    assert (int(n[0, 3]), int(reason[0, 3])) == (3, sim.FULL)
    # p=4: rows 5, 6 fine, the third draft would predict token 8, past the end
    assert (int(n[0, 4]), int(reason[0, 4])) == (2, sim.END)
    assert (int(n[0, 0]), int(reason[0, 0])) == (3, sim.FULL)


@torch.no_grad()
@pytest.mark.parametrize("topk,num_draft_tokens", [(2, 6), (3, 8), (2, 3)])
def test_tree_matches_brute_force(drafter, case, topk, num_draft_tokens):
    res0, s0 = _chain(drafter, case)
    where = sim.tree_positions(_positions(case), 6)
    tres = sim.simulate_tree(drafter, s0, input_ids=case["input_ids"], loss_mask=case["loss_mask"],
                             target_ids=case["target_ids"], positions=where, topk=topk,
                             num_draft_tokens=num_draft_tokens, steps=STEPS)
    assert len(tres.sample) == int(where.sum())
    got = [(int(n), int(r)) for n, r in zip(tres.accepted, tres.reason, strict=True)]
    want = []
    for b, p in zip(tres.sample.tolist(), tres.position.tolist(), strict=True):
        n_tok = int(case["attention_mask"][b].sum())
        ids, aux, lm, tgt = (case[k][b] for k in ("input_ids", "aux_hidden", "loss_mask", "target_ids"))
        want.append(ref_tree(drafter, ids, aux, lm, tgt, n_tok, p, topk, num_draft_tokens, STEPS))
    assert got == want
    assert sum(n for n, _ in want) > 0


@torch.no_grad()
def test_tree_in_chunks_of_positions_equals_all_at_once(drafter, case):
    """Bounded memory: positions simulated one (then three) at a time give the all-at-once results, in order."""
    _, s0 = _chain(drafter, case)
    kw = dict(input_ids=case["input_ids"], loss_mask=case["loss_mask"], target_ids=case["target_ids"],
              positions=_positions(case), topk=2, num_draft_tokens=6, steps=STEPS)
    whole = sim.simulate_tree(drafter, s0, **kw)
    bsz, seq = case["input_ids"].shape
    heads = drafter.midlayer.self_attn.num_heads
    per_position = bsz * 2 * heads * seq * 4 * sim._SCORE_COPIES  # fp32 scores of topk 2 nodes, a few copies
    for budget, chunk in ((1, 1), (3 * per_position, 3)):
        assert sim.tree_chunk_positions(bsz, seq, heads, 2, budget) == chunk
        parts = sim.simulate_tree(drafter, s0, max_score_bytes=budget, **kw)
        for name in ("sample", "position", "accepted", "reason"):
            assert torch.equal(getattr(parts, name), getattr(whole, name)), name
    assert int(_positions(case).sum(1).max()) > 3  # so both budgets did split the rows


@torch.no_grad()
def test_tree_with_topk_1_is_the_chain(drafter, case):
    res, s0 = _chain(drafter, case)
    tres = sim.simulate_tree(drafter, s0, input_ids=case["input_ids"], loss_mask=case["loss_mask"],
                             target_ids=case["target_ids"], positions=_positions(case), topk=1,
                             num_draft_tokens=STEPS + 1, steps=STEPS)
    assert torch.equal(tres.accepted, res.accepted.long())
    assert torch.equal(tres.reason, res.reason)


@torch.no_grad()
def test_tree_draft_attention_is_sglangs_slots(drafter):
    """Targets along a path that exists only under SGLang's slot attention: the simulation accepts it
    (under the EAGLE ancestor mask that path is not in the tree)."""
    topk, steps = 2, 5
    budget = topk + (steps - 1) * topk * topk + 1  # every candidate is verified
    case = make_case(drafter, [24], steps=3, seed=11)
    ids, aux = case["input_ids"][0].clone(), case["aux_hidden"][0]
    found = None
    for p in range(2, 24 - steps - 2):
        slots = {_path(c) for c in ref_tree_nodes(drafter, ids, aux, p, topk, budget, steps)}
        anc = {_path(c) for c in ref_tree_nodes(drafter, ids, aux, p, topk, budget, steps, "ancestors")}
        only = sorted(slots - anc, key=len)
        if only:
            found = (p, only[0])
            break
    assert found is not None, "no position where the two draft attentions give different trees"
    p, path = found
    tgt = case["target_ids"][0].clone()
    for k, tok in enumerate(path):  # argmax rows p+1.. follow the path, and the data follows the argmax
        tgt[p + 1 + k] = tok
        ids[p + 2 + k] = tok
    one = {k: v[:1].clone() for k, v in case.items()}
    one["input_ids"][0], one["target_ids"][0] = ids, tgt
    _, s0 = sim.simulate_chain_greedy(drafter, input_ids=one["input_ids"], aux_hidden=one["aux_hidden"],
                                      attention_mask=one["attention_mask"], loss_mask=one["loss_mask"],
                                      target_ids=one["target_ids"], steps=steps)
    where = torch.zeros_like(one["loss_mask"])
    where[0, p] = True
    tres = sim.simulate_tree(drafter, s0, input_ids=one["input_ids"], loss_mask=one["loss_mask"],
                             target_ids=one["target_ids"], positions=where, topk=topk, num_draft_tokens=budget,
                             steps=steps)
    assert int(tres.accepted[0]) >= len(path) >= 2


def test_tree_budget_is_checked(drafter, case):
    _, s0 = _chain(drafter, case, 1)
    with pytest.raises(ValueError, match="num_draft_tokens=12"):
        sim.simulate_tree(drafter, s0, input_ids=case["input_ids"], loss_mask=case["loss_mask"],
                          target_ids=case["target_ids"], positions=_positions(case), topk=2,
                          num_draft_tokens=12, steps=3)  # 2 + 2*4 = 10 candidates


def test_tree_positions_are_deterministic_and_capped():
    where = torch.zeros(2, 30, dtype=torch.bool)
    where[0, 3:25] = True
    where[1, 5:7] = True
    a, b = sim.tree_positions(where, 4), sim.tree_positions(where, 4)
    assert torch.equal(a, b)
    assert a[0].sum() == 4 and bool(a[0, 3]) and bool(a[0, 24])
    assert torch.equal(a[1], where[1])
    assert torch.equal(sim.tree_positions(where, 0), where)


@torch.no_grad()
@pytest.mark.parametrize("rule", ["rejection", "target_only"])
def test_sampled_chain_matches_direct_computation(drafter, case, rule):
    """rejection: alpha = sum min(p, q_T); target_only (the engines' default): alpha = p(argmax q)."""
    temperature = 0.7
    g = torch.Generator().manual_seed(9)
    bsz, seq = case["input_ids"].shape
    vd = drafter.config.draft_vocab_size
    teacher_p = torch.softmax(torch.randn(bsz, seq, vd, generator=g) * 2, -1) * 0.9  # 10% outside the draft vocab
    res = sim.simulate_chain_sampled(drafter, input_ids=case["input_ids"], aux_hidden=case["aux_hidden"],
                                     attention_mask=case["attention_mask"], loss_mask=case["loss_mask"],
                                     teacher_p=teacher_p, temperature=temperature, steps=STEPS, rule=rule)
    for i in range(len(res.sample)):
        b, p = int(res.sample[i]), int(res.position[i])
        n_tok = int(case["attention_mask"][b].sum())
        ids, aux, lm = case["input_ids"][b], case["aux_hidden"][b], case["loss_mask"][b]
        h, keys, values = ref_prefix(drafter, ids, aux, p)
        expected, run = 0.0, 1.0
        for j in range(STEPS):
            end = all(p + 2 + i < n_tok and bool(lm[p + 2 + i]) for i in range(j + 1))
            if not end:  # the answer ended: nothing more can be accepted
                break
            if j > 0:  # along the data path: the drafter reads data token p+1+j
                h, kk, vv = ref_token(drafter, int(ids[p + 1 + j]), h, p + j, keys, values)
                keys, values = keys + [kk], values + [vv]
            logits = drafter.compute_logits(h).float()
            if rule == "rejection":
                alpha = float(torch.minimum(torch.softmax(logits / temperature, -1), teacher_p[b, p + 1 + j]).sum())
            else:
                alpha = float(teacher_p[b, p + 1 + j][int(logits.argmax())])
            run *= alpha
            expected += run
        assert float(res.accepted[i]) == pytest.approx(expected, abs=1e-5)
    assert float(res.accepted.mean()) > 0
    with pytest.raises(ValueError, match="rule"):
        sim.simulate_chain_sampled(drafter, input_ids=case["input_ids"], aux_hidden=case["aux_hidden"],
                                   attention_mask=case["attention_mask"], loss_mask=case["loss_mask"],
                                   teacher_p=teacher_p, temperature=temperature, steps=STEPS, rule="nope")


@torch.no_grad()
def test_chain_drafts_are_the_training_steps(drafter, case):
    """Train and eval agree: where the data tokens equal the earlier drafts, chain draft k is the
    argmax of ttt_forward's step k at the same position (the trainer's TTT unroll is the drafting
    the evaluator simulates, not merely a look-alike)."""
    from redraft.core.teacher_targets import TeacherTargets
    from train.ttt import ttt_forward

    bsz, seq = case["input_ids"].shape
    vd = drafter.config.draft_vocab_size
    teacher = TeacherTargets(target_p=torch.full((bsz, seq, vd), 1.0 / vd), target_ids=case["target_ids"])
    out = ttt_forward(drafter, input_ids=case["input_ids"], aux_hidden=case["aux_hidden"],
                      attention_mask=case["attention_mask"], loss_mask=case["loss_mask"], teacher=teacher,
                      steps=STEPS, return_logits=True)
    res, _ = _chain(drafter, case)
    ids = case["input_ids"]
    compared = [0] * STEPS
    for i in range(len(res.sample)):
        b, p = int(res.sample[i]), int(res.position[i])
        for k in range(STEPS):
            if p + 1 + k >= seq:
                break
            ttt_draft = int(drafter.draft_to_target(out.logits[k][b, p].argmax()))
            assert ttt_draft == int(res.drafts[i, k]), (b, p, k)
            compared[k] += 1
            if p + 2 + k >= seq or int(ids[b, p + 2 + k]) != int(res.drafts[i, k]):
                break  # the data leaves the drafted path: later TTT steps read other tokens
    assert min(compared[1:]) >= 3, f"too few multi-step agreements to test anything: {compared}"
