"""DFlash (DrafterConfig.method "dflash"): the block drafter as vLLM 0.32 runs it.

The reference is written here from vLLM's ``model_executor/models/qwen3_dflash.py`` and ``v1/spec_decode/dflash.py``,
in plain tensor ops on the state dict, not from the module under test: for a request whose verified positions are
0..p, the context states ``hidden_norm(fc(aux))`` of 0..p go through each layer's k/v projections (k_norm, rope at
their positions) straight into its cache; the block [x[p+1], mask x K] at positions p+1..p+1+K runs through Qwen3
pre-norm layers (q_norm/k_norm per head, NeoX rope, GQA) attending to the context and to the whole block (no causal
mask); the drafts are the argmaxes of lm_head(norm(h)) at the K mask slots, through d2t. Training (train.ttt) and the
offline simulation (eval.simulate) must give exactly those logits at every row. The end-to-end proof is a trained
DFlash drafter's offline walk against vLLM CPU's counters (docs/drafter-kinds.md).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers_drafter import random_batch, tiny_config, tiny_drafter

from eval.simulate import simulate_chain_greedy, simulate_chain_sampled, simulate_tree
from redraft.core.drafter.folder import load_drafter_checkpoint, write_drafter_folder
from redraft.core.drafter.serving_format import (
    ServingFormatError,
    check_serving_state,
    drafter_config_from_serving,
    expected_tensors,
    served_method,
    serving_config,
)
from redraft.core.teacher_targets import TeacherTargets
from redraft.engines.launch import vllm_speculative_config
from train.ttt import ttt_forward

torch.set_num_threads(1)
MASK = 7
DFLASH = dict(method="dflash", mask_token_id=MASK, num_layers=2, block_size=4, target_hidden_size=32)


def _dflash(seed: int = 0):
    return tiny_drafter(seed=seed, **DFLASH)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX rope (rotate halves) of x [n, heads, hd] at integer positions [n]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    freqs = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([freqs.cos()] * 2, -1).float()[:, None], torch.cat([freqs.sin()] * 2, -1).float()[:, None]
    half = hd // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def _vllm_block_logits(d, ids: torch.Tensor, aux: torch.Tensor, p: int, k: int) -> torch.Tensor:
    """[K, Vd] logits at the mask slots of vLLM's DFlash pass for verified positions 0..p (module doc)."""
    c, sd = d.config, d.state_dict()
    eps, nh, nkv, hd = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ctx = _rms(aux[: p + 1] @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    block = torch.tensor([int(ids[p + 1])] + [MASK] * k)
    pos_blk, pos_ctx = torch.arange(p + 1, p + 2 + k), torch.arange(p + 1)
    h = sd["embed_tokens.weight"][block]
    for i in range(c.num_layers):
        w = {name[len(f"layers.{i}."):]: t for name, t in sd.items() if name.startswith(f"layers.{i}.")}
        x = _rms(h, w["input_layernorm.weight"], eps)

        def kv(src, pos, w=w):
            key = _rms((src @ w["self_attn.k_proj.weight"].T).view(-1, nkv, hd), w["self_attn.k_norm.weight"], eps)
            return _rope(key, pos, c.rope_theta), (src @ w["self_attn.v_proj.weight"].T).view(-1, nkv, hd)

        q = _rms((x @ w["self_attn.q_proj.weight"].T).view(-1, nh, hd), w["self_attn.q_norm.weight"], eps)
        q = _rope(q, pos_blk, c.rope_theta)
        (k_ctx, v_ctx), (k_blk, v_blk) = kv(ctx, pos_ctx), kv(x, pos_blk)
        keys = torch.cat((k_ctx, k_blk)).repeat_interleave(nh // nkv, dim=1)
        values = torch.cat((v_ctx, v_blk)).repeat_interleave(nh // nkv, dim=1)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1))
        h = h + attn.transpose(0, 1).reshape(len(block), nh * hd) @ w["self_attn.o_proj.weight"].T
        y = _rms(h, w["post_attention_layernorm.weight"], eps)
        h = h + (F.silu(y @ w["mlp.gate_proj.weight"].T) * (y @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return (_rms(h, sd["norm.weight"], eps) @ sd["lm_head.weight"].T)[1:]


@torch.no_grad()
def test_offline_drafts_are_vllms_block_pass():
    d, steps, seq = _dflash(1), 3, 12
    ids, aux = random_batch(d.config, seq, 2)
    ones = torch.ones(1, seq, dtype=torch.long)
    res, step0 = simulate_chain_greedy(d, input_ids=ids, aux_hidden=aux, attention_mask=ones, loss_mask=ones,
                                       target_ids=torch.randint(0, d.config.vocab_size, (1, seq)), steps=steps)
    assert step0 is None
    assert len(res.position) >= 8
    for row, p in enumerate(res.position.tolist()):
        want = d.draft_to_target(_vllm_block_logits(d, ids[0], aux[0], p, steps).argmax(-1))
        assert res.drafts[row].tolist() == want.tolist(), f"drafting position {p}"


def test_training_scores_the_logits_vllm_drafts_from():
    d, steps, seq = _dflash(4), 3, 10
    c = d.config
    ids, aux = random_batch(c, seq, 5)
    target_p = torch.softmax(torch.randn(1, seq, c.draft_vocab_size), -1)
    teacher = TeacherTargets(target_p=target_p, target_ids=d.draft_to_target(target_p.argmax(-1)), p_on_draft=None)
    out = ttt_forward(d, input_ids=ids, aux_hidden=aux, attention_mask=None, loss_mask=torch.ones_like(ids),
                      teacher=teacher, steps=steps, return_logits=True)
    for p in range(seq - 1):
        want = _vllm_block_logits(d, ids[0], aux[0], p, steps)
        for k in range(steps):
            torch.testing.assert_close(out.logits[k][0, p], want[k], atol=1e-5, rtol=1e-5)
    out.loss.backward()
    for name, param in d.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


@torch.no_grad()
def test_padding_and_chunks_change_no_row():
    d, steps, seq = _dflash(6), 3, 11
    ids, aux = random_batch(d.config, seq, 7)
    mask = torch.ones(2, seq, dtype=torch.bool)
    mask[1, 8:] = False  # a right-padded second sample, the first one's prefix
    ids2, aux2 = torch.cat((ids, ids)), torch.cat((aux, aux))
    whole = d.block_states(ids2, aux2, mask, steps)
    chunked = d.block_states(ids2, aux2, mask, steps, score_bytes=1)  # one drafting row per chunk
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for a in whole:  # rows whose block starts before the padding see the same context
        torch.testing.assert_close(a[1, :7], a[0, :7], atol=1e-6, rtol=1e-6)
    ones = torch.ones(1, seq, dtype=torch.long)
    teacher_p = torch.softmax(torch.randn(1, seq, d.config.draft_vocab_size), -1)
    res = simulate_chain_sampled(d, input_ids=ids, aux_hidden=aux, attention_mask=ones, loss_mask=ones,
                                 teacher_p=teacher_p, temperature=1.0, steps=steps)
    assert res.accept_prob.shape[1] == steps and float(res.accept_prob.max()) <= 1.0


# vLLM's DFlash names, written out by hand from qwen3_dflash.py (its loader adds "model." to all but lm_head/d2t)
def _dflash_keys(layers: int) -> set[str]:
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"]
    return ({"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
            | {f"layers.{i}.{name}" for i in range(layers) for name in per_layer})


def test_the_vllm_folder_is_a_dflash_draft_model(tmp_path):
    d = _dflash(2)
    c = d.config
    state = d.serving_state_dict()
    assert set(state) == _dflash_keys(2)
    check_serving_state(state, c, "vllm")
    config = serving_config(c, engine="vllm")
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4
    # a Llama target: vLLM captures the output of layer i as its id i + 1, and adds 1 to DFlash's ids itself
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": c.aux_layer_ids}
    assert not {"layer_types", "causal", "use_swa", "is_causal"} & (set(config) | set(config["dflash_config"]))
    assert served_method(config) == "dflash"
    write_drafter_folder(tmp_path, c, state, {"format": "redraft-test"})
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    back_cfg, back_state = load_drafter_checkpoint(tmp_path)
    assert back_cfg == c and set(back_state) == set(state)  # layers.0 stays layers.0 (not EAGLE's midlayer)
    spec = vllm_speculative_config(tmp_path, 3)
    assert spec == {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 3}
    reloaded = tiny_drafter(seed=9, **DFLASH)
    reloaded.load_serving_state_dict(back_state)
    torch.testing.assert_close(reloaded.state_dict()["layers.1.self_attn.k_norm.weight"],
                               state["layers.1.self_attn.k_norm.weight"])


@pytest.mark.parametrize("change,key", [
    ({"attention": "mla"}, "attention"),
    ({"mask_token_id": None}, "mask_token_id"),
    ({"block_size": None}, "block_size"),
    ({"block_size": 1}, "block_size"),
    ({"num_layers": 0}, "num_layers"),
    ({"target_hidden_size": 20}, "target_hidden_size"),
])
def test_a_drafter_config_vllm_cannot_serve_as_dflash_is_refused_by_key(change, key):
    base = dict(DFLASH)
    if change.get("attention") == "mla":
        from helpers_drafter import TINY_MLA
        base.update(TINY_MLA)
    with pytest.raises(ValueError, match=key):
        tiny_config(**{**base, **change})


def test_other_engines_and_mixed_configs_are_refused_by_key():
    d = _dflash(5)
    with pytest.raises(ServingFormatError, match="CUDA, NPU and XPU only"):
        serving_config(d.config, engine="sglang")
    with pytest.raises(ServingFormatError, match="sglang format"):
        expected_tensors(d.config, "sglang")
    for change, key in (({"num_layers": 2}, "num_layers"), ({"block_size": 4}, "block_size")):
        with pytest.raises(ValueError, match=key):
            tiny_config(**change)  # a DFlash setting on an EAGLE-3 drafter
    config = serving_config(d.config, engine="vllm")
    with pytest.raises(ServingFormatError, match="DFlash"):
        drafter_config_from_serving(config, target_architecture="LlamaForCausalLM", target_num_layers=8,
                                    engine="vllm")
    with pytest.raises(ValueError, match="no tree"):
        simulate_tree(d, None, input_ids=None, loss_mask=None, target_ids=None, positions=None, topk=2,
                      num_draft_tokens=4, steps=2)
