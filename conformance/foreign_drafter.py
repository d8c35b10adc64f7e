"""Random EAGLE-3 drafter folders in the engines' own layout, written WITHOUT ``redraft.core.drafter``.

    python -m conformance.foreign_drafter OUT --preset llama-tiny|llama-smollm [--rename A=B] [--drop KEY]
    python -m conformance.foreign_drafter OUT --preset mla-tiny|mla-tiny-direct-q|mla-kimi [--config K=JSON]

Why not through the product: these folders stand for drafters made elsewhere (SpecForge, a model hub)
and for the MLA layout the engines read but our exporter does not write yet, so their layout is
spelled here from the engines' loaders (SGLang 0.5.23 ``llama_eagle3.py`` / ``kimi_k25_eagle3.py``,
vLLM 0.33.0 ``llama_eagle3.py`` / ``deepseek_eagle3.py``), not from our own key table. They feed the
warm start (``train/main.py --init-from``), the engine-loading phase and its negative controls
(``--rename``, ``--drop``). Weights are random; every float tensor is built one at a time in the
target dtype, so a Kimi-sized folder (about 0.9 B parameters) never holds an fp32 copy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from redraft.core import cli as ending
from redraft.core.layers import ENGINES, from_engine_layer_ids, to_engine_layer_ids

LLAMA_ARCH = "LlamaForCausalLMEagle3"
MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"
WEIGHTS = "model.safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Kimi-K2.x's long-context rope (yarn over a 4096-token original context)
KIMI_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
KIMI_TARGET_ARCH, KIMI_TARGET_LAYERS = "KimiK25ForConditionalGeneration", 61
SMOLLM_TARGET_ARCH, SMOLLM_TARGET_LAYERS = "LlamaForCausalLM", 30  # SmolLM2-135M, the demo's target


def config_layer_ids(ours: Sequence[int], architecture: str, num_layers: int,
                     engines: Sequence[str] = ENGINES) -> tuple[int, ...]:
    """The config.json ids that make each of ``engines`` capture our layer ids ``ours``.

    Candidates are each engine's own spelling (``redraft.core.layers.to_engine_layer_ids``, the rule's one home), kept when
    every engine reads it back as ``ours`` (``from_engine_layer_ids``): a preset whose folder every engine reads
    must mean the same layers to each. Kimi-K2.5's ``[1, 29, 57]``: SGLang's own spelling is ``[1, 29, 57]`` (read
    alike by 0.5.10 and 0.5.23), vLLM's ``[2, 30, 58]``, which SGLang 0.5.23 reads as the same layers.
    """
    ours = sorted(int(i) for i in ours)
    spellings = [tuple(to_engine_layer_ids(ours, e, architecture, num_layers)) for e in engines]
    shared = [c for c in spellings if all(from_engine_layer_ids(c, e, architecture) == ours for e in engines)]
    if not shared:
        raise ValueError(f"our layer ids {ours} ({architecture}) need different config ids per engine: "
                         f"{sorted(set(spellings))}; name the engine whose layout the folder stands for")
    return shared[0]


@dataclass(frozen=True)
class LlamaShape:
    """A one-layer Llama EAGLE-3 drafter (GQA attention), as SGLang/SpecForge checkpoints hold it."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 1000
    draft_vocab: int = 200
    target_hidden: int = 64
    aux_layer_ids: tuple[int, ...] = (2, 4, 6)  # config ids as the engine reads them (what config.json carries)
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "bfloat16"

    def config(self) -> dict[str, Any]:
        return {
            "architectures": [LLAMA_ARCH], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": None,
            "max_position_embeddings": self.max_positions, "vocab_size": self.vocab,
            "draft_vocab_size": self.draft_vocab, "target_hidden_size": self.target_hidden,
            "tie_word_embeddings": False, "torch_dtype": self.dtype,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        }

    def tensors(self) -> dict[str, tuple[int, ...]]:
        h, a = self.hidden, "midlayer.self_attn."
        return {
            "fc.weight": (h, len(self.aux_layer_ids) * self.target_hidden),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.input_layernorm.weight": (h,),
            f"{a}q_proj.weight": (self.heads * self.head_dim, 2 * h),
            f"{a}k_proj.weight": (self.kv_heads * self.head_dim, 2 * h),
            f"{a}v_proj.weight": (self.kv_heads * self.head_dim, 2 * h),
            f"{a}o_proj.weight": (h, self.heads * self.head_dim),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (self.intermediate, h),
            "midlayer.mlp.up_proj.weight": (self.intermediate, h),
            "midlayer.mlp.down_proj.weight": (h, self.intermediate),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab, h),
        }


