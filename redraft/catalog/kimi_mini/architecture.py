"""kimi-k25-mini's architecture: Kimi-K2.5's text config values, kept or shrunk (:func:`text_config`)."""

from __future__ import annotations

import json
from typing import Any

NAME = "kimi-k25-mini"
BUILD_VERSION = 1  # bump when the build code changes what it writes (the recipe digest covers the values)

KIMI_K25_SOURCE = (
    "moonshotai/Kimi-K2.5 config.json text_config as loaded by transformers 5.7 (a published model report), "
    "cross-checked against Kimi-K2 and Kimi-K2-Instruct-0905 configs where they agree"
)

# ---------------------------------------------------------------------------------------------------------
# The architecture
# ---------------------------------------------------------------------------------------------------------

KIMI_ROPE_SCALING: dict[str, Any] = {  # Kimi's published rope_scaling (K2 family, factor 64): beta_fast = beta_slow = 1
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Kimi-K2.5's text_config values kept exactly (DeepSeek-V3 keys). The MLA latent 512 + 64 is also the only one
# vLLM CPU's MLA decode kernel accepts (576).
KIMI_K25_TEXT_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 163840,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "routed_scaling_factor": 2.827,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "rope_scaling": KIMI_ROPE_SCALING,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "initializer_range": 0.02,
}

# What is shrunk: Kimi-K2.5's value, the miniature's. Kimi's active FFN width per token (8 routed + 1 shared
# experts of 2048) equals its dense layer's 18432; the miniature keeps that identity (4 + 1 of 64 = 320).
# q_lora_rank is shrunk for cost: Kimi's 1536 is a fifth of its width; at width 256 it would be a "low-rank"
# path six times wider than the model and 40% of all the compute. 256 keeps it no wider than the model.
# Depth 4 and 2 heads keep the build within its budget on 2 CPU cores (each head costs a fixed 512 x 256 of the
# kv latent up-projection, since the latent 512 and the head dims 128/64/128 are Kimi's).
KIMI_K25_SHRUNK: dict[str, tuple[int, int]] = {
    "hidden_size": (7168, 256),
    "intermediate_size": (18432, 320),
    "moe_intermediate_size": (2048, 64),
    "num_hidden_layers": (61, 4),
    "num_attention_heads": (64, 2),
    "num_key_value_heads": (64, 2),
    "n_routed_experts": (384, 16),
    "num_experts_per_tok": (8, 4),
    "q_lora_rank": (1536, 256),
}


# Every other deliberate deviation from Kimi-K2.5, by what differs (the README lists the same):
KIMI_K25_DEVIATIONS: dict[str, str] = {
    "sizes": "widths, depth, heads, expert counts and q_lora_rank are shrunk (KIMI_K25_SHRUNK: Kimi's value, the "
             "miniature's)",
    "architectures / model_type": "a text-only DeepseekV3ForCausalLM / deepseek_v3; Kimi-K2.5 is "
                                  "KimiK25ForConditionalGeneration / kimi_k25 with the text model nested (model_type "
                                  "kimi_k2); write_wrapped() writes that served layout",
    "vision": "no vision tower or media encoder in the plain folder (the drafter sees only the text model); "
              "write_wrapped() adds an untrained token-sized one (KIMI_K25_VISION_SHRUNK) and a processor that "
              "takes no images",
    "tokenizer": "SmolLM2's byte-level BPE for text (49,163 of 163,840 ids) with Kimi-K2.5's special tokens at its "
                 "ids; Kimi's tiktoken tokenizer is remote code that cannot be had offline",
    "weights": "float32, a few minutes of training on 120 chitchat openings; Kimi-K2.5 publishes quantised weights",
}


def text_config() -> dict[str, Any]:
    """The miniature's DeepSeek-V3 text config (config.json keys): Kimi's kept values plus the shrunk sizes."""
    cfg = json.loads(json.dumps(KIMI_K25_TEXT_CONFIG))
    cfg.update({k: mini for k, (_, mini) in KIMI_K25_SHRUNK.items()})
    return cfg
