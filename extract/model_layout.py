"""Finds the parts of a loaded target model that extraction hooks: decoder stack, its layers, lm_head.

Layer ``i`` of :func:`find_decoder_layers` is aux layer ``i`` of the convention in redraft.core.layers.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Attribute names under which wrappers keep their text decoder, tried in this order.
_TEXT_CHILDREN = ("language_model", "model", "text_model")


def _has_layers(module: nn.Module) -> bool:
    return isinstance(getattr(module, "layers", None), nn.ModuleList)


def find_text_model(model: nn.Module) -> nn.Module:
    """The decoder stack holding ``.layers``: LlamaModel in LlamaForCausalLM, or the text model of a wrapper.

    Handles ``model.model`` (causal LMs), ``model.language_model.model`` (Kimi-K2.5), and
    ``model.model.language_model`` (transformers 5 VLMs). Vision towers are never descended into.
    """
    seen: set[int] = set()

    def search(module: nn.Module, depth: int) -> nn.Module | None:
        if id(module) in seen or depth > 4:
            return None
        seen.add(id(module))
        if _has_layers(module) and depth > 0:
            return module
        for name in _TEXT_CHILDREN:
            child = getattr(module, name, None)
            if isinstance(child, nn.Module):
                found = search(child, depth + 1)
                if found is not None:
                    return found
        return None

    found = search(model, 0)
    if found is None and _has_layers(model):
        found = model  # already a bare decoder stack
    if found is None:
        raise ValueError(
            f"cannot find the decoder stack in {type(model).__name__}: looked for a module with a .layers "
            f"ModuleList under {'/'.join(_TEXT_CHILDREN)}"
        )
    return found


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers, index ``i`` being layer ``i`` of the redraft convention."""
    return find_text_model(model).layers


def find_lm_head(model: nn.Module) -> nn.Module:
    """The output projection: ``get_output_embeddings()``, else a wrapper's ``language_model.lm_head``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Module):
        return head
    for path in (("lm_head",), ("language_model", "lm_head"), ("model", "language_model", "lm_head")):
        mod: Any = model
        for name in path:
            mod = getattr(mod, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise ValueError(f"cannot find the lm_head of {type(model).__name__}")


# MLA's latent norms: transformers' DeepseekV3 builds them with RMSNorm's default eps (1e-6) whatever the config
# says, while vLLM (model_executor/models/deepseek_v2.py) and SGLang (srt/models/deepseek_v2.py) build them with
# config.rms_norm_eps. The two agree only at rms_norm_eps = 1e-6.
LATENT_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def align_latent_norm_eps(layers: nn.ModuleList, rms_norm_eps: float) -> int:
    """Give MLA latent norms the config's ``rms_norm_eps``, as the serving engines do; returns how many changed.

    Why: the hf backend stands in for the engine that will serve the target, so its features must be the
    engine's. On kimi-k25-mini (rms_norm_eps 1e-5) transformers' fixed 1e-6 put its layer outputs 3e-5 (median,
    relative) away from vLLM's captured ones; with the config's eps they agree to ~1e-6.
    """
    changed = 0
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        for name in LATENT_NORMS:
            norm = getattr(attn, name, None)
            if norm is None:
                continue
            for attr in ("variance_epsilon", "eps"):
                if isinstance(getattr(norm, attr, None), float) and getattr(norm, attr) != rms_norm_eps:
                    setattr(norm, attr, float(rms_norm_eps))
                    changed += 1
    return changed
