"""The MLA drafter (attention "mla"): its config rules, its keys, its math against transformers' DeepSeek-V3
attention, the TTT kernel with narrower values, and its serving config read back."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers_drafter import MLA_SERVING_KEYS, tiny_config, tiny_drafter, tiny_mla_config

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.modeling import Eagle3Drafter, MLAAttention
from redraft.core.drafter.rope import rope_tables, yarn_mscale
from redraft.core.drafter.serving_format import (
    ServingFormatError,
    check_serving_state,
    drafter_config_from_serving,
    expected_tensors,
    serving_config,
)
from redraft.core.drafter.ttt_attention import TTTCache, _eager_attention, _sdpa_attention, ttt_attention

torch.set_num_threads(1)

# Kimi-K2.5's rope, as its config.json writes it
KIMI_YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
             "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0}


# ----------------------------------------------------------------------------- config rules


@pytest.mark.parametrize(("change", "pattern"), [
    ({"q_lora_rank": None}, r"q_lora_rank is required .*SGLang"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads=2 is a GQA size"),
    ({"head_dim": 64}, r"head_dim=64 is a GQA size: .* = 72"),
    ({"kv_lora_rank": 256, "head_dim": 72}, r"latent of 320 is not served"),
    ({"attention": "sparse"}, r"attention='sparse' is not one of"),
])
def test_config_refuses_mixed_or_unservable_kinds(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        tiny_mla_config(**change)


def test_a_gqa_config_with_an_mla_size_is_refused_by_key():
    with pytest.raises(ValueError, match=r"kv_lora_rank=512 is an MLA size but attention is 'gqa'"):
        tiny_config(kv_lora_rank=512)


def test_from_target_takes_the_targets_mla_sizes_or_deepseeks():
    info = {"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64, "num_layers": 8, "aux_layer_ids": [1, 2, 4],
            "architecture": "DeepseekV3ForCausalLM", "mla": {"q_lora_rank": 48, "kv_lora_rank": 512,
                                                          "qk_nope_head_dim": 16, "qk_rope_head_dim": 64,
                                                          "v_head_dim": 16}}
    cfg = DrafterConfig.from_target(info, 24, attention="mla")
    assert (cfg.q_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim, cfg.num_key_value_heads) == (
        48, 16, 16, 80, 4)
    llama = DrafterConfig.from_target({**info, "mla": None}, 24, attention="mla")
    assert (llama.q_lora_rank, llama.kv_lora_rank, llama.qk_nope_head_dim, llama.qk_rope_head_dim,
            llama.v_head_dim) == (1536, 512, 128, 64, 128)  # DeepSeek-V3's / Kimi-K2.5's
    with pytest.raises(ValueError, match="head_dim is a GQA size"):
        DrafterConfig.from_target(info, 24, attention="mla", head_dim=64)
    with pytest.raises(ValueError, match="kv_lora_rank is an MLA size"):
        DrafterConfig.from_target(info, 24, kv_lora_rank=512)


# ----------------------------------------------------------------------------- keys and shapes


def test_serving_keys_and_shapes_are_the_engines():
    d = tiny_drafter(attention="mla")
    c = d.config
    sd = d.serving_state_dict()
    assert set(sd) == MLA_SERVING_KEYS
    h, nh = c.hidden_size, c.num_attention_heads
    a = "midlayer.self_attn."
    assert sd[a + "q_a_proj.weight"].shape == (24, 2 * h)  # the _a_ projections read [embedding, hidden]
    assert sd[a + "q_b_proj.weight"].shape == (nh * (8 + 64), 24)
    assert sd[a + "kv_a_proj_with_mqa.weight"].shape == (512 + 64, 2 * h)
    assert sd[a + "kv_b_proj.weight"].shape == (nh * (8 + 12), 512)
    assert sd[a + "o_proj.weight"].shape == (h, nh * 12)
    spec = expected_tensors(c, "vllm")
    assert set(spec) == MLA_SERVING_KEYS
    assert all(tuple(sd[k].shape) == spec[k].shape for k in spec)
    check_serving_state(sd, c, "sglang")
    gqa_state = tiny_drafter().serving_state_dict()
    with pytest.raises(ServingFormatError, match="missing key 'midlayer.self_attn.q_a_proj.weight'"):
        check_serving_state({**gqa_state, "d2t": sd["d2t"], "t2d": sd["t2d"]}, c, "vllm")


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_serving_config_says_what_the_engines_build_and_reads_back(engine):
    cfg = tiny_mla_config(rope_scaling=KIMI_YARN, rope_theta=50000.0, target_architecture="DeepseekV3ForCausalLM")
    c = serving_config(cfg, engine=engine)
    assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and c["model_type"] == "deepseek_v2"
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]) == (
        24, 512, 8, 64, 12)
    assert c["rope_interleave"] is True and "n_routed_experts" not in c
    assert c["rope_scaling"]["factor"] == 64.0 and c["rope_parameters"]["rope_type"] == "yarn"
    # DeepSeek family, our [1, 2, 4]: vLLM reads input-of-layer ids; SGLang adds 1 itself when the first id is 1
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == {"vllm": [2, 3, 5], "sglang": [1, 2, 4]}[engine]
    back = drafter_config_from_serving(json.loads(json.dumps(c)), target_architecture="DeepseekV3ForCausalLM",
                                       target_num_layers=8, engine=engine)
    assert back == cfg


@pytest.mark.parametrize(("change", "pattern"), [
    ({"model_type": "deepseek_v3"}, "deepseek_mtp"),
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"q_lora_rank": None}, "key 'q_lora_rank' is missing"),
    ({"kv_lora_rank": 128}, "latent of 192 is not served"),
    ({"architectures": ["LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"]}, "exactly one of"),
])
def test_foreign_mla_configs_the_engines_would_misread_are_refused_by_key(change, pattern):
    c = {**serving_config(tiny_mla_config()), **change}
    with pytest.raises(ServingFormatError, match=pattern):
        drafter_config_from_serving(c, target_architecture="DeepseekV3ForCausalLM", target_num_layers=8)


# ----------------------------------------------------------------------------- the math


def _reference_attention(cfg: DrafterConfig, mla: MLAAttention, x: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3Attention on the same weights (its input width set to 2H; o_proj left out)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    hf_cfg = DeepseekV3Config(
        hidden_size=2 * cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, rope_interleave=True,
        rope_parameters={"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})},
    )
    hf_cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(hf_cfg, layer_idx=0)
    ours = {k: v for k, v in mla.state_dict().items() if not k.startswith("o_proj")}
    missing = ref.load_state_dict(ours, strict=False)
    assert set(missing.missing_keys) == {"o_proj.weight"} and not missing.unexpected_keys
    ref.o_proj = torch.nn.Identity()
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos)
    causal = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    out, _ = ref(x, (cos, sin), causal)
    return out


@pytest.mark.parametrize("rope", [None, KIMI_YARN, {**KIMI_YARN, "mscale_all_dim": 0.707, "mscale": 0.707}])
def test_mla_attention_is_transformers_deepseek_v3_attention(rope):
    """Projection layout, interleaved rope pairs, and the softmax scale (YaRN mscale_all_dim squared) at step 0."""
    d = tiny_drafter(attention="mla", rope_scaling=rope, rope_theta=50000.0, max_position_embeddings=262144)
    cfg, attn = d.config, d.midlayer.self_attn
    torch.manual_seed(3)
    x = torch.randn(2, 9, 2 * cfg.hidden_size)
    pos = torch.arange(9)[None].expand(2, -1)
    cos, sin = d.rope_cos_sin(pos, torch.float32)
    q, k, v = attn.project(x, cos, sin)
    ours = ttt_attention(q, k, v, TTTCache(), None, "eager", attn.softmax_scale)
    torch.testing.assert_close(ours, _reference_attention(cfg, attn, x), rtol=2e-5, atol=2e-6)


def test_kimi_softmax_scale_and_magnitude_follow_deepseek_yarn():
    t = rope_tables(tiny_mla_config(rope_scaling=KIMI_YARN, rope_theta=50000.0))
    m = yarn_mscale(64.0, 1.0)
    assert math.isclose(m, 1.0 + 0.1 * math.log(64.0))
    assert t.style == "interleaved" and t.dim == 64 and t.cos_sin_scale == 1.0
    assert math.isclose(t.softmax_scale, (8 + 64) ** -0.5 * m * m, rel_tol=1e-12)
    with pytest.raises(ValueError, match="DeepSeek's YaRN"):
        rope_tables(tiny_mla_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))


def test_ttt_kernels_take_values_narrower_than_keys():
    """eager (hand-written backward) and SDPA agree in value and gradient when hd_v != hd, at a custom scale."""
    torch.manual_seed(0)
    b, nkv, g, t, hd, hv, steps = 2, 3, 1, 7, 10, 6, 3
    mask = torch.ones(b, t)
    mask[1, 5:] = 0
    q0 = torch.randn(b, nkv, g, t, hd, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(b, nkv, t, hd, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(b, nkv, t, hv, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    scale = 0.37

    real = mask.bool()[:, None, None, :, None]  # padded query rows are don't-care in both kernels

    def run(fn, **kw):
        out = fn(q0, TTTCache(keys=list(keys), values=list(values)), mask, scale=scale, **kw) * real
        grads = torch.autograd.grad(out.square().sum(), [q0, *keys, *values])
        return out, grads

    eager, g_eager = run(_eager_attention, block_rows=3)
    sdpa, g_sdpa = run(_sdpa_attention)
    assert eager.shape == (b, nkv, g, t, hv)
    torch.testing.assert_close(eager, sdpa)
    for a, c in zip(g_eager, g_sdpa, strict=True):
        torch.testing.assert_close(a, c)


def test_mla_drafter_unrolls_and_trains():
    """Gradients reach every MLA weight through a 3-step TTT unroll (what train.ttt runs)."""
    d = tiny_drafter(attention="mla")
    c = d.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (2, 6), generator=g)
    hidden = d.project(torch.randn(2, 6, 3 * c.target_hidden_size, generator=g))
    pos = torch.arange(6).expand(2, 6)
    cache, loss = TTTCache(), 0.0
    for k in range(3):
        hidden = d(ids, hidden, pos + k, cache, torch.ones(2, 6))
        loss = loss + d.compute_logits(hidden).logsumexp(-1).mean()
    loss.backward()
    for name, p in d.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert len(cache) == 3 and cache.values[0].shape[-1] == c.v_head_dim and cache.keys[0].shape[-1] == c.head_dim


def test_gqa_drafter_is_unchanged_by_the_second_kind():
    """The Llama-style drafter's keys and rope are what they were (the MLA kind is an addition)."""
    d = tiny_drafter()
    assert isinstance(tiny_config().attention, str) and d.config.attention == "gqa"
    assert "midlayer.self_attn.q_proj.weight" in d.serving_state_dict()
    assert rope_tables(d.config).style == "neox"
    assert Eagle3Drafter(tiny_config()).midlayer.self_attn.softmax_scale == 1.0 / math.sqrt(8)
