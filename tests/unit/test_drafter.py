"""Drafter contract: serving names and shapes, (de)serialisation, target embedding, RoPE, config."""

from __future__ import annotations

import json

import pytest
import torch
from helpers_drafter import SERVING_KEYS, tiny_config, tiny_drafter
from safetensors.torch import save_file

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.modeling import Eagle3Drafter, RMSNorm
from redraft.core.drafter.ttt_attention import TTTCache

torch.set_num_threads(1)


def _step0_logits(d: Eagle3Drafter, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = d.config
    ids = torch.randint(0, c.vocab_size, (2, 6), generator=g)
    aux = torch.randn(2, 6, 3 * c.target_hidden_size, generator=g)
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        h = d(ids, d.project(aux), pos, TTTCache(), None)
        return d.compute_logits(h)


def test_serving_names_and_shapes():
    d = tiny_drafter()
    c = d.config
    sd = d.serving_state_dict()
    assert set(sd) == SERVING_KEYS
    h, hd = c.hidden_size, c.head_dim
    assert sd["fc.weight"].shape == (h, 3 * c.target_hidden_size)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (c.num_attention_heads * hd, 2 * h)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (c.num_key_value_heads * hd, 2 * h)
    assert sd["midlayer.self_attn.v_proj.weight"].shape == (c.num_key_value_heads * hd, 2 * h)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (h, c.num_attention_heads * hd)
    assert sd["midlayer.mlp.gate_proj.weight"].shape == (c.intermediate_size, h)
    assert sd["midlayer.mlp.down_proj.weight"].shape == (h, c.intermediate_size)
    assert sd["lm_head.weight"].shape == (c.draft_vocab_size, h)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (c.draft_vocab_size,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (c.vocab_size,)
    assert all(t.is_contiguous() for t in sd.values())
    assert not d.embed_tokens.weight.requires_grad
    assert d.embed_tokens.weight.shape == (c.vocab_size, h)
    trainable = {n for n, p in d.named_parameters() if p.requires_grad}
    assert trainable == SERVING_KEYS - {"d2t", "t2d"}


def test_serving_state_dict_round_trip_through_safetensors(tmp_path):
    a = tiny_drafter(seed=1)
    save_file(a.serving_state_dict(), str(tmp_path / "model.safetensors"))
    from safetensors.torch import load_file

    b = Eagle3Drafter(a.config)
    with torch.no_grad():
        b.embed_tokens.weight.copy_(a.embed_tokens.weight)
    b.load_serving_state_dict(load_file(str(tmp_path / "model.safetensors")))
    assert torch.equal(b.d2t, a.d2t) and torch.equal(b.t2d, a.t2d)
    torch.testing.assert_close(_step0_logits(b), _step0_logits(a), atol=0, rtol=0)


def test_load_accepts_sglang_style_names_and_embedding():
    a = tiny_drafter(seed=2)
    sd = {}
    for k, v in a.state_dict().items():
        k = k.replace("midlayer.", "layers.0.")
        sd[k if k.startswith("lm_head") else "model." + k] = v
    b = Eagle3Drafter(a.config)
    b.load_serving_state_dict(sd)
    assert torch.equal(b.embed_tokens.weight, a.embed_tokens.weight)
    torch.testing.assert_close(_step0_logits(b), _step0_logits(a), atol=0, rtol=0)


def test_load_errors_name_keys_and_shapes():
    a = tiny_drafter(seed=3)
    b = Eagle3Drafter(a.config)
    sd = a.serving_state_dict()
    missing = {k: v for k, v in sd.items() if k != "norm.weight"}
    with pytest.raises(ValueError, match=r"missing keys: \['norm.weight'\]"):
        b.load_serving_state_dict(missing)
    b.load_serving_state_dict(missing, strict=False)  # allowed, left as initialised
    with pytest.raises(ValueError, match="unexpected keys: \\['midlayer.extra.weight'\\]"):
        b.load_serving_state_dict({**sd, "midlayer.extra.weight": torch.zeros(1)})
    bad = dict(sd)
    bad["lm_head.weight"] = torch.zeros(5, a.config.hidden_size)
    with pytest.raises(ValueError, match=r"lm_head.weight: checkpoint \(5, 32\) vs model \(24, 32\)"):
        b.load_serving_state_dict(bad, strict=False)
    inconsistent = dict(sd)
    inconsistent["d2t"] = torch.zeros_like(sd["d2t"])  # identity map, but t2d is not the first Vd ids
    with pytest.raises(ValueError, match="vocab mapping"):
        b.load_serving_state_dict(inconsistent)


def test_load_target_embedding_single_and_sharded(tmp_path):
    d = tiny_drafter(seed=4)
    c = d.config
    emb = torch.randn(c.vocab_size, c.hidden_size)
    single = tmp_path / "single"
    single.mkdir()
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": torch.zeros(3, 3)},
              str(single / "model.safetensors"))
    key = d.load_target_embedding(single, ["language_model.model.embed_tokens.weight", "model.embed_tokens.weight"])
    assert key == "model.embed_tokens.weight"
    assert torch.equal(d.embed_tokens.weight, emb)
    assert not d.embed_tokens.weight.requires_grad

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    emb2 = torch.randn(c.vocab_size, c.hidden_size).bfloat16()
    save_file({"other": torch.zeros(2)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"language_model.model.embed_tokens.weight": emb2}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"other": "model-00001-of-00002.safetensors",
                                            "language_model.model.embed_tokens.weight":
                                            "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    key = d.load_target_embedding(sharded, ["model.embed_tokens.weight", "language_model.model.embed_tokens.weight"])
    assert key == "language_model.model.embed_tokens.weight"
    assert torch.equal(d.embed_tokens.weight, emb2.float())

    with pytest.raises(KeyError, match="tok_embeddings.weight"):
        d.load_target_embedding(single, ["tok_embeddings.weight"])
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(7, c.hidden_size)}, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shape \(7, 32\)"):
        d.load_target_embedding(wrong / "model.safetensors", ["model.embed_tokens.weight"])


def test_config_round_trip_and_validation():
    cfg = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    back = DrafterConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg
    with pytest.raises(ValueError, match="missing keys"):
        DrafterConfig.from_dict({k: v for k, v in d.items() if k != "head_dim"})
    with pytest.raises(ValueError, match="not a multiple"):
        tiny_config(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="exceeds vocab_size"):
        tiny_config(draft_vocab_size=65)
    assert tiny_config(rope_scaling={"rope_type": "default"}).rope_scaling is None


def _info(**kw):
    info = dict(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=128,
        vocab_size=300, rms_norm_eps=1e-5, max_position_embeddings=4096, num_layers=30,
        architecture="LlamaForCausalLM", aux_layer_ids=(1, 14, 26),
        rope={"rope_theta": 100000.0, "rope_scaling": None},
    )
    info.update(kw)
    return info


def test_from_target_layouts_and_overrides():
    cfg = DrafterConfig.from_target(_info(), draft_vocab_size=100)
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (64, 64, 2, 8)
    assert cfg.aux_layer_ids == [1, 14, 26] and cfg.target_num_layers == 30
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-5
    yarn = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    v5 = DrafterConfig.from_target(_info(rope={"rope_parameters": {"rope_theta": 50000.0, **yarn}}), 100)
    assert v5.rope_theta == 50000.0 and v5.rope_scaling == yarn
    v4 = DrafterConfig.from_target(_info(rope={"rope_theta": 50000.0, "rope_scaling": yarn}), 100)
    assert v4 == v5
    flat = DrafterConfig.from_target(_info(rope={"rope_theta": 50000.0, **yarn}), 100)
    assert flat == v5
    plain = DrafterConfig.from_target(_info(rope={"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}),
                                      100)
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    # SpecForge's Kimi-K2.5 drafter: plain RoPE theta 1e6 despite the target's yarn
    over = DrafterConfig.from_target(_info(rope={"rope_scaling": yarn}), 100, rope_scaling=None, rope_theta=1e6)
    assert over.rope_scaling is None and over.rope_theta == 1e6
    assert DrafterConfig.from_target(_info(), draft_vocab_size=10_000).draft_vocab_size == 300
    with pytest.raises(ValueError, match="unknown overrides"):
        DrafterConfig.from_target(_info(), 100, hidden=3)
    with pytest.raises(ValueError, match="lacks"):
        DrafterConfig.from_target({"hidden_size": 8}, 100)


def test_from_target_accepts_dataclass():
    from dataclasses import make_dataclass

    info = _info()
    cls = make_dataclass("Info", list(info))
    assert DrafterConfig.from_target(cls(**info), 100) == DrafterConfig.from_target(info, 100)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "dynamic", "factor": 2.0},
    ],
)
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = tiny_config(rope_theta=50000.0, rope_scaling=scaling, max_position_embeddings=2048)
    d = Eagle3Drafter(cfg)
    params = {"rope_type": "default"} if scaling is None else dict(scaling)
    hf = LlamaConfig(hidden_size=cfg.num_attention_heads * cfg.head_dim, num_attention_heads=cfg.num_attention_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=2048,
                     rope_parameters={**params, "rope_theta": 50000.0})
    pos = torch.tensor([[0, 1, 5, 17, 200, 1500]])
    cos_ref, sin_ref = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = d.rope_cos_sin(pos, torch.float32)
    torch.testing.assert_close(cos, cos_ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sin, sin_ref, atol=2e-6, rtol=1e-5)


