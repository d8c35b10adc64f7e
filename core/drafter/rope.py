"""The drafter's rotary position embedding, one definition for both attention kinds.

What the engines do with a drafter's ``config.json`` (read from their source, held by the conformance
lane's rope check against their own rope modules):

- **gqa** (``LlamaForCausalLMEagle3``): the whole ``head_dim`` is rotated in NeoX halves, pairs
  ``(x[i], x[i + d/2])`` (SGLang's and vLLM's ``get_rope(..., is_neox_style=True)``), with the
  frequencies and cos/sin magnitude of the configured ``rope_type`` (``yarn``: ``attention_factor``,
  else ``m(f, mscale) / m(f, mscale_all_dim)`` when both are set, else ``m(f)``); softmax scale
  ``head_dim ** -0.5``.
- **mla** (``Eagle3DeepseekV2ForCausalLM``): only the ``qk_rope_head_dim`` slice is rotated, in
  interleaved pairs ``(x[2i], x[2i + 1])`` (vLLM ``is_neox_style=False``; SGLang ``rope_interleave``,
  default true). Any scaled rope becomes DeepSeek's YaRN (vLLM and SGLang rewrite the type to
  ``deepseek_yarn``): YaRN frequencies, cos/sin magnitude ``m(f, mscale) / m(f, mscale_all_dim)``
  with the defaults ``mscale = 1``, ``mscale_all_dim = 0``, and the softmax scale
  ``qk_head_dim ** -0.5 * m(f, mscale_all_dim) ** 2``.

``m(f, s) = 0.1 * s * ln(f) + 1`` for ``f > 1``, else 1. The frequencies of every type come from
transformers' ``ROPE_INIT_FUNCTIONS`` (the same tables the engines reimplement). ``dynamic`` is taken at
its initial length, which is what a fixed-length training run and an engine below
``max_position_embeddings`` see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.drafter.config import DrafterConfig
from core.drafter.ttt_attention import default_scale

# rope types the MLA drafter can be served with: vLLM and SGLang read any other scaled type as DeepSeek's YaRN
MLA_ROPE_TYPES = ("default", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeTables:
    """What a rope config means for one attention kind: frequencies and the two magnitudes it sets."""

    style: str  # "neox" (halves) or "interleaved" (pairs)
    dim: int  # rotated dimensions per head
    inv_freq: torch.Tensor  # fp32 [dim / 2]
    cos_sin_scale: float  # multiplies cos and sin
    softmax_scale: float  # multiplies q.k (1/sqrt(qk head dim) and any YaRN correction)


def _scaled_inv_freq(cfg: DrafterConfig, rope_type: str, params: dict, dim: int) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention factor for ``rope_type`` over ``dim`` rotated dims."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    hf_cfg = LlamaConfig(
        hidden_size=cfg.num_attention_heads * dim,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        head_dim=dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": rope_type, "rope_theta": cfg.rope_theta, **params},
    )
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    return inv.float(), float(scale)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_tables(cfg: DrafterConfig) -> RopeTables:
    """The frequencies, style and magnitudes ``cfg``'s attention kind is served with (module docstring)."""
    params = dict(cfg.rope_scaling or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if cfg.attention == "mla":
        dim = int(cfg.qk_rope_head_dim)
        qk_dim = int(cfg.qk_nope_head_dim) + dim
        if rope_type == "default":
            return RopeTables("interleaved", dim, _default_inv_freq(cfg.rope_theta, dim), 1.0, qk_dim**-0.5)
        if rope_type not in MLA_ROPE_TYPES or "attention_factor" in params:
            raise ValueError(
                f"rope_scaling {cfg.rope_scaling}: an MLA drafter is served with DeepSeek's YaRN (vLLM and SGLang "
                f"rewrite every scaled rope to deepseek_yarn); supported rope types {MLA_ROPE_TYPES}, without "
                "attention_factor"
            )
        inv, _ = _scaled_inv_freq(cfg, "yarn", params, dim)
        factor = float(params["factor"])
        magnitude = yarn_mscale(factor, float(params.get("mscale", 1.0))) / yarn_mscale(
            factor, float(params.get("mscale_all_dim", 0.0)))
        all_dim = yarn_mscale(factor, float(params.get("mscale_all_dim", 0.0)))
        softmax = qk_dim**-0.5 * all_dim * all_dim  # vLLM's and SGLang's order of the products
        return RopeTables("interleaved", dim, inv, magnitude, softmax)
    dim = int(cfg.head_dim)
    if rope_type == "default":
        return RopeTables("neox", dim, _default_inv_freq(cfg.rope_theta, dim), 1.0, default_scale(dim))
    inv, magnitude = _scaled_inv_freq(cfg, rope_type, params, dim)
    return RopeTables("neox", dim, inv, magnitude, default_scale(dim))


class Rope:
    """cos/sin for integer positions and their application to q or k, in the kind's pairing.

    The tables stay fp32 and off the module's buffers on purpose: ``Module.to(bfloat16)`` would round the
    frequencies.
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        self.tables = rope_tables(cfg)
        self._inv_freq_dev: dict[torch.device, torch.Tensor] = {}

    @property
    def softmax_scale(self) -> float:
        return self.tables.softmax_scale

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [..., dim] for integer positions [...], computed in fp32 then cast; laid out for :meth:`apply`."""
        dev = position_ids.device
        inv = self._inv_freq_dev.get(dev)
        if inv is None:
            inv = self._inv_freq_dev[dev] = self.tables.inv_freq.to(dev)
        freqs = position_ids.to(torch.float32)[..., None] * inv
        if self.tables.style == "neox":
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        scale = self.tables.cos_sin_scale
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x rotated: ``x * cos + rotate(x) * sin`` over its last dim (cos/sin broadcast against x)."""
        return x * cos + self._rotate(x) * sin

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.tables.style == "neox":
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
