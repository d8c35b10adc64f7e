"""The serving checkpoint format, in one place: tensor table, config.json writer, foreign-config reader.

SGLang's ``LlamaForCausalLMEagle3`` silently skips weight names it does not know (the parameter
stays ``torch.empty`` garbage) and silently uses draft ids as target ids when ``d2t`` is missing;
vLLM's ``Eagle3LlamaForCausalLM`` raises on unknown names and on ``model.``-prefixed keys. So the
key set is not left to whatever a state dict happens to hold: :func:`expected_tensors` is the one
table both formats are checked against (:func:`check_serving_state`), on export and on import.

The two formats share the tensors (un-prefixed ``midlayer.*``, ``fc``, ``norm``, ``lm_head``,
``d2t``, ``t2d``; both engines drop ``t2d``). They differ in ``config.json``: the aux layer ids
are written in the chosen engine's convention for the target's architecture
(``redraft.core.layers.to_engine_layer_ids``), e.g. a Llama target's ``[1, 14, 26]`` for SGLang is
``[2, 15, 27]`` for vLLM, and Kimi-K2.5's ``[1, 29, 57]`` for SGLang (read alike by 0.5.10 and 0.5.23) is
``[2, 30, 58]`` for vLLM.

Each attention kind has its architecture (:data:`SERVING_ARCHS`): ``LlamaForCausalLMEagle3``
(``model_type`` llama) and the MLA drafter ``Eagle3DeepseekV2ForCausalLM`` (``model_type`` deepseek_v2: vLLM
rewrites a ``deepseek_v3`` draft config into its MTP model and refuses it for EAGLE-3). Both are read back
(the SGLang/SpecForge layout with a nested ``eagle_config``, and published eagle3-mla folders);
speculators-format (``Eagle3Speculator``) configs are refused by name.

DFlash (``method`` "dflash") has vLLM's layout alone (``DFlashDraftModel``, ``model_type`` qwen3, a
``dflash_config`` with the mask token and the target's layer ids, its ``layers.{i}`` names: :func:`_dflash_tensors`,
:func:`_dflash_config`); SGLang 0.5.23 serves DFlash only on CUDA, NPU and XPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from redraft.core.drafter.config import MLA_FIELDS, DrafterConfig
from redraft.core.drafter.names import EMBED_KEY, canonical_key
from redraft.core.drafter.vocab import check_vocab_mapping
from redraft.core.errors import UserError
from redraft.core.layers import (
    ENGINES,
    default_aux_layer_ids,
    from_engine_layer_ids,
    to_dflash_layer_ids,
    to_engine_layer_ids,
)

log = logging.getLogger(__name__)

SERVING_ARCHS = {"gqa": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}
SERVING_ARCH = SERVING_ARCHS["gqa"]
DFLASH_ARCH = "DFlashDraftModel"  # vLLM's registry: qwen3_dflash.DFlashQwen3ForCausalLM
# config.json model_type per kind: what both engines' config parsers build the draft config from
SERVING_MODEL_TYPES = {"gqa": "llama", "mla": "deepseek_v2"}
# model_types an engine rewrites into something else: vLLM's SpeculativeConfig.hf_config_override turns these draft
# configs into its MTP models (deepseek_v3 -> deepseek_mtp / DeepSeekMTPModel) and refuses them for EAGLE-3
REWRITTEN_MODEL_TYPES = {
    name: "vLLM rewrites it into its MTP model (deepseek_v3 -> deepseek_mtp, DeepSeekMTPModel) and refuses EAGLE-3"
    for name in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v4", "deepseek_v41")
}
FORMATS = ENGINES  # ("sglang", "vllm"): one serving format per engine

# config.json switches of EAGLE-3 variants that this drafter does not implement; written as false on export,
# refused when true on import (norm_before_residual: vLLM only; SGLang never reads it).
UNSUPPORTED_SWITCHES = ("norm_before_fc", "norm_before_residual")
# EAGLE-3.1's two switches, read at config.json's top level by both engines (SGLang also reads use_aux_norm
# for fc_norm); DrafterConfig.method sets both or neither.
METHOD_SWITCHES = ("fc_norm", "norm_output")
# P-EAGLE's placeholder token: the top-level keys vLLM 0.32 takes it from for an EAGLE-3 drafter, in its search
# order (v1/spec_decode/llm_base_proposer.py _init_parallel_drafting_params; dflash_config is DFlash's). Export
# writes the first.
MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
MASK_HIDDEN_KEY = "mask_hidden"  # vLLM loads any tensor whose name contains it, pre-fc width

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ServingFormatError(UserError):
    """A serving checkpoint (config.json or weights) that the engines would misload or reject."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and kind of one serving tensor; kind is "float" (any float dtype), "int64" or "bool"."""

    shape: tuple[int, ...]
    kind: str

    def describe(self) -> str:
        return f"{self.kind} {list(self.shape)}"