def test_linear_rope_is_default_at_scaled_positions():
    lin = Eagle3Drafter(tiny_config(rope_scaling={"rope_type": "linear", "factor": 4.0}))
    base = Eagle3Drafter(tiny_config())
    pos = torch.tensor([[0, 4, 8, 40]])
    torch.testing.assert_close(lin.rope_cos_sin(pos, torch.float32)[0], base.rope_cos_sin(pos // 4, torch.float32)[0])


def test_rope_frequencies_survive_bf16_cast():
    d = tiny_drafter().to(torch.bfloat16)
    cos, _ = d.rope_cos_sin(torch.tensor([[1000]]), torch.float32)
    ref, _ = tiny_drafter().rope_cos_sin(torch.tensor([[1000]]), torch.float32)
    torch.testing.assert_close(cos, ref)


def test_rmsnorm_computes_in_fp32():
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 16) * 300).bfloat16()
    out = norm.to(torch.bfloat16)(x)
    x32 = x.float()
    ref = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * norm.weight
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)


def test_step_zero_is_causal_and_ignores_padding():
    d = tiny_drafter(seed=5)
    c = d.config
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, c.vocab_size, (1, 8), generator=g)
    aux = torch.randn(1, 8, 3 * c.target_hidden_size, generator=g)
    pos = torch.arange(8)[None]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        full = d(ids, d.project(aux), pos, TTTCache(), mask)
        ids2, aux2 = ids.clone(), aux.clone()
        ids2[0, 5:] = 3
        aux2[0, 5:] = torch.randn(3, aux.shape[-1])  # changing the future / padding must not move earlier positions
        other = d(ids2, d.project(aux2), pos, TTTCache(), mask)
    torch.testing.assert_close(full[:, :5], other[:, :5], atol=0, rtol=0)


