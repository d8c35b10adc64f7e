"""P-EAGLE (DrafterConfig.method "p-eagle"): parallel drafting as vLLM 0.32 runs it.

The reference pass is written here from vLLM's code, not from the module under test: one causal forward over
the drafter query vLLM builds for a request whose last accepted position is p (``v1/spec_decode/utils.py``
``copy_and_expand_eagle_inputs_kernel`` and ``llm_base_proposer.py`` ``set_inputs_first_pass``): slot j <= p
reads (token j + 1, position j, fc(aux[j])), the bonus slot being j = p; slots p+1..p+K-1 read (mask token,
position j, fc(mask_hidden)); attention is causal over all of them; draft 1 is the bonus slot's argmax and draft
k + 1 mask slot p + k's, through d2t. Training (train.ttt) and the offline simulation (eval.simulate) must give
exactly those logits at every position. The end-to-end proof is the engine-truth lane's kinds phase (offline
walk = vLLM CPU's counters per request for a P-EAGLE drafter).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers_drafter import SERVING_KEYS, random_batch, tiny_config, tiny_drafter

from eval.simulate import simulate_chain_greedy, simulate_tree
from redraft.core.drafter.serving_format import (
    ServingFormatError,
    check_serving_state,
    drafter_config_from_serving,
    expected_tensors,
    served_method,
    serving_config,
)
from redraft.core.teacher_targets import TeacherTargets
from redraft.engines.launch import LaunchPlan, vllm_command, vllm_speculative_config
from train.ttt import ttt_forward

torch.set_num_threads(1)
MASK = 7


def _peagle(seed: int = 0):
    d = tiny_drafter(seed=seed, method="p-eagle", mask_token_id=MASK)
    with torch.no_grad():
        d.mask_hidden.normal_(0, 1.0)
    return d


def _vllm_parallel_logits(d, ids: torch.Tensor, aux: torch.Tensor, p: int, k: int) -> torch.Tensor:
    """[K, Vd] logits of vLLM's one parallel pass for a request whose last accepted position is p (module doc)."""
    c = d.config
    tokens = torch.cat([ids[1: p + 2], torch.full((k - 1,), MASK)])
    hidden = torch.cat([d.project(aux[: p + 1]), d.project(d.mask_hidden)[None].expand(k - 1, c.hidden_size)])
    n = p + k
    q, key, v = d.attention_inputs(tokens[None], hidden[None], torch.arange(n)[None])
    scores = torch.einsum("bqkgd,btkd->bkgqt", q, key) * d.midlayer.self_attn.softmax_scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = torch.einsum("bkgqt,btkd->bqkgd", probs, v).reshape(1, n, -1)
    return d.compute_logits(d.layer_output(hidden[None], out))[0, p: p + k]


@torch.no_grad()
def test_offline_drafts_are_vllms_one_parallel_pass():
    d, steps, seq = _peagle(1), 4, 12
    ids, aux = random_batch(d.config, seq, 2)
    ones = torch.ones(1, seq, dtype=torch.long)
    res, _ = simulate_chain_greedy(d, input_ids=ids, aux_hidden=aux, attention_mask=ones, loss_mask=ones,
                                   target_ids=torch.randint(0, d.config.vocab_size, (1, seq)), steps=steps)
    checked = 0
    for row, p in enumerate(res.position.tolist()):
        if p + 1 + steps > seq:
            continue
        want = d.draft_to_target(_vllm_parallel_logits(d, ids[0], aux[0], p, steps).argmax(-1))
        assert res.drafts[row].tolist() == want.tolist(), f"drafting position {p}"
        checked += 1
    assert checked >= 5
    # the sequential rule (each step reads its own draft and state) drafts something else
    seq_rule = tiny_drafter(seed=1)
    seq_rule.load_serving_state_dict({k: v for k, v in d.state_dict().items() if k != "mask_hidden"}, strict=False)
    seq_res, _ = simulate_chain_greedy(seq_rule, input_ids=ids, aux_hidden=aux, attention_mask=ones, loss_mask=ones,
                                       target_ids=torch.zeros_like(ids), steps=steps)
    assert torch.equal(seq_res.drafts[:, 0], res.drafts[:, 0])  # draft 1: the same bonus slot
    assert not torch.equal(seq_res.drafts[:, 1:], res.drafts[:, 1:])


