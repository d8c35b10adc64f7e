"""Tiny random drafters and vocab maps for the drafter / vocab / TTT tests."""

from __future__ import annotations

import torch

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.kinds import build_drafter
from redraft.core.drafter.modeling import DrafterBase
from redraft.core.drafter.vocab import build_vocab_mapping

# The serving key set, written out by hand (not derived from the code under test): what SGLang/SpecForge
# drafter folders hold, without the embedding.
SERVING_KEYS = frozenset({
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
})


# The MLA drafter's keys (Eagle3DeepseekV2ForCausalLM), also by hand: the attention's seven weights replace q/k/v/o.
MLA_SERVING_KEYS = frozenset(SERVING_KEYS - {
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
} | {
    "midlayer.self_attn.q_a_proj.weight", "midlayer.self_attn.q_a_layernorm.weight", "midlayer.self_attn.q_b_proj.weight",
    "midlayer.self_attn.kv_a_proj_with_mqa.weight", "midlayer.self_attn.kv_a_layernorm.weight",
    "midlayer.self_attn.kv_b_proj.weight",
})

# A small MLA drafter: the latent must be the served 512 + 64, everything else is tiny.
TINY_MLA = dict(attention="mla", num_key_value_heads=4, head_dim=8 + 64, q_lora_rank=24, kv_lora_rank=512,
                qk_nope_head_dim=8, qk_rope_head_dim=64, v_head_dim=12)


def tiny_config(**overrides) -> DrafterConfig:
    kw = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=64,
        draft_vocab_size=24,
        target_hidden_size=20,
        aux_layer_ids=[1, 2, 4],
        target_num_layers=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    kw.update(overrides)
    return DrafterConfig(**kw)


def random_batch(c: DrafterConfig, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [1, seq], aux states [1, seq, n_aux * target hidden]) drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (1, seq), generator=g)
    aux = torch.randn(1, seq, c.num_aux_layers * c.target_hidden_size, generator=g)
    return ids, aux


def tiny_mla_config(**overrides) -> DrafterConfig:
    return tiny_config(**{**TINY_MLA, **overrides})


def tiny_drafter(seed: int = 0, **overrides) -> DrafterBase:
    """Random drafter with non-trivial norm weights and a non-identity draft vocab."""
    torch.manual_seed(seed)
    if overrides.get("attention") == "mla":
        overrides = {**TINY_MLA, **overrides}
    cfg = tiny_config(**overrides)
    d = build_drafter(cfg)
    with torch.no_grad():
        d.embed_tokens.weight.normal_(0, 1.0)
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and p.requires_grad:
                p.normal_(0, p.shape[1] ** -0.5)  # O(1) activations at every step
    g = torch.Generator().manual_seed(seed + 1)
    counts = torch.randint(0, 1000, (cfg.vocab_size,), generator=g)
    d2t, t2d = build_vocab_mapping(counts, cfg.draft_vocab_size)
    d.set_vocab_mapping(d2t, t2d)
    return d
