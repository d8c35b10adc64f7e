"""The one EAGLE-3 drafter definition; training, evaluation and export all build it from here.

Parameter and buffer names are the serving names (SGLang/vLLM ``LlamaForCausalLMEagle3`` and
SpecForge's checkpoint layout), so a state dict goes to a checkpoint without renaming:
``fc``, ``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}``,
``midlayer.self_attn.{q,k,v,o}_proj``, ``midlayer.mlp.{gate,up,down}_proj``, ``norm``,
``lm_head`` and the buffers ``d2t`` (offsets, target id = draft id + d2t[draft id]) and
``t2d`` (bool mask over the target vocab). ``embed_tokens`` is the target's frozen input
embedding; serving replaces it with the target's own, so it is never saved.

One step (the math must match SpecForge 0.2.0 to fp32 rounding, see
/work/shared/tools/README-specforge-reference.md):

    x  = cat(input_layernorm(embed(ids)), hidden_norm(h))          # embedding first, width 2H
    h1 = h + o_proj(attention(x))                                   # residual over the un-normed h
    h2 = h1 + down(act(gate(y)) * up(y)),  y = post_attention_layernorm(h1)
    logits = lm_head(norm(h2))                                      # h2 (pre-norm) is fed back

Attention inside a training-time-test unroll (see ``train.ttt``) uses a :class:`TTTCache`:
the first step's keys are attended causally (plus key padding), every later step adds only
its own same-position ("diagonal") key. That is also the pattern of chain drafting at
inference, so offline evaluation can use :meth:`Eagle3Drafter.step` unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

log = logging.getLogger(__name__)

EMBED_KEY = "embed_tokens.weight"


@dataclass
class DrafterConfig:
    """Shape and numerics of the drafter; stored verbatim in checkpoints as redraft's own record."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocab
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # redraft convention (extract.layers): output of decoder layer i
    target_num_layers: int
    target_architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling dict (rope_type linear/dynamic/yarn/llama3 ...) or None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # what config.json advertises for serving

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DrafterConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"DrafterConfig.draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}"
            )
        if not self.aux_layer_ids:
            raise ValueError("DrafterConfig.aux_layer_ids is empty")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"DrafterConfig.hidden_act={self.hidden_act!r} is not a known activation")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type is None:
                raise ValueError(f"DrafterConfig.rope_scaling has no 'rope_type': {self.rope_scaling}")
            if rope_type == "default":
                self.rope_scaling = None

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def from_target(cls, info: Mapping[str, Any] | Any, draft_vocab_size: int, **overrides: Any) -> DrafterConfig:
        """Drafter shaped like the target (SGLang shares the target's embedding, so H must match).

        ``info`` is a TargetInfo (dataclass) or a mapping with the same keys. ``rope`` holds
        either ``rope_theta``/``rope_scaling`` (transformers 4 layout) or ``rope_parameters``
        (transformers 5 layout). ``overrides`` replace any field, e.g. ``rope_scaling=None,
        rope_theta=1e6`` for SpecForge's Kimi-K2.5 drafter.
        """
        if dataclasses.is_dataclass(info) and not isinstance(info, type):
            info = dataclasses.asdict(info)
        info = dict(info)
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size", "num_layers", "aux_layer_ids")
                   if info.get(k) is None]
        if missing:
            raise ValueError(f"DrafterConfig.from_target: target info lacks {missing}")
        theta, scaling = _parse_rope(info.get("rope") or {}, info)
        heads = int(info["num_attention_heads"])
        kw: dict[str, Any] = dict(
            hidden_size=int(info["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(info.get("num_key_value_heads") or heads),
            head_dim=int(info.get("head_dim") or int(info["hidden_size"]) // heads),
            intermediate_size=int(info.get("intermediate_size") or 4 * int(info["hidden_size"])),
            vocab_size=int(info["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(info["hidden_size"]),
            aux_layer_ids=list(info["aux_layer_ids"]),
            target_num_layers=int(info["num_layers"]),
            target_architecture=str(info.get("architecture") or "LlamaForCausalLM"),
            rms_norm_eps=float(info.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(info.get("max_position_embeddings") or 2048),
        )
        if info.get("hidden_act"):
            kw["hidden_act"] = str(info["hidden_act"])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"DrafterConfig.from_target: unknown overrides {sorted(unknown)}")
        kw.update(overrides)
        kw["draft_vocab_size"] = min(int(kw["draft_vocab_size"]), int(kw["vocab_size"]))
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DrafterConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            log.warning("DrafterConfig.from_dict: ignoring unknown keys %s", unknown)
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"DrafterConfig.from_dict: missing keys {missing}")
        return cls(**{k: v for k, v in d.items() if k in names})


def _parse_rope(rope: Mapping[str, Any], info: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either transformers layout."""
    params = rope.get("rope_parameters")
    if params is None and ("rope_type" in rope or "type" in rope):
        params = rope  # a flat transformers-5 rope_parameters dict
    if isinstance(params, Mapping) and ("rope_theta" in params or "rope_type" in params):
        params = dict(params)
        theta = float(params.pop("rope_theta", rope.get("rope_theta", info.get("rope_theta", 10000.0))))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rope_type == "default" else params)
    theta = float(rope.get("rope_theta", info.get("rope_theta", 10000.0)))
    scaling = rope.get("rope_scaling", info.get("rope_scaling"))
    if scaling is not None:
        scaling = dict(scaling)
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    return theta, scaling


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the input dtype (as SpecForge and HF Llama do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DrafterAttention(nn.Module):
    """q/k/v read the 2H-wide concatenation; GQA; no biases."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(y)) * self.up_proj(y))


class DrafterLayer(nn.Module):
    """Container with the serving submodule names; the computation lives in Eagle3Drafter.step."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)


@dataclass
class TTTCache:
    """Keys/values of the steps run so far, unrepeated over GQA groups: [B, n_kv, T, head_dim] each.

    Entry 0 holds the first step's keys (attended causally); entry j >= 1 holds step j's keys,
    which later steps attend only at the same position (the "diagonal").
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    # (attention_mask it was built from, seq, dtype, additive mask [B|1, 1, 1, T, T], rows with no step-0 key
    # [B|1, 1, 1, T, 1] or None): the step-0 causal + key-padding mask is the same at every step of an
    # unroll, so it is built once.
    mask_bias: tuple[Any, int, torch.dtype, torch.Tensor, torch.Tensor | None] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def causal_bias(self, seq: int, attention_mask: torch.Tensor | None, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Additive mask (0 allowed, dtype's min elsewhere) for the step-0 keys and its all-masked rows
        (None without an attention mask), cached per unroll."""
        cached = self.mask_bias
        if cached is not None and cached[0] is attention_mask and cached[1] == seq and cached[2] == dtype:
            return cached[3], cached[4]
        allowed = _causal_allowed(seq, attention_mask, device)
        allowed = allowed[:, None, None] if allowed.dim() == 3 else allowed[None, None, None]
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        dead = None if attention_mask is None else ~allowed.any(-1, keepdim=True)
        self.mask_bias = (attention_mask, seq, dtype, bias, dead)
        return bias, dead


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def compute_inv_freq(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and cos/sin scale, via transformers' ROPE_INIT_FUNCTIONS for scaled types.

    ``dynamic`` is evaluated at its initial length (no NTK growth with the sequence), which
    is what a fixed-length training run and SGLang's drafter see below max_position_embeddings.
    """
    hd = cfg.head_dim
    if cfg.rope_scaling is None:
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        return inv, 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(cfg.rope_scaling)
    rope_type = params.pop("rope_type", None) or params.pop("type")
    params.pop("type", None)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    hf_cfg = LlamaConfig(
        hidden_size=cfg.num_attention_heads * hd,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=hd,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": rope_type, "rope_theta": cfg.rope_theta, **params},
    )
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    return inv.float(), float(scale)


class Eagle3Drafter(nn.Module):
    """One-layer EAGLE-3 drafter (Llama-style layer whose attention reads [embedding, hidden])."""

    def __init__(self, config: DrafterConfig, attention_impl: str = "eager") -> None:
        """attention_impl: "eager" (explicit scores, SpecForge's sdpa-path math; the reference) or
        "sdpa" (torch SDPA over the concatenated step keys with a [T, (k+1)T] mask: never holds
        the [T, T] score matrix on GPU kernels that support masks; same math, other rounding)."""
        super().__init__()
        if attention_impl not in ("eager", "sdpa"):
            raise ValueError(f"attention_impl must be 'eager' or 'sdpa', got {attention_impl!r}")
        self.attention_impl = attention_impl
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(c.num_aux_layers * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DrafterLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # identity mapping until set_vocab_mapping: valid only when Vd == V, which is the point
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Kept out of the buffers on purpose: Module.to(bfloat16) would round the frequencies.
        self._inv_freq, self._rope_scale = compute_inv_freq(c)
        self._inv_freq_dev: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ state
    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """Exactly the keys a serving checkpoint holds (no embed_tokens), contiguous and detached."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if k != EMBED_KEY}

    def serving_keys(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items() if k != EMBED_KEY}

    def load_serving_state_dict(self, sd: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load serving weights; ``embed_tokens.weight`` may be present or absent.

        Also accepts SGLang-style names (``model.`` prefix, ``layers.0.`` for ``midlayer.``).
        Shape mismatches are always errors; missing/unexpected keys are errors when strict.
        """
        own = self.state_dict()
        normalised: dict[str, torch.Tensor] = {}
        for key, tensor in sd.items():
            name = _normalise_key(key)
            if name in normalised:
                raise ValueError(f"load_serving_state_dict: keys {key!r} and another both map to {name!r}")
            normalised[name] = tensor
        expected = set(own) - {EMBED_KEY}
        missing = sorted(expected - set(normalised))
        unexpected = sorted(set(normalised) - set(own))
        bad_shapes = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                      for k, v in normalised.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
        problems = []
        if bad_shapes:
            problems.append("shape mismatches: " + "; ".join(bad_shapes))
        if strict and missing:
            problems.append(f"missing keys: {missing}")
        if strict and unexpected:
            problems.append(f"unexpected keys: {unexpected}")
        if problems:
            raise ValueError("load_serving_state_dict: " + " | ".join(problems))
        if missing:
            log.warning("load_serving_state_dict: missing keys left as initialised: %s", missing)
        if unexpected:
            log.warning("load_serving_state_dict: ignoring unexpected keys: %s", unexpected)
        with torch.no_grad():
            for k, v in normalised.items():
                if k in own:
                    own[k].copy_(v.to(device=own[k].device))
        if "d2t" in normalised or "t2d" in normalised:
            from train.vocab import check_vocab_mapping

            check_vocab_mapping(self.d2t, self.t2d, self.config.vocab_size)

    def load_target_embedding(self, target_path: str | Path, key_candidates: Sequence[str]) -> str:
        """Copy the target's input embedding into embed_tokens, reading only that tensor.

        Looks in ``*.safetensors.index.json`` weight maps first, then in every ``*.safetensors``
        file of the folder (or the file itself). Returns the key used.
        """
        weight, key = read_target_tensor(target_path, key_candidates)
        want = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != want:
            raise ValueError(f"load_target_embedding: {target_path}:{key} has shape {tuple(weight.shape)}, "
                             f"drafter wants {want}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.device))
        log.info("loaded target embedding %s from %s", key, target_path)
        return key

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        from train.vocab import check_vocab_mapping

        c = self.config
        if tuple(d2t.shape) != (c.draft_vocab_size,) or tuple(t2d.shape) != (c.vocab_size,):
            raise ValueError(
                f"set_vocab_mapping: got d2t {tuple(d2t.shape)} and t2d {tuple(t2d.shape)}, "
                f"drafter wants ({c.draft_vocab_size},) and ({c.vocab_size},)"
            )
        check_vocab_mapping(d2t, t2d, c.vocab_size)
        with torch.no_grad():
            self.d2t.copy_(d2t.to(torch.int64))
            self.t2d.copy_(t2d.to(torch.bool))

    # ------------------------------------------------------------------ math
    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux layers [.., n_aux*Ht] -> [.., H]."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(hidden)) over the draft vocab."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Engines' convention: target_id = draft_id + d2t[draft_id]."""
        return draft_ids + self.d2t[draft_ids]

    def rope_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, head_dim] for integer positions, computed in fp32 then cast."""
        dev = position_ids.device
        inv = self._inv_freq_dev.get(dev)
        if inv is None:
            inv = self._inv_freq_dev[dev] = self._inv_freq.to(dev)
        freqs = position_ids.to(torch.float32)[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: TTTCache,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One midlayer application over [B, T] positions; returns h2 (pre-norm) and appends K/V to cache.

        With an empty cache the step attends causally over its own keys (masked by
        ``attention_mask`` [B, T], 1 = real token). Otherwise it attends causally over the
        cached first-step keys plus the same-position keys of every later step, this one included.
        """
        bsz, seq = input_ids.shape
        q, k, v = self.attention_inputs(input_ids, hidden, position_ids)
        q = q.permute(0, 2, 3, 1, 4)  # [B, n_kv, groups, T, hd]
        cache.keys.append(k.transpose(1, 2))  # [B, n_kv, T, hd]
        cache.values.append(v.transpose(1, 2))
        if self.attention_impl == "sdpa":
            out = _sdpa_attention(q, cache, attention_mask)
        else:
            out = _eager_attention(q, cache, attention_mask)
        return self.layer_output(hidden, out.permute(0, 3, 1, 2, 4).reshape(bsz, seq, -1))

    def attention_inputs(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The midlayer up to attention: rotated q [B, T, n_kv, groups, hd] and k, v [B, T, n_kv, hd].

        q is grouped by kv head (head h uses kv head h // groups, as repeat_kv does), so every
        attention pattern (the TTT cache in :meth:`step`, the tree mask in eval.simulate) shares
        this one projection. ``input_ids``/``position_ids`` [B, T], ``hidden`` [B, T, H].
        """
        c = self.config
        mid = self.midlayer
        attn = mid.self_attn
        bsz, seq = input_ids.shape
        nkv, hd = c.num_key_value_heads, c.head_dim
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        x = torch.cat((mid.input_layernorm(emb), mid.hidden_norm(hidden)), dim=-1)
        q = attn.q_proj(x).view(bsz, seq, nkv, c.num_attention_heads // nkv, hd)
        k = attn.k_proj(x).view(bsz, seq, nkv, hd)
        v = attn.v_proj(x).view(bsz, seq, nkv, hd)
        cos, sin = self.rope_cos_sin(position_ids, q.dtype)  # [B, T, hd]
        cos_k, sin_k = cos[:, :, None], sin[:, :, None]
        k = k * cos_k + _rotate_half(k) * sin_k
        q = q * cos_k[:, :, None] + _rotate_half(q) * sin_k[:, :, None]
        return q, k, v

    def layer_output(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The midlayer after attention: o_proj, residual, MLP; ``attn_out`` [B, T, heads*hd] -> h2 [B, T, H]."""
        mid = self.midlayer
        h1 = hidden + mid.self_attn.o_proj(attn_out)
        return h1 + mid.mlp(mid.post_attention_layernorm(h1))


def _causal_allowed(seq: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """bool [T, T] or [B, T, T]: query i may see step-0 key j iff j <= i and j is a real token."""
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if attention_mask is not None:
        allowed = allowed[None] & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
    return allowed


def _eager_attention(q: torch.Tensor, cache: TTTCache, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, n_kv, g, T, hd] -> [B, n_kv, g, T, hd]; causal scores over step-0 keys + diagonal columns."""
    seq = q.shape[-2]
    bias, dead = cache.causal_bias(seq, attention_mask, torch.promote_types(q.dtype, torch.float32), q.device)
    return _TTTAttention.apply(q, bias, dead, len(cache.keys) - 1, *cache.keys, *cache.values)


class _TTTAttention(torch.autograd.Function):
    """One softmax over [causal step-0 keys | k diagonal keys] with a hand-written backward.

    Why: autograd over the plain expression materialises the [T, T] block five or six times per
    step (scale, mask, concatenation with the diagonal, softmax, slicing, and the backward of
    each). Here the block is written by a matmul, masked in place and passed through one
    ``torch.softmax`` (whose vectorised exp is several times faster than ``exp_`` on CPU); the
    diagonal keys join through the block's logsumexp (read off the softmax at its maximum), which
    rescales only [T, hd]-sized tensors. The backward uses FlashAttention's identity
    rowsum(P * dP) = rowsum(dO * O), so the block is touched only by the matmuls and two in-place
    passes. The [T, T] math runs in fp32 or wider (as the reference softmax did); the matmuls run
    in q's dtype. GQA groups are folded into the matmul rows ([B*n_kv, g*T, hd]), which also sums
    the key/value gradients over the groups. Like masked_fill, the mask passes no gradient: a
    query row with no visible key (padding, step 0) gets uniform weights and no score gradient.
    """

    @staticmethod
    def forward(ctx, q, bias, dead, n_diag, *kv):  # type: ignore[override]
        bsz, nkv, groups, seq, hd = q.shape
        keys, values = kv[: n_diag + 1], kv[n_diag + 1:]
        dt, acc = q.dtype, bias.dtype
        qs = q * (1.0 / math.sqrt(hd))
        k0 = keys[0].reshape(bsz * nkv, seq, hd)
        v0 = values[0].reshape(bsz * nkv, seq, hd)
        s0 = torch.bmm(qs.reshape(bsz * nkv, groups * seq, hd), k0.transpose(1, 2))
        s0 = s0.view(bsz, nkv, groups, seq, seq).to(acc).add_(bias)
        m0 = s0.amax(-1)  # [B, n_kv, g, T]
        p0 = torch.softmax(s0, dim=-1)  # over the step-0 keys alone
        del s0
        out = torch.bmm(p0.view(bsz * nkv, groups * seq, seq).to(dt), v0).view(bsz, nkv, groups, seq, hd)
        w0 = pd = None
        if n_diag:
            lse0 = m0 - p0.amax(-1).log()  # p0's maximum is exp(m0 - lse0)
            dg = torch.stack([(qs * kj[:, :, None]).sum(-1) for kj in keys[1:]], dim=-1).to(acc)  # [.., T, k]
            lse = torch.logsumexp(torch.cat((lse0[..., None], dg), dim=-1), dim=-1)
            w0 = torch.exp(lse0 - lse)[..., None]  # share of the step-0 keys in the joint softmax
            pd = torch.exp(dg - lse[..., None])  # probabilities of the diagonal keys
            out = out * w0.to(dt)
            for j, vj in enumerate(values[1:]):
                out = out + pd[..., j : j + 1].to(dt) * vj[:, :, None]
        ctx.n_diag = n_diag
        ctx.dead = dead if n_diag == 0 else None  # with diagonal keys no row is empty
        ctx.save_for_backward(qs, p0, out, *(() if w0 is None else (w0, pd)), *kv)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        n_diag = ctx.n_diag
        saved = ctx.saved_tensors
        qs, p0, out = saved[:3]
        w0 = pd = None
        if n_diag:
            w0, pd = saved[3:5]
        kv = saved[5:] if n_diag else saved[3:]
        keys, values = kv[: n_diag + 1], kv[n_diag + 1:]
        bsz, nkv, groups, seq, hd = qs.shape
        dt, acc = qs.dtype, p0.dtype
        dout = dout.to(dt)
        rowdot = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # [.., T, 1] = rowsum(P * dP), all keys
        # step-0 block: P0 = w0 * p0, so scale dO (small) instead of the [T, T] block
        do0 = dout if w0 is None else dout * w0.to(dt)
        do3 = do0.reshape(bsz * nkv, groups * seq, hd)
        k0 = keys[0].reshape(bsz * nkv, seq, hd)
        v0 = values[0].reshape(bsz * nkv, seq, hd)
        p3 = p0.view(bsz * nkv, groups * seq, seq)
        dv0 = torch.bmm(p3.to(dt).transpose(1, 2), do3)  # [B*n_kv, T, hd], summed over the groups
        dp = torch.bmm(do3, v0.transpose(1, 2)).to(acc).view(bsz, nkv, groups, seq, seq)
        ds = dp.sub_(rowdot if w0 is None else rowdot * w0).mul_(p0)
        if ctx.dead is not None:
            ds.masked_fill_(ctx.dead, 0.0)
        ds3 = ds.view(bsz * nkv, groups * seq, seq).to(dt)
        dqs = torch.bmm(ds3, k0).view(bsz, nkv, groups, seq, hd)
        dk0 = torch.bmm(ds3.transpose(1, 2), qs.reshape(bsz * nkv, groups * seq, hd))
        dkeys = [dk0.view(bsz, nkv, seq, hd)]
        dvalues = [dv0.view(bsz, nkv, seq, hd)]
        if n_diag:
            dpd = torch.stack([(dout * vj[:, :, None]).sum(-1) for vj in values[1:]], dim=-1).to(acc)
            dsd = pd * (dpd - rowdot)  # [.., T, k]
            for j in range(n_diag):
                w = dsd[..., j : j + 1].to(dt)
                dqs = dqs + w * keys[1 + j][:, :, None]
                dkeys.append((w * qs).sum(2))
                dvalues.append((pd[..., j : j + 1].to(dt) * dout).sum(2))
        dq = dqs * (1.0 / math.sqrt(hd))
        return (dq, None, None, None, *dkeys, *dvalues)


def _sdpa_attention(q: torch.Tensor, cache: TTTCache, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Same attention as _eager_attention via F.scaled_dot_product_attention over [k0 | k1 | ... | kk]."""
    bsz, nkv, groups, seq, hd = q.shape
    steps = len(cache.keys)
    allowed = _causal_allowed(seq, attention_mask, q.device)
    if allowed.dim() == 2:
        allowed = allowed[None]
    allowed = allowed.clone()
    allowed[..., 0] = True  # no-op for real rows (key 0 is real); avoids NaN rows in all-padding samples
    if steps > 1:
        eye = torch.eye(seq, dtype=torch.bool, device=q.device).expand(allowed.shape[0], seq, seq)
        allowed = torch.cat([allowed, *([eye] * (steps - 1))], dim=-1)  # [B|1, T, steps*T]
    keys = torch.cat(cache.keys, dim=2).repeat_interleave(groups, dim=1)  # [B, heads, steps*T, hd]
    values = torch.cat(cache.values, dim=2).repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.reshape(bsz, nkv * groups, seq, hd), keys, values, attn_mask=allowed[:, None], scale=1.0 / math.sqrt(hd)
    )
    return out.view(bsz, nkv, groups, seq, hd)


def _normalise_key(key: str) -> str:
    if key.startswith("model."):
        key = key[len("model."):]
    if key.startswith("layers.0."):
        key = "midlayer." + key[len("layers.0."):]
    return key


def read_target_tensor(target_path: str | Path, key_candidates: Sequence[str]) -> tuple[torch.Tensor, str]:
    """(tensor, key) of the first candidate key in the target's safetensors, reading only that tensor.

    Looks in ``*.safetensors.index.json`` weight maps first, then in every ``*.safetensors`` file of
    the folder (or the file itself): the embedding and lm_head of a 1T-parameter target are found
    without touching the rest.
    """
    from safetensors import safe_open

    path = Path(target_path)
    if not key_candidates:
        raise ValueError("read_target_tensor: no key candidates given")
    located = _locate_tensor(path, key_candidates)
    if located is None:
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        raise KeyError(
            f"none of the keys {list(key_candidates)} found in {[str(f) for f in files]} "
            "(or their *.safetensors.index.json)"
        )
    file, key = located
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(key), key


def _locate_tensor(path: Path, keys: Sequence[str]) -> tuple[Path, str] | None:
    """(file, key) of the first candidate key present, reading only headers and index files."""
    from safetensors import safe_open

    if path.is_file():
        files, folder = [path], path.parent
        indexes: list[Path] = []
    else:
        folder = path
        indexes = sorted(folder.glob("*.safetensors.index.json"))
        files = sorted(folder.glob("*.safetensors"))
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"load_target_embedding: cannot read weight_map from {index}: {e}") from e
        for key in keys:
            if key in weight_map:
                return folder / weight_map[key], key
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            present = set(f.keys())
        for key in keys:
            if key in present:
                return file, key
    return None