# why an engine does not serve a method (what its source says)
NOT_SERVED = {
    ("sglang", "p-eagle"): "SGLang 0.5.23 has no parallel drafting (vLLM serves it with speculative_config "
                           "parallel_drafting)",
    ("sglang", "dflash"): "SGLang 0.5.23 allows its DFLASH algorithm on CUDA, NPU and XPU only "
                          "(arg_groups/speculative_hook.py); vLLM serves DFlashDraftModel",
}


def _check_format(fmt: str, cfg: DrafterConfig | None = None) -> None:
    if fmt not in FORMATS:
        raise ServingFormatError(f"unknown serving format {fmt!r}; expected one of {FORMATS}")
    if cfg is not None and fmt not in serving_engines(cfg):
        raise ServingFormatError(f"a {cfg.method} drafter has no {fmt} format: {NOT_SERVED[(fmt, cfg.method)]}; "
                                 "use --format vllm")


def serving_engines(cfg: DrafterConfig) -> tuple[str, ...]:
    """The engines that serve ``cfg``'s method: both, but vLLM alone for P-EAGLE and DFlash (:data:`NOT_SERVED`)."""
    return tuple(engine for engine in FORMATS if (engine, cfg.method) not in NOT_SERVED)


def expected_tensors(cfg: DrafterConfig, fmt: str = "sglang", with_embedding: bool = False) -> dict[str, TensorSpec]:
    """THE table: every key a ``fmt`` checkpoint of ``cfg`` holds, with its shape, nothing else.

    Shapes follow SGLang's loader: q/k/v read the 2H-wide [embedding, hidden] concatenation and
    fc reads the n_aux * H_target concatenation of aux layers. Keys carry no ``model.`` prefix
    (vLLM rejects it). ``embed_tokens.weight`` only for a standalone folder (``with_embedding``).
    """
    _check_format(fmt, cfg)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    f = "float"
    if cfg.block:
        table = _dflash_tensors(cfg)
        if with_embedding:
            table[EMBED_KEY] = TensorSpec((cfg.vocab_size, h), f)
        return table
    table = {
        **_attention_tensors(cfg),
        "midlayer.mlp.gate_proj.weight": TensorSpec((inter, h), f),
        "midlayer.mlp.up_proj.weight": TensorSpec((inter, h), f),
        "midlayer.mlp.down_proj.weight": TensorSpec((h, inter), f),
        "midlayer.hidden_norm.weight": TensorSpec((h,), f),
        "midlayer.input_layernorm.weight": TensorSpec((h,), f),
        "midlayer.post_attention_layernorm.weight": TensorSpec((h,), f),
        "fc.weight": TensorSpec((h, cfg.num_aux_layers * cfg.target_hidden_size), f),
        **{f"fc_norm.{i}.weight": TensorSpec((cfg.target_hidden_size,), f)
           for i in range(cfg.num_aux_layers if cfg.fc_norm else 0)},
        **({MASK_HIDDEN_KEY: TensorSpec((cfg.num_aux_layers * cfg.target_hidden_size,), f)} if cfg.parallel else {}),
        "norm.weight": TensorSpec((h,), f),
        "lm_head.weight": TensorSpec((cfg.draft_vocab_size, h), f),
        "d2t": TensorSpec((cfg.draft_vocab_size,), "int64"),  # target id = draft id + d2t[draft id]
        "t2d": TensorSpec((cfg.vocab_size,), "bool"),
    }
    if with_embedding:
        table[EMBED_KEY] = TensorSpec((cfg.vocab_size, h), f)
    return table