@dataclass(frozen=True)
class MlaShape:
    """A one-layer EAGLE-3 drafter with DeepSeek-V2 multi-latent attention (Kimi-K2.5's MLA drafter).

    ``q_lora_rank`` None means a direct ``q_proj`` (no q LoRA), which DeepSeek-V2-Lite targets use.
    """

    hidden: int = 64
    heads: int = 4
    q_lora_rank: int | None = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    intermediate: int = 128
    vocab: int = 1000
    draft_vocab: int = 200
    target_hidden: int = 64
    aux_layer_ids: tuple[int, ...] = (2, 4, 6)
    max_positions: int = 4096
    rope_theta: float = 50000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "bfloat16"
    rope_scaling: Mapping[str, Any] | None = field(default=None)

    def config(self) -> dict[str, Any]:
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return {
            "architectures": [MLA_ARCH], "model_type": "deepseek_v2", "num_hidden_layers": 1,
            "hidden_size": self.hidden, "num_attention_heads": self.heads, "num_key_value_heads": self.heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "intermediate_size": self.intermediate, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab, "draft_vocab_size": self.draft_vocab,
            "target_hidden_size": self.target_hidden, "num_aux_hidden_states": len(self.aux_layer_ids),
            "max_position_embeddings": self.max_positions, "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_parameters, "tie_word_embeddings": False, "torch_dtype": self.dtype,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        }

    def tensors(self) -> dict[str, tuple[int, ...]]:
        h, n, a = self.hidden, self.heads, "midlayer.self_attn."
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        out: dict[str, tuple[int, ...]] = {"fc.weight": (h, len(self.aux_layer_ids) * self.target_hidden)}
        if self.q_lora_rank is None:
            out[f"{a}q_proj.weight"] = (n * qk, 2 * h)
        else:
            out[f"{a}q_a_proj.weight"] = (self.q_lora_rank, 2 * h)
            out[f"{a}q_a_layernorm.weight"] = (self.q_lora_rank,)
            out[f"{a}q_b_proj.weight"] = (n * qk, self.q_lora_rank)
        out.update({
            f"{a}kv_a_proj_with_mqa.weight": (self.kv_lora_rank + self.qk_rope_head_dim, 2 * h),
            f"{a}kv_a_layernorm.weight": (self.kv_lora_rank,),
            f"{a}kv_b_proj.weight": (n * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            f"{a}o_proj.weight": (h, n * self.v_head_dim),
            "midlayer.mlp.gate_proj.weight": (self.intermediate, h),
            "midlayer.mlp.up_proj.weight": (self.intermediate, h),
            "midlayer.mlp.down_proj.weight": (h, self.intermediate),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab, h),
        })
        return out


PRESETS: dict[str, LlamaShape | MlaShape] = {
    "llama-tiny": LlamaShape(),
    # the demo drafter's shape (configs/demo/train.yaml on SmolLM2-135M) in SGLang's layout, so SGLang's
    # config ids for our [1, 14, 26] (vLLM would read these as our [0, 13, 25] for a Llama target)
    "llama-smollm": LlamaShape(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=768, vocab=49152,
                               draft_vocab=4096, target_hidden=576, max_positions=8192,
                               aux_layer_ids=config_layer_ids((1, 14, 26), SMOLLM_TARGET_ARCH,
                                                              SMOLLM_TARGET_LAYERS, engines=("sglang",))),
    "mla-tiny": MlaShape(),
    "mla-tiny-direct-q": MlaShape(q_lora_rank=None),
    # Kimi-K2.5's MLA drafter: a 61-layer target, our ids [1, 29, 57] (the same config ids to both engines,
    # checked by config_layer_ids), the target's yarn rope
    "mla-kimi": MlaShape(hidden=7168, heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, intermediate=18432, vocab=163840, draft_vocab=32000,
                         target_hidden=7168, max_positions=262144, rope_scaling=KIMI_YARN,
                         aux_layer_ids=config_layer_ids((1, 29, 57), KIMI_TARGET_ARCH, KIMI_TARGET_LAYERS)),
}


def kimi_k25_target_config() -> dict[str, Any]:
    """A Kimi-K2.5-shaped target config.json (the multimodal wrapper around a DeepSeek-V3 text model).

    What vLLM reads from a target to build an EAGLE-3 drafter: vocab, hidden size, layer count,
    dtype. The MoE and vision numbers only need to be valid; they are Kimi-K2.x's shape, not a copy
    of any released file.
    """
    text = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": KIMI_TARGET_LAYERS,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
        "rope_theta": 50000.0, "rope_scaling": dict(KIMI_YARN), "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return {"architectures": [KIMI_TARGET_ARCH], "model_type": "kimi_k25", "text_config": text,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def vocab_maps(vocab: int, draft_vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd] offsets, t2d bool [V]): a random draft vocabulary in ascending target-id order."""
    if not 0 < draft_vocab <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} must be in 1..vocab_size ({vocab})")
    chosen = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab), t2d