def test_draft_to_target_and_vocab_checks():
    d = tiny_drafter(seed=7)
    used = torch.nonzero(d.t2d).squeeze(-1)
    assert torch.equal(d.draft_to_target(torch.arange(d.config.draft_vocab_size)), used)
    with pytest.raises(ValueError, match="drafter wants"):
        d.set_vocab_mapping(torch.zeros(3, dtype=torch.int64), d.t2d)
    with pytest.raises(ValueError, match="vocab mapping"):
        d.set_vocab_mapping(torch.zeros_like(d.d2t), d.t2d)


@pytest.mark.parametrize("block_rows", [None, 2, 3])  # one block of query rows; blocks of 2 and 3 (uneven)
def test_custom_ttt_attention_backward_is_exact(block_rows):
    """The hand-written backward of the TTT attention matches autograd (gradcheck) and the sdpa path,
    with the query rows in one block or in several."""
    from redraft.core.drafter.ttt_attention import TTTCache, _eager_attention, _sdpa_attention

    torch.manual_seed(0)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    q = torch.randn(2, 1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(2, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    vs = [torch.randn(2, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]

    def eager(q, *kv, n=3):
        return _eager_attention(q, TTTCache(keys=list(kv[:n]), values=list(kv[n:])), mask, block_rows)

    assert torch.autograd.gradcheck(eager, (q, *ks, *vs))
    assert torch.autograd.gradcheck(lambda q, k, v: eager(q, k, v, n=1), (q, ks[0], vs[0]))  # step 0 alone
    weights = torch.randn(2, 1, 2, 5, 4, dtype=torch.float64)
    real = mask.bool()[:, None, None, :, None]  # padded query rows are don't-care in both paths
    for n in (1, 3):
        grads = []
        for fn in (_eager_attention, _sdpa_attention):
            kw = {"block_rows": block_rows} if fn is _eager_attention else {}
            out = fn(q, TTTCache(keys=list(ks[:n]), values=list(vs[:n])), mask, **kw)
            grads.append(torch.autograd.grad((out * weights * real).sum(), [q, *ks[:n], *vs[:n]]))
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("groups,hv", [(2, 4), (1, 3)])  # GQA; one group with MLA's narrower values
def test_flex_ttt_attention_forward_equals_eager(groups, hv):
    """The FlexAttention path (the fused GPU kernel, compiled on CUDA) computes the eager kernel's attention
    with the TTT block mask: step 0 causal over real keys, every later step its diagonal. On a CPU FlexAttention
    has no backward, so its gradients are held equal on a GPU (benchmarks/gpu_check.py) and training with it
    here is refused."""
    from redraft.core.drafter.ttt_attention import TTTCache, _eager_attention, _flex_attention

    torch.manual_seed(2)
    bsz, nkv, seq, hd = 2, 2, 40, 8
    mask = torch.ones(bsz, seq, dtype=torch.long)
    mask[1, 23:] = 0
    q = torch.randn(bsz, nkv, groups, seq, hd, dtype=torch.float64)
    ks = [torch.randn(bsz, nkv, seq, hd, dtype=torch.float64) for _ in range(4)]
    vs = [torch.randn(bsz, nkv, seq, hv, dtype=torch.float64) for _ in range(4)]
    real = mask.bool()[:, None, None, :, None]  # padded query rows are don't-care
    for n in (1, 4):
        cache = TTTCache(keys=list(ks[:n]), values=list(vs[:n]))
        want = _eager_attention(q, cache, mask, block_rows=16, scale=0.3)
        got = _flex_attention(q, cache, mask, scale=0.3)
        torch.testing.assert_close(got * real, want * real, atol=1e-10, rtol=1e-8)
    with pytest.raises(ValueError, match="flex' trains on CUDA only"):
        _flex_attention(q.float().requires_grad_(), TTTCache(keys=[ks[0].float()], values=[vs[0].float()]), mask)


def test_eager_ttt_attention_keeps_no_score_matrix():
    """Blocked over query rows, the eager kernel saves nothing of [T, T] size per head for the backward
    (the old kernel kept every step's probabilities: K x heads x T^2)."""
    from redraft.core.drafter.ttt_attention import TTTCache, _eager_attention

    torch.manual_seed(1)
    bsz, nkv, groups, seq, hd = 1, 2, 2, 64, 8
    q = torch.randn(bsz, nkv, groups, seq, hd, requires_grad=True)
    cache = TTTCache()
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(3):
            cache.keys.append(torch.randn(bsz, nkv, seq, hd, requires_grad=True))
            cache.values.append(torch.randn(bsz, nkv, seq, hd, requires_grad=True))
            out = _eager_attention(q, cache, None, block_rows=16)
    assert max(sizes) <= bsz * nkv * groups * seq * hd  # q-sized, not scores-sized (heads * T * T = 16384)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