def _dflash_tensors(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """DFlash's table (vLLM's names without its ``model.`` prefix): fc, hidden_norm, norm, the head and
    ``num_layers`` Qwen3 layers whose projections read the H-wide layer input."""
    h, inter, hd, f = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, "float"
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    table = {"fc.weight": TensorSpec((h, cfg.num_aux_layers * cfg.target_hidden_size), f),
             "hidden_norm.weight": TensorSpec((h,), f)}
    for i in range(cfg.num_layers):
        layer = f"layers.{i}."
        table.update({
            layer + "self_attn.q_proj.weight": TensorSpec((q_out, h), f),
            layer + "self_attn.k_proj.weight": TensorSpec((kv_out, h), f),
            layer + "self_attn.v_proj.weight": TensorSpec((kv_out, h), f),
            layer + "self_attn.o_proj.weight": TensorSpec((h, q_out), f),
            layer + "self_attn.q_norm.weight": TensorSpec((hd,), f),
            layer + "self_attn.k_norm.weight": TensorSpec((hd,), f),
            layer + "mlp.gate_proj.weight": TensorSpec((inter, h), f),
            layer + "mlp.up_proj.weight": TensorSpec((inter, h), f),
            layer + "mlp.down_proj.weight": TensorSpec((h, inter), f),
            layer + "input_layernorm.weight": TensorSpec((h,), f),
            layer + "post_attention_layernorm.weight": TensorSpec((h,), f),
        })
    table.update({"norm.weight": TensorSpec((h,), f),
                  "lm_head.weight": TensorSpec((cfg.draft_vocab_size, h), f),
                  "d2t": TensorSpec((cfg.draft_vocab_size,), "int64"),
                  "t2d": TensorSpec((cfg.vocab_size,), "bool")})
    return table


def _attention_tensors(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """The attention's weights of ``cfg``'s kind; the projections that read the layer input read 2H."""
    h, nh, f = cfg.hidden_size, cfg.num_attention_heads, "float"
    attn = "midlayer.self_attn."
    if cfg.attention == "mla":
        q_lora, kv_lora = int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
        qk, rope, nope, v = cfg.head_dim, int(cfg.qk_rope_head_dim), int(cfg.qk_nope_head_dim), int(cfg.v_head_dim)
        return {
            attn + "q_a_proj.weight": TensorSpec((q_lora, 2 * h), f),
            attn + "q_a_layernorm.weight": TensorSpec((q_lora,), f),
            attn + "q_b_proj.weight": TensorSpec((nh * qk, q_lora), f),
            attn + "kv_a_proj_with_mqa.weight": TensorSpec((kv_lora + rope, 2 * h), f),
            attn + "kv_a_layernorm.weight": TensorSpec((kv_lora,), f),
            attn + "kv_b_proj.weight": TensorSpec((nh * (nope + v), kv_lora), f),
            attn + "o_proj.weight": TensorSpec((h, nh * v), f),
        }
    hd = cfg.head_dim
    q_out, kv_out = nh * hd, cfg.num_key_value_heads * hd
    return {
        attn + "q_proj.weight": TensorSpec((q_out, 2 * h), f),
        attn + "k_proj.weight": TensorSpec((kv_out, 2 * h), f),
        attn + "v_proj.weight": TensorSpec((kv_out, 2 * h), f),
        attn + "o_proj.weight": TensorSpec((h, q_out), f),
    }


def _kind_ok(tensor: torch.Tensor, kind: str) -> bool:
    if kind == "float":
        return tensor.is_floating_point()
    return tensor.dtype == {"int64": torch.int64, "bool": torch.bool}[kind]


def check_serving_state(
    state: Mapping[str, torch.Tensor],
    cfg: DrafterConfig,
    fmt: str = "sglang",
    with_embedding: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Refuse anything but exactly the table's keys with its shapes and dtypes, all finite.

    ``dtype`` (optional) is the float dtype every float tensor must have. All problems are
    reported at once, one line per key, with expected and found shape/dtype.
    """
    spec = expected_tensors(cfg, fmt, with_embedding)
    problems: list[str] = []
    for key in sorted(set(spec) - set(state)):
        hint = ""
        if key == "d2t":
            hint = " (without it SGLang/vLLM use draft ids as target ids and acceptance collapses silently)"
        elif key == EMBED_KEY:
            hint = " (--with-embedding needs the target's embedding)"
        problems.append(f"missing key {key!r}: expected {spec[key].describe()}{hint}")
    for key in sorted(set(state) - set(spec)):
        canon = canonical_key(key)
        if canon != key and canon in spec:
            hint = f"; write it as {canon!r} (vLLM rejects 'model.'/'layers.0.' names)"
        elif key == EMBED_KEY:
            hint = "; the embedding is written only with --with-embedding (serving takes the target's)"
        else:
            hint = f"; not in the {fmt} table: SGLang would skip it silently and vLLM would refuse to load"
        problems.append(f"unexpected key {key!r} {tuple(state[key].shape)}{hint}")
    for key in sorted(set(spec) & set(state)):
        want, t = spec[key], state[key]
        if tuple(t.shape) != want.shape:
            problems.append(f"key {key!r}: expected shape {list(want.shape)}, found {list(t.shape)}")
            continue
        if not _kind_ok(t, want.kind):
            problems.append(f"key {key!r}: expected {want.kind}, found {t.dtype}")
            continue
        if want.kind == "float":
            if dtype is not None and t.dtype != dtype:
                problems.append(f"key {key!r}: expected {dtype}, found {t.dtype}")
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                problems.append(f"key {key!r}: {bad} of {t.numel()} values are NaN or Inf")
    if not problems and "d2t" in state:
        try:
            check_vocab_mapping(state["d2t"], state["t2d"], cfg.vocab_size)
        except ValueError as e:
            problems.append(f"keys 'd2t'/'t2d': {e}")
    if problems:
        raise ServingFormatError(f"{fmt} serving weights do not match the table:\n  " + "\n  ".join(problems))


def canonical_state(
    state: Mapping[str, torch.Tensor], block: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(weights under our names without the embedding, the embedding or None) of a drafter folder.

    Foreign folders may use SGLang's internal ``model.`` names or ship ``embed_tokens.weight``
    (SpecForge's standalone export); serving always takes the target's embedding, so it is split off.
    """
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    embedding = None
    for key, tensor in state.items():
        name = canonical_key(key, block)
        if name in origin:
            raise ServingFormatError(f"keys {origin[name]!r} and {key!r} both name {name!r}")
        origin[name] = key
        if name == EMBED_KEY:
            embedding = tensor
        else:
            out[name] = tensor
    return out, embedding


def load_serving_weights(path: str | Path, block: bool = False) -> dict[str, torch.Tensor]:
    """Weights of a drafter folder's model.safetensors under our names, embedding dropped (``block``: a DFlash
    drafter's, :func:`canonical_key`)."""
    from safetensors.torch import load_file

    try:
        state, embedding = canonical_state(load_file(str(path)), block)
    except ServingFormatError as e:
        raise ServingFormatError(f"{path}: {e}") from e
    if embedding is not None:
        log.info("%s: ignoring %s (serving and training use the target's embedding)", path, EMBED_KEY)
    return state


# ----------------------------------------------------------------------------- config.json


def _rope_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """rope in both spellings: legacy ``rope_theta`` + ``rope_scaling`` and transformers-5 ``rope_parameters``."""
    if cfg.rope_scaling is None:
        return {
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        }
    legacy = {k: v for k, v in cfg.rope_scaling.items() if k != "rope_theta"}
    params = {k: v for k, v in legacy.items() if k != "type"}
    params = {"rope_type": legacy.get("rope_type", legacy.get("type")), **params, "rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": legacy, "rope_parameters": params}


def serving_config(
    cfg: DrafterConfig,
    *,
    engine: str = "sglang",
    torch_dtype: str | None = None,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json for ``engine``'s EAGLE-3 loader (and the training checkpoints' own config.json).

    Every field SGLang's ``LlamaForCausalLMEagle3`` and vLLM's loader read is written explicitly,
    the switches of EAGLE-3 variants this drafter is not (``norm_before_fc``, ``norm_before_residual``) as
    false. EAGLE-3.1 writes ``fc_norm`` and ``norm_output`` true; EAGLE-3 writes ``fc_norm`` false and leaves
    ``norm_output`` out, because SpecForge reads it with another meaning and every reader's default is then
    EAGLE-3's rule. ``max_position_embeddings`` should be the target's context length: SGLang refuses a drafter
    shorter than its target.
    """
    _check_format(engine, cfg)
    if cfg.block:
        return _dflash_config(cfg, torch_dtype, max_position_embeddings)
    engine_ids = to_engine_layer_ids(cfg.aux_layer_ids, engine, cfg.target_architecture, cfg.target_num_layers)
    config: dict[str, Any] = {
        "architectures": [SERVING_ARCHS[cfg.attention]],
        "model_type": SERVING_MODEL_TYPES[cfg.attention],
        "num_hidden_layers": 1,
        **_shape_fields(cfg, max_position_embeddings),
        **_mla_fields(cfg),
        "num_aux_hidden_states": cfg.num_aux_layers,
        "bias": False,
        "mlp_bias": False,
        **{name: False for name in UNSUPPORTED_SWITCHES},
        # EAGLE-3: norm_output is left out on purpose: SGLang/vLLM read it as "feed back the post-norm hidden"
        # (default false), SpecForge as "apply the final norm before lm_head" (default true); absent, every
        # reader's default is EAGLE-3's rule. EAGLE-3.1: both true, the engines' meaning.
        **({"fc_norm": True, "norm_output": True} if cfg.method == "eagle3.1" else {"fc_norm": False}),
        # P-EAGLE: the placeholder token vLLM's parallel slots embed (top level; the switch itself is the launch's
        # speculative_config parallel_drafting, see redraft.engines.launch.vllm_speculative_config)
        **({MASK_TOKEN_KEYS[0]: cfg.mask_token_id} if cfg.parallel else {}),
        "torch_dtype": torch_dtype or cfg.torch_dtype,
        # nested: SGLang's target-side capture reads only eagle_config's ids
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": engine_ids, "use_aux_hidden_state": True},
    }
    return config


def _shape_fields(cfg: DrafterConfig, max_position_embeddings: int | None) -> dict[str, Any]:
    """The Llama/Qwen3 fields every kind's config.json writes the same way: sizes, vocabularies, context, rope, no
    tied head and no attention bias."""
    return {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": int(max_position_embeddings or cfg.max_position_embeddings),
        **_rope_fields(cfg),
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def _dflash_config(cfg: DrafterConfig, torch_dtype: str | None, max_position_embeddings: int | None) -> dict[str, Any]:
    """config.json of vLLM's ``DFlashDraftModel``: a Qwen3 config with ``dflash_config`` (the mask token and the
    target's layer ids in DFlash's reading, :func:`redraft.core.layers.to_dflash_layer_ids`). No ``layer_types``,
    ``causal`` or ``use_swa``: every layer full and non-causal, as the drafter trains. ``block_size`` is what it
    was trained with; the launch's ``num_speculative_tokens`` is what vLLM drafts."""
    return {
        "architectures": [DFLASH_ARCH],
        "model_type": "qwen3",
        "num_hidden_layers": cfg.num_layers,
        **_shape_fields(cfg, max_position_embeddings),
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": to_dflash_layer_ids(cfg.aux_layer_ids, cfg.target_architecture)},
        "torch_dtype": torch_dtype or cfg.torch_dtype,
    }


def engine_layer_ids(config: Mapping[str, Any]) -> list[int]:
    """The layer ids a serving config.json tells its engine to capture, in the engine's reading: ``eagle_config``'s
    for the EAGLE kinds, DFlash's ``target_layer_ids`` plus one (vLLM adds it)."""
    if "dflash_config" in config:
        return [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    return list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def _mla_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """The MLA sizes both engines' MLA layers read (none for gqa). ``rope_interleave`` is written because SGLang
    rotates in NeoX halves when it is false; DeepSeek's interleaved pairs are what the drafter trains with. No
    MoE keys: the drafter's MLP is dense, and vLLM's config validation refuses ``n_routed_experts: null``."""
    if cfg.attention != "mla":
        return {}
    return {**{name: getattr(cfg, name) for name in MLA_FIELDS}, "rope_interleave": True}


def _rope_from_config(config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either spelling; refuses the two spellings disagreeing."""
    theta = config.get("rope_theta")
    scaling = config.get("rope_scaling")
    params = config.get("rope_parameters")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ServingFormatError(f"rope_scaling must be an object or null, got {scaling!r}")
    if params is not None and not isinstance(params, Mapping):
        raise ServingFormatError(f"rope_parameters must be an object or null, got {params!r}")
    if isinstance(params, Mapping):
        p_theta = params.get("rope_theta")
        if theta is not None and p_theta is not None and not math.isclose(float(theta), float(p_theta)):
            raise ServingFormatError(f"rope_theta={theta} disagrees with rope_parameters.rope_theta={p_theta}")
        theta = theta if theta is not None else p_theta
        p_type = params.get("rope_type", params.get("type", "default"))
        if scaling is None and p_type != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        elif scaling is not None:
            s_type = scaling.get("rope_type", scaling.get("type", "default"))
            if s_type != p_type:
                raise ServingFormatError(
                    f"rope_scaling type {s_type!r} disagrees with rope_parameters.rope_type {p_type!r}"
                )
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return float(theta if theta is not None else 10000.0), scaling


def drafter_config_from_serving(
    config: Mapping[str, Any], *, target_architecture: str, target_num_layers: int, engine: str = "sglang"
) -> DrafterConfig:
    """DrafterConfig of a foreign drafter's config.json (SGLang/SpecForge layout only).

    A serving config lacks the target's facts, so the caller names the target architecture (which
    decides how the ids are read, see ``redraft.core.layers``) and its layer count (for SGLang's
    default ids when the config has none). ``engine`` is the convention the ids were written in.
    """
    _check_format(engine)
    attention = _attention_kind_of(config)
    layers = int(config.get("num_hidden_layers", 1))
    if layers != 1:
        raise ServingFormatError(f"num_hidden_layers={layers}: only one-layer drafters are supported")
    eagle = config.get("eagle_config") or {}
    if not isinstance(eagle, Mapping):
        raise ServingFormatError(f"eagle_config must be an object, got {eagle!r}")
    for name in UNSUPPORTED_SWITCHES:
        if eagle.get(name) or config.get(name):
            raise ServingFormatError(f"{name}=true: this EAGLE-3 variant is not implemented by redraft's drafter")
    method = served_method(config)
    engine_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if engine_ids is None:
        if config.get("eagle_aux_hidden_state_layer_ids") is not None:
            log.warning("config.json: top-level eagle_aux_hidden_state_layer_ids is ignored by SGLang's capture; "
                        "using the engine default ids as SGLang would")
        ids = default_aux_layer_ids(target_num_layers)  # what SGLang captures when nothing is configured
    else:
        ids = from_engine_layer_ids(engine_ids, engine, target_architecture)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if config.get(key) is None:
            raise ServingFormatError(f"key {key!r} is missing")
    heads = int(config["num_attention_heads"])
    theta, scaling = _rope_from_config(config)
    shape: dict[str, Any]
    if attention == "mla":
        missing = [k for k in MLA_FIELDS if config.get(k) is None]
        if missing:
            raise ServingFormatError(f"key {missing[0]!r} is missing: an {SERVING_ARCHS['mla']} config needs "
                                     f"{', '.join(MLA_FIELDS)}")
        if config.get("rope_interleave") is False:
            raise ServingFormatError("rope_interleave=false: SGLang would rotate this MLA drafter in NeoX halves, "
                                     "vLLM in interleaved pairs; redraft's MLA drafter is DeepSeek's interleaved rope")
        mla = {k: int(config[k]) for k in MLA_FIELDS}
        shape = dict(num_key_value_heads=heads, head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], **mla)
    else:
        shape = dict(num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                     head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads))
    try:
        return DrafterConfig(
            hidden_size=int(config["hidden_size"]),
            num_attention_heads=heads,
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
            target_hidden_size=int(config.get("target_hidden_size") or config["hidden_size"]),
            aux_layer_ids=ids,
            target_num_layers=int(target_num_layers),
            target_architecture=target_architecture,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            hidden_act=str(config.get("hidden_act", "silu")),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            attention=attention,
            method=method,
            mask_token_id=_mask_token_of(config) if method == "p-eagle" else None,
            **shape,
        )
    except ValueError as e:
        raise ServingFormatError(str(e)) from e


def served_method(config: Mapping[str, Any]) -> str:
    """"eagle3", "eagle3.1" or "p-eagle" from a drafter config.json's top-level keys, as SGLang and vLLM read them.

    Only the combinations a method is are accepted: the engines read each switch on its own, so a folder
    with one of them would be served with a rule it was not trained with (fc_norm in ``eagle_config`` is read
    by neither engine, and is refused rather than dropped). A top-level mask token (:data:`MASK_TOKEN_KEYS`)
    makes it a P-EAGLE drafter, EAGLE-3's rules otherwise; ``DFlashDraftModel`` is "dflash"."""
    if DFLASH_ARCH in (config.get("architectures") or []):
        return "dflash"
    eagle = config.get("eagle_config") or {}
    nested = [name for name in (*METHOD_SWITCHES, "use_aux_norm", *MASK_TOKEN_KEYS) if name in eagle]
    if nested:
        raise ServingFormatError(f"eagle_config.{nested[0]}: SGLang and vLLM read it only at config.json's top "
                                 "level; inside eagle_config it would be dropped and the drafter served without it")
    fc_norm = bool(config.get("fc_norm") or config.get("use_aux_norm"))
    norm_output = bool(config.get("norm_output"))
    if any(key in config for key in MASK_TOKEN_KEYS):
        if fc_norm or norm_output:
            on = "fc_norm" if fc_norm else "norm_output"
            raise ServingFormatError(f"{on}=true with a mask token ({_mask_key_of(config)}): redraft's p-eagle "
                                     "drafter is EAGLE-3 drafting in parallel, without EAGLE-3.1's norms")
        _mask_token_of(config)
        return "p-eagle"
    if fc_norm and norm_output:
        return "eagle3.1"
    if not fc_norm and not norm_output:
        return "eagle3"
    on, off = ("fc_norm", "norm_output") if fc_norm else ("norm_output", "fc_norm")
    raise ServingFormatError(f"{on}=true with {off} false: neither EAGLE-3 nor EAGLE-3.1; the engines would serve "
                             f"the drafter with {on}'s rule alone" + (
                                 " (SpecForge writes norm_output with another meaning: 'final norm before "
                                 "lm_head'; for SGLang and vLLM it means 'feed the post-norm state back')"
                                 if on == "norm_output" else ""))


def _mask_key_of(config: Mapping[str, Any]) -> str:
    """The key vLLM takes the mask token from: the first of :data:`MASK_TOKEN_KEYS` present (mask_token_id only
    when not null, as vLLM skips a null one)."""
    for key in MASK_TOKEN_KEYS:
        if key in config and (key != "mask_token_id" or config[key] is not None):
            return key
    return MASK_TOKEN_KEYS[0]


def _mask_token_of(config: Mapping[str, Any]) -> int:
    """P-EAGLE's placeholder token id, from the key vLLM reads; a null or non-integer one is refused by key."""
    key = _mask_key_of(config)
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ServingFormatError(f"{key}={value!r}: P-EAGLE's mask token must be a token id (vLLM embeds it in every "
                                 "parallel slot)")
    return value


def _attention_kind_of(config: Mapping[str, Any]) -> str:
    """"gqa" or "mla" from a drafter config.json's architectures; refuses what the engines would misread."""
    archs = list(config.get("architectures") or [])
    if DFLASH_ARCH in archs:
        raise ServingFormatError(f"architectures {archs}: a DFlash drafter; redraft reads back its own DFlash "
                                 "checkpoints (their redraft.json), not a foreign DFlash folder")
    if "speculators_model_type" in config or "Eagle3Speculator" in archs:
        raise ServingFormatError(
            f"architectures {archs}: a speculators-format config; only the SGLang/SpecForge layout "
            f"({' or '.join(SERVING_ARCHS.values())} with a nested eagle_config) can be imported"
        )
    kinds = [kind for kind, arch in SERVING_ARCHS.items() if arch in archs]
    if len(kinds) != 1:
        raise ServingFormatError(
            f"architectures {archs}: expected exactly one of {list(SERVING_ARCHS.values())} (redraft reads the "
            "SGLang/SpecForge Llama-layer EAGLE-3 layout and the eagle3-mla layout)"
        )
    kind = kinds[0]
    model_type = config.get("model_type")
    if model_type in REWRITTEN_MODEL_TYPES:
        raise ServingFormatError(f"model_type={model_type!r}: {REWRITTEN_MODEL_TYPES[model_type]}; an {SERVING_ARCHS[kind]} "
                                 f"drafter must say model_type {SERVING_MODEL_TYPES[kind]!r}")
    mla_keys = [k for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim") if config.get(k) is not None]
    if kind == "gqa" and mla_keys:
        raise ServingFormatError(f"key {mla_keys[0]!r}: an MLA size in a {SERVING_ARCHS['gqa']} config (the engines "
                                 "would build a Llama-style attention and ignore it); the MLA drafter is "
                                 f"{SERVING_ARCHS['mla']}")
    return kind


def torch_dtype_of(name: str) -> torch.dtype:
    """torch dtype of a config.json dtype name ("bfloat16", "float32", "float16")."""
    if name not in _TORCH_DTYPES:
        raise ServingFormatError(f"dtype {name!r} is not one of {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]
