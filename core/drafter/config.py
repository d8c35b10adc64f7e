"""The drafter's shape and numerics (:class:`DrafterConfig`), stored verbatim in every checkpoint's redraft.json."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers.activations import ACT2FN

log = logging.getLogger(__name__)


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
    aux_layer_ids: list[int]  # redraft convention (core.layers): output of decoder layer i
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