def random_state(shape: LlamaShape | MlaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of ``shape`` in its dtype: norms near 1, matrices ~N(0, 0.02), plus d2t/t2d."""
    dtype = DTYPES[shape.dtype]
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key, dims in shape.tensors().items():
        t = torch.empty(dims, dtype=dtype)
        if len(dims) == 1:
            t.uniform_(0.8, 1.2, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        state[key] = t
    state["d2t"], state["t2d"] = vocab_maps(shape.vocab, shape.draft_vocab, g)
    return state


def apply_defects(state: dict[str, torch.Tensor], renames: Mapping[str, str],
                  drops: Sequence[str]) -> dict[str, torch.Tensor]:
    """The state with keys renamed and dropped; a name that is not there is an error (a typo'd control)."""
    out = dict(state)
    for old, new in renames.items():
        if old not in out:
            raise KeyError(f"--rename {old}={new}: no key {old!r} (keys: {', '.join(sorted(out))})")
        out[new] = out.pop(old)
    for key in drops:
        if key not in out:
            raise KeyError(f"--drop {key}: no key {key!r} (keys: {', '.join(sorted(out))})")
        del out[key]
    return out


def write_folder(out: Path, shape: LlamaShape | MlaShape, *, seed: int = 0, renames: Mapping[str, str] | None = None,
                 drops: Sequence[str] = (), config_overrides: Mapping[str, Any] | None = None) -> Path:
    """``out``/config.json + model.safetensors, written under a temporary name and renamed (never half there)."""
    from safetensors.torch import save_file

    state = apply_defects(random_state(shape, seed), renames or {}, drops)
    config = {**shape.config(), **(config_overrides or {})}
    tmp = out.with_name(f".tmp-{out.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise SystemExit(f"{flag} {item!r}: expected OLD=NEW")
        out[old] = new
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.foreign_drafter", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="override the preset's dtype")
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="rename a key (negative control)")
    p.add_argument("--drop", action="append", default=[], metavar="KEY", help="leave a key out (negative control)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=JSON",
                   help="override one config.json value (e.g. num_hidden_layers=2)")
    a = p.parse_args(argv)
    shape = PRESETS[a.preset]
    if a.dtype:
        shape = replace(shape, dtype=a.dtype)
    overrides = {k: json.loads(v) for k, v in _pairs(a.config, "--config").items()}
    write_folder(a.out, shape, seed=a.seed, renames=_pairs(a.rename, "--rename"), drops=a.drop,
                 config_overrides=overrides)
    n = sum(int(torch.Size(d).numel()) for d in shape.tensors().values())
    print(f"[foreign_drafter] {a.out}: {a.preset} ({type(shape).__name__}, {n / 1e6:.1f} M parameters, "
          f"{shape.dtype}); shape {json.dumps(asdict(shape))}")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("conformance.foreign_drafter")))
