"""The drafter's rotary position embedding, one definition for both attention kinds.

What the engines do with a drafter's ``config.json`` (read from their source, held by the conformance
lane's rope check, ``conformance/rope_check.py``, against their own rope modules: cos/sin, pairing and softmax
scale equal to 1e-6 relative for every rope type below):

- **gqa** (``LlamaForCausalLMEagle3``): the whole ``head_dim`` is rotated in NeoX halves, pairs
  ``(x[i], x[i + d/2])`` (SGLang's and vLLM's ``get_rope(..., is_neox_style=True)``), with the
  frequencies and cos/sin magnitude of the configured ``rope_type`` (``yarn``: ``attention_factor``,
  else ``m(f, mscale) / m(f, mscale_all_dim)`` when both are set and non-zero, else ``m(f)``); softmax scale
  ``head_dim ** -0.5``. ``linear`` divides the positions by the factor (in fp32) before the frequencies, as
  both engines' ``LinearScalingRotaryEmbedding`` do, rather than dividing the frequencies (transformers): the
  two roundings differ by 2e-4 at position 5,000 for a factor of 2.5.
- **mla** (``Eagle3DeepseekV2ForCausalLM``): only the ``qk_rope_head_dim`` slice is rotated, in
  interleaved pairs ``(x[2i], x[2i + 1])`` (vLLM ``is_neox_style=False``; SGLang ``rope_interleave``,
  default true). Any scaled rope becomes DeepSeek's YaRN (vLLM and SGLang rewrite the type to
  ``deepseek_yarn``): YaRN frequencies, always with the truncated correction range (neither engine's
  ``DeepseekScalingRotaryEmbedding`` reads ``truncate``), cos/sin magnitude ``m(f, mscale) / m(f, mscale_all_dim)``
  with the defaults ``mscale = 1``, ``mscale_all_dim = 0``, and the softmax scale
  ``qk_head_dim ** -0.5 * m(f, mscale_all_dim) ** 2``.

``m(f, s) = 0.1 * s * ln(f) + 1`` for ``f > 1``, else 1. The frequencies of every type come from
transformers' ``ROPE_INIT_FUNCTIONS`` (the same tables the engines reimplement). ``dynamic`` is taken at
its initial length, which is what a fixed-length training run and vLLM serve.

Where the two engines serve one config two ways, :func:`engine_rope_deviations` names the engine and the key
(SGLang 0.5.23: ``dynamic`` at the NTK base of ``factor x max_position_embeddings`` at every position; a YaRN
magnitude from ``attention_factor`` or from a zero ``mscale``/``mscale_all_dim``, which SGLang reads its own
way); ``eval.export`` refuses to export such a drafter for that engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.ttt_attention import default_scale

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
    position_divisor: float = 1.0  # positions are divided by it (fp32) before the frequencies: linear's factor


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


def _rope_params(cfg: DrafterConfig) -> tuple[str, dict]:
    """(rope type, its other keys) of ``cfg.rope_scaling``."""
    params = dict(cfg.rope_scaling or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    return rope_type, params


def rope_tables(cfg: DrafterConfig) -> RopeTables:
    """The frequencies, style and magnitudes ``cfg``'s attention kind is served with (module docstring)."""
    rope_type, params = _rope_params(cfg)
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
        params.pop("truncate", None)  # DeepseekScalingRotaryEmbedding (both engines) always truncates
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
    if rope_type == "linear":  # the engines' LinearScalingRotaryEmbedding: (position / factor) * inv_freq
        _scaled_inv_freq(cfg, rope_type, params, dim)  # transformers' checks of the keys
        return RopeTables("neox", dim, _default_inv_freq(cfg.rope_theta, dim), 1.0, default_scale(dim),
                          position_divisor=float(params["factor"]))
    inv, magnitude = _scaled_inv_freq(cfg, rope_type, params, dim)
    return RopeTables("neox", dim, inv, magnitude, default_scale(dim))


def _sglang_yarn_magnitude(params: dict) -> float:
    """SGLang 0.5.23's YaRN cos/sin magnitude (``layers/rotary_embedding/yarn.py``, YaRNScalingRotaryEmbedding):
    the ratio when ``mscale`` and ``mscale_all_dim`` are both given (None-tested, not truth-tested), else ``m(f)``,
    times ``attn_factor``; ``attention_factor`` is not read (the factory passes only its own key names)."""
    factor = float(params.get("factor", 1.0))
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale is not None and all_dim is not None:
        magnitude = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dim))
    else:
        magnitude = yarn_mscale(factor)
    return magnitude * float(params.get("attn_factor", 1.0))


def engine_rope_deviations(cfg: DrafterConfig) -> dict[str, str]:
    """{engine: how it serves ``cfg``'s rope differently from training, by config key}; empty when both engines
    serve what the drafter trains with. Each entry is held against the engine by the conformance lane's rope
    check (a deviation that disappears, or one not listed here, fails it)."""
    if cfg.attention != "gqa":  # MLA: both engines run DeepSeek's YaRN, exactly what rope_tables trains with
        return {}
    rope_type, params = _rope_params(cfg)
    out: dict[str, str] = {}
    if rope_type == "dynamic" and float(params.get("factor", 1.0)) != 1.0:
        f, d = float(params["factor"]), int(cfg.head_dim)
        served = cfg.rope_theta * (f * f - f + 1) ** (d / (d - 2))
        out["sglang"] = (
            f"rope_scaling.rope_type='dynamic' (factor={f:g}): SGLang 0.5.23's DynamicNTKScalingRotaryEmbedding "
            f"rotates at every position with the NTK base of factor x max_position_embeddings, rope_theta "
            f"{served:.6g}; the drafter trains (and vLLM serves) with rope_theta {cfg.rope_theta:.6g} up to "
            f"max_position_embeddings {cfg.max_position_embeddings}"
        )
    if rope_type == "yarn":
        ours, sglang = rope_tables(cfg).cos_sin_scale, _sglang_yarn_magnitude(params)
        if not math.isclose(ours, sglang, rel_tol=1e-6):
            keys = [f"rope_scaling.{k}={params[k]!r}" for k in ("attention_factor", "attn_factor", "mscale",
                                                                 "mscale_all_dim") if k in params]
            out["sglang"] = (
                f"{', '.join(keys) or 'rope_scaling'}: SGLang 0.5.23's YaRNScalingRotaryEmbedding scales cos/sin by "
                f"{sglang:.6g}, the drafter trains (and vLLM serves) with {ours:.6g} (SGLang reads neither "
                "attention_factor nor a zero mscale/mscale_all_dim the way transformers and vLLM do)"
            )
    return out


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
        t = position_ids.to(torch.float32)
        if self.tables.position_divisor != 1.0:
            t = t / self.tables.position_divisor
        freqs = t[..., None] * inv
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
