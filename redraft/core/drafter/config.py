"""The drafter's shape and numerics (:class:`DrafterConfig`), stored verbatim in every checkpoint's redraft.json.

One drafter, two attention kinds chosen by ``attention`` (as transformers picks an attention class by config):
``gqa``, the Llama-style layer (``LlamaForCausalLMEagle3``: ``num_key_value_heads``, ``head_dim``), and ``mla``,
DeepSeek's multi-head latent attention (``Eagle3DeepseekV2ForCausalLM``: ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``). A config that mixes the two is refused by name.

Three methods chosen by ``method`` (:data:`METHODS`): ``eagle3``; ``eagle3.1`` (either attention kind), which
adds what both engines call ``fc_norm`` (an RMSNorm per aux layer's chunk before ``fc``) and ``norm_output``
(the state a step passes to the next is taken after the final norm, the tensor ``lm_head`` reads); and
``p-eagle`` (parallel drafting, vLLM's ``parallel_drafting``): draft 1 as EAGLE-3's first step, drafts 2..K in
the same pass from slots that read a placeholder token (``mask_token_id``) and a learned ``mask_hidden`` instead
of the previous step's token and state; ``dflash`` (vLLM's ``DFlashDraftModel``, :mod:`redraft.core.drafter.dflash`), a
block drafter of ``num_layers`` Qwen3-style layers: the target's states enter every layer as keys and values,
and a block of the new token and K ``mask_token_id`` slots drafts all K tokens in one bidirectional pass. One
field, so that the switches cannot be mixed: the engines read each on its own, and a drafter trained with one
rule and served with another drafts garbage silently.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers.activations import ACT2FN

from redraft.core.layers import check_servable

log = logging.getLogger(__name__)

ATTENTION_KINDS = ("gqa", "mla")
METHODS = ("eagle3", "eagle3.1", "p-eagle", "dflash")
# the methods that embed a placeholder token (mask_token_id) in the slots they draft from
MASK_TOKEN_METHODS = ("p-eagle", "dflash")
# The drafter classes that draft in parallel in vLLM 0.32 (Eagle3LlamaForCausalLM, Eagle3Qwen3ForCausalLM): its
# MLA drafter (Eagle3DeepseekV2ForCausalLM) has no mask_hidden and fails at load, and SGLang 0.5.23 has no
# parallel drafting at all.
PARALLEL_ATTENTION = ("gqa",)
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# (kv_lora_rank, qk_rope_head_dim) of every DeepSeek-V2/V3 and Kimi-K2 model, and the only latent the MLA
# kernels of vLLM CPU, FlashMLA, FlashInfer and CUTLASS take.
MLA_SERVED_LATENT = (512, 64)
# MLA sizes for a target that has none of its own (a Llama-style target): DeepSeek-V3's and Kimi-K2.5's.
DEFAULT_MLA_SIZES = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128}
# rope types whose frequencies depend on a pretraining length, original_max_position_embeddings: transformers'
# standardize_rope_params (and so vLLM's config) and SGLang's get_rope default it to max_position_embeddings
ORIGINAL_LENGTH_TYPES = ("yarn", "llama3", "longrope")


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
    aux_layer_ids: list[int]  # redraft convention (redraft.core.layers): output of decoder layer i
    target_num_layers: int
    target_architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling dict (rope_type linear/dynamic/yarn/llama3 ...) or None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # what config.json advertises for serving
    attention: str = "gqa"  # "gqa" (Llama-style) or "mla" (DeepSeek multi-head latent attention)
    # MLA sizes (attention "mla" only; None for gqa). head_dim is then the q/k head dim (nope + rope).
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    method: str = "eagle3"  # or "eagle3.1": fc_norm + norm_output, "p-eagle" or "dflash" (module docstring)
    mask_token_id: int | None = None  # p-eagle and dflash: the token id every parallel slot embeds
    num_layers: int = 1  # decoder layers: 1 for the EAGLE methods, any for dflash
    block_size: int | None = None  # dflash only: the trained block (the new token + block_size - 1 drafts)

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DrafterConfig.{name} must be positive, got {getattr(self, name)}")
        self._check_attention_kind()
        self._check_method()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.attention == "gqa" and self.head_dim % 2:
            raise ValueError(f"DrafterConfig.head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"DrafterConfig.draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}"
            )
        if not self.aux_layer_ids:
            raise ValueError("DrafterConfig.aux_layer_ids is empty")
        try:
            check_servable(self.aux_layer_ids, self.target_architecture, self.target_num_layers)
        except ValueError as e:
            raise ValueError(f"DrafterConfig.{e}") from None
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"DrafterConfig.hidden_act={self.hidden_act!r} is not a known activation")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type is None:
                raise ValueError(f"DrafterConfig.rope_scaling has no 'rope_type': {self.rope_scaling}")
            if rope_type == "default":
                self.rope_scaling = None
            elif rope_type in ORIGINAL_LENGTH_TYPES and "original_max_position_embeddings" not in self.rope_scaling:
                # What transformers and both engines default it to, pinned now: an export with a longer
                # max_position_embeddings (the target's context) must not move the YaRN / llama3 frequencies.
                self.rope_scaling["original_max_position_embeddings"] = int(self.max_position_embeddings)

    def _check_method(self) -> None:
        """A known method with exactly its own settings: a mask token for p-eagle and dflash, layers and a block
        for dflash, and an attention kind the engine serves with that method."""
        if self.method not in METHODS:
            raise ValueError(f"DrafterConfig.method={self.method!r} is not one of {METHODS}")
        self.num_layers = int(self.num_layers)
        if self.method != "dflash":
            if self.num_layers != 1:
                raise ValueError(f"DrafterConfig.num_layers={self.num_layers} is a dflash setting but method is "
                                 f"{self.method!r} (an EAGLE drafter has one layer); set method: dflash, or drop it")
            if self.block_size is not None:
                raise ValueError(f"DrafterConfig.block_size={self.block_size} is a dflash setting but method is "
                                 f"{self.method!r}; set method: dflash, or drop block_size")
        if self.method not in MASK_TOKEN_METHODS:
            if self.mask_token_id is not None:
                raise ValueError(f"DrafterConfig.mask_token_id={self.mask_token_id} is a p-eagle/dflash setting but "
                                 f"method is {self.method!r}; set method: p-eagle or dflash, or drop mask_token_id")
            return
        if self.method == "p-eagle" and self.attention not in PARALLEL_ATTENTION:
            raise ValueError(f"DrafterConfig.method='p-eagle' with attention={self.attention!r}: vLLM 0.32 drafts in "
                             "parallel only with its Llama/Qwen3 EAGLE-3 classes (its MLA drafter, "
                             "Eagle3DeepseekV2ForCausalLM, has no mask_hidden) and SGLang 0.5.23 not at all; "
                             "use attention: gqa")
        if self.method == "dflash":
            self._check_dflash()
        if self.mask_token_id is None:
            raise ValueError(f"DrafterConfig.mask_token_id is required with method {self.method!r} (vLLM embeds it "
                             "in every slot it drafts from and refuses the drafter without it)")
        self.mask_token_id = int(self.mask_token_id)
        if not 0 <= self.mask_token_id < int(self.vocab_size):
            raise ValueError(f"DrafterConfig.mask_token_id={self.mask_token_id} is outside the target vocab "
                             f"[0, {self.vocab_size})")

    def _check_dflash(self) -> None:
        """vLLM's DFlashDraftModel: Qwen3-style GQA layers, at least one, a block of at least one draft, and the
        width of the target (its embedding feeds the block)."""
        if self.attention != "gqa":
            raise ValueError(f"DrafterConfig.method='dflash' with attention={self.attention!r}: vLLM 0.32's "
                             "DFlashDraftModel is a Qwen3 (GQA) stack; use attention: gqa")
        if self.num_layers < 1:
            raise ValueError(f"DrafterConfig.num_layers must be >= 1, got {self.num_layers}")
        if self.block_size is None or int(self.block_size) < 2:
            raise ValueError(f"DrafterConfig.block_size must be >= 2 with method 'dflash' (the new token and at least "
                             f"one draft), got {self.block_size}")
        self.block_size = int(self.block_size)
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(f"DrafterConfig.hidden_size={self.hidden_size} differs from target_hidden_size="
                             f"{self.target_hidden_size}: a DFlash block embeds with the target's embedding")

    def _check_attention_kind(self) -> None:
        """The attention kind's own sizes are set, the other kind's are not (a mixed config is refused by key)."""
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"DrafterConfig.attention={self.attention!r} is not one of {ATTENTION_KINDS}")
        if self.attention == "gqa":
            mixed = [name for name in MLA_FIELDS if getattr(self, name) is not None]
            if mixed:
                raise ValueError(f"DrafterConfig.{mixed[0]}={getattr(self, mixed[0])} is an MLA size but attention is "
                                 "'gqa'; set attention: mla, or drop the MLA keys")
            return
        for name in MLA_FIELDS:
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"DrafterConfig.{name} is required with attention 'mla'"
                                 + (" (SGLang's Eagle3DeepseekV2ForCausalLM refuses a drafter without it)"
                                    if name == "q_lora_rank" else ""))
            if int(value) <= 0:
                raise ValueError(f"DrafterConfig.{name} must be positive, got {value}")
            setattr(self, name, int(value))
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"DrafterConfig.num_key_value_heads={self.num_key_value_heads} is a GQA size: with "
                             f"attention 'mla' every head has its own keys (set it to num_attention_heads="
                             f"{self.num_attention_heads})")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim != qk:
            raise ValueError(f"DrafterConfig.head_dim={self.head_dim} is a GQA size: with attention 'mla' it is the q/k "
                             f"head dim qk_nope_head_dim + qk_rope_head_dim = {qk}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DrafterConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        if (self.kv_lora_rank, self.qk_rope_head_dim) != MLA_SERVED_LATENT:
            raise ValueError(
                f"DrafterConfig.kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}: an MLA "
                f"latent of {latent} is not served by vLLM CPU's MLA kernel nor by FlashMLA/FlashInfer/CUTLASS MLA, "
                f"which take only kv_lora_rank {MLA_SERVED_LATENT[0]} + qk_rope_head_dim {MLA_SERVED_LATENT[1]}"
            )

    @property
    def fc_norm(self) -> bool:
        """An RMSNorm (eps ``rms_norm_eps``) on each aux layer's chunk before ``fc`` (EAGLE-3.1)."""
        return self.method == "eagle3.1"

    @property
    def norm_output(self) -> bool:
        """Each step passes ``norm(h)``, the tensor ``lm_head`` reads, to the next step, not ``h`` (EAGLE-3.1)."""
        return self.method == "eagle3.1"

    @property
    def parallel(self) -> bool:
        """Drafts 2..K come from placeholder slots (mask token, ``mask_hidden``) in the pass of draft 1 (P-EAGLE)."""
        return self.method == "p-eagle"

    @property
    def block(self) -> bool:
        """All K drafts from one block pass over the target's states as keys and values (DFlash)."""
        return self.method == "dflash"

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """What one token costs in a serving engine's draft KV cache: K and V per kv head for gqa, the
        compressed latent plus the shared rope key (``kv_lora_rank + qk_rope_head_dim``) for mla (what vLLM's
        and SGLang's MLA backends store)."""
        if self.attention == "mla":
            return (int(self.kv_lora_rank) + int(self.qk_rope_head_dim)) * dtype_bytes
        return 2 * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_target(
        cls, info: Mapping[str, Any] | Any, draft_vocab_size: int, attention: str = "gqa", **overrides: Any
    ) -> DrafterConfig:
        """Drafter shaped like the target (SGLang shares the target's embedding, so H must match).

        ``info`` is a TargetInfo (dataclass) or a mapping with the same keys. ``rope`` holds
        either ``rope_theta``/``rope_scaling`` (transformers 4 layout) or ``rope_parameters``
        (transformers 5 layout). ``attention`` "mla" takes the target's MLA sizes (``mla`` in ``info``:
        q_lora_rank, kv_lora_rank, qk_nope/rope_head_dim, v_head_dim) or, for a target without MLA,
        DeepSeek-V3's (:data:`DEFAULT_MLA_SIZES`). ``overrides`` replace any field, e.g. ``rope_scaling=None,
        rope_theta=1e6`` for SpecForge's Kimi-K2.5 drafter.
        """
        if dataclasses.is_dataclass(info) and not isinstance(info, type):
            info = dataclasses.asdict(info)
        info = dict(info)
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size", "num_layers", "aux_layer_ids")
                   if info.get(k) is None]
        if missing:
            raise ValueError(f"DrafterConfig.from_target: target info lacks {missing}")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"drafter attention {attention!r} is not one of {ATTENTION_KINDS}")
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
            attention=attention,
        )
        if info.get("hidden_act"):
            kw["hidden_act"] = str(info["hidden_act"])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"DrafterConfig.from_target: unknown overrides {sorted(unknown)}")
        if attention == "mla":
            target_mla = dict(info.get("mla") or {})
            sizes = {name: target_mla.get(name) or DEFAULT_MLA_SIZES[name] for name in MLA_FIELDS}
            for name in ("num_key_value_heads", "head_dim"):
                if overrides.get(name) is not None:
                    raise ValueError(f"{name} is a GQA size; an MLA drafter's keys are set by {', '.join(MLA_FIELDS)}")
            sizes.update({k: v for k, v in overrides.items() if k in MLA_FIELDS and v is not None})
            kw.update(sizes, num_key_value_heads=heads if overrides.get("num_attention_heads") is None
                      else int(overrides["num_attention_heads"]),
                      head_dim=int(sizes["qk_nope_head_dim"]) + int(sizes["qk_rope_head_dim"]))
        else:
            mla_given = [k for k in MLA_FIELDS if overrides.get(k) is not None]
            if mla_given:
                raise ValueError(f"{mla_given[0]} is an MLA size but the drafter attention is 'gqa' "
                                 "(set drafter_attention: mla)")
        kw.update({k: v for k, v in overrides.items() if v is not None or k not in MLA_FIELDS})
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