def test_training_scores_the_logits_vllm_drafts_from_and_learns_mask_hidden():
    d, steps, seq = _peagle(4), 3, 10
    c = d.config
    ids, aux = random_batch(c, seq, 5)
    target_p = torch.softmax(torch.randn(1, seq, c.draft_vocab_size), -1)
    teacher = TeacherTargets(target_p=target_p, target_ids=d.draft_to_target(target_p.argmax(-1)), p_on_draft=None)
    out = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=None, loss_mask=torch.ones_like(ids),
                      teacher=teacher, steps=steps, return_logits=True)
    for p in range(seq - steps):
        want = _vllm_parallel_logits(d, ids[0], aux[0], p, steps)
        for k in range(steps):
            torch.testing.assert_close(out.logits[k][0, p], want[k], atol=1e-5, rtol=1e-5)
    out.loss.backward()
    assert d.mask_hidden.grad is not None and d.mask_hidden.grad.abs().sum() > 0


def test_the_vllm_folder_carries_the_mask_token_and_mask_hidden():
    d = _peagle(2)
    c = d.config
    state = d.serving_state_dict()
    assert set(state) == SERVING_KEYS | {"mask_hidden"}
    assert tuple(state["mask_hidden"].shape) == (c.num_aux_layers * c.target_hidden_size,)  # pre-fc, as vLLM's
    check_serving_state(state, c, "vllm")
    config = serving_config(c, engine="vllm")
    assert config["mask_token_id"] == MASK and config["fc_norm"] is False and "norm_output" not in config
    assert "mask_token_id" not in config["eagle_config"]
    assert served_method(config) == "p-eagle"
    back = drafter_config_from_serving(config, target_architecture=c.target_architecture,
                                       target_num_layers=c.target_num_layers, engine="vllm")
    assert (back.method, back.mask_token_id) == ("p-eagle", MASK)


def test_vllm_is_launched_with_parallel_drafting_for_a_peagle_folder_only(tmp_path):
    for name, drafter in (("p", _peagle(3)), ("e", tiny_drafter(seed=3))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(serving_config(drafter.config, engine="vllm")))
        spec = vllm_speculative_config(folder, 4)
        assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 4
        assert spec.get("parallel_drafting", False) is (name == "p")
    # eval.export prints the command before the folder exists: the plan says it then
    line = vllm_command("TARGET", str(tmp_path / "not-yet"), LaunchPlan(steps=5, method="p-eagle"))
    assert '"parallel_drafting": true' in line and '"num_speculative_tokens": 5' in line
    assert "parallel_drafting" not in vllm_command("TARGET", str(tmp_path / "not-yet"), LaunchPlan(steps=5))


@pytest.mark.parametrize("change,key", [
    ({"attention": "mla"}, "attention"),
    ({"mask_token_id": None}, "mask_token_id"),
    ({"mask_token_id": 64}, "mask_token_id"),
])
def test_a_drafter_config_vllm_cannot_serve_in_parallel_is_refused_by_key(change, key):
    base = dict(method="p-eagle", mask_token_id=MASK)
    if change.get("attention") == "mla":
        from helpers_drafter import TINY_MLA
        base.update(TINY_MLA)
    with pytest.raises(ValueError, match=key):
        tiny_config(**{**base, **change})


def test_other_engines_and_mixed_configs_are_refused_by_key():
    d = _peagle(5)
    with pytest.raises(ServingFormatError, match="SGLang 0.5.23 has no parallel drafting"):
        serving_config(d.config, engine="sglang")
    with pytest.raises(ServingFormatError, match="sglang format"):
        expected_tensors(d.config, "sglang")
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(mask_token_id=3)  # a mask token on an EAGLE-3 drafter
    config = serving_config(d.config, engine="vllm")
    for bad, key in (({"fc_norm": True}, "fc_norm"), ({"mask_token_id": None}, "mask_token_id"),
                     ({"pard_token": None, "mask_token_id": None}, "pard_token")):
        with pytest.raises(ServingFormatError, match=key):
            served_method({**config, **bad})
    nested = {**config, "eagle_config": {**config["eagle_config"], "mask_token_id": MASK}}
    with pytest.raises(ServingFormatError, match="eagle_config.mask_token_id"):
        served_method(nested)
    assert served_method({k: v for k, v in config.items() if k != "mask_token_id"} | {"pard_token": 5}) == "p-eagle"
    with pytest.raises(ValueError, match="no tree"):
        simulate_tree(d, None, input_ids=None, loss_mask=None, target_ids=None, positions=None, topk=2,
                      num_draft_tokens=4, steps=2)
