"""Reading a target's config and single weights (embedding, lm_head) without loading the model.

The drafter shares the target's input embedding, and the last-hidden teacher needs its lm_head:
both are read tensor by tensor from the target's safetensors, so a 1T-parameter target costs
only those two tensors. Key names differ between plain causal LMs and multimodal wrappers
(Kimi-K2.5), hence :func:`weight_key_candidates`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def text_config(config: Any) -> Any:
    """The decoder's own config: multimodal wrappers (Kimi-K2.5, Llava...) nest it as text_config.

    Takes a transformers config or its config.json as a dict.
    """
    if isinstance(config, Mapping):
        sub = config.get("text_config")
        return sub if isinstance(sub, Mapping) else config
    get = getattr(config, "get_text_config", None)
    if callable(get):
        sub = get()
        if sub is not None:
            return sub
    sub = getattr(config, "text_config", None)
    return sub if sub is not None else config


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def weight_key_candidates(architecture_config: Any) -> tuple[list[str], list[str]]:
    """Candidate weight-file keys for (input embedding, lm_head), most likely first.

    Plain causal LMs use ``model.embed_tokens.weight``/``lm_head.weight``; Kimi-K2.5-style wrappers
    prefix them with ``language_model.``; transformers 5 VLMs keep the text model at
    ``model.language_model.``. With tied embeddings the head falls back to the embedding keys,
    because save_pretrained drops the tied copy. Accepts a config object or a config.json dict.
    """
    cfg = architecture_config
    sub = _config_get(cfg, "text_config")
    wrapped = sub is not None
    text = sub if wrapped else cfg
    tied = _config_get(text, "tie_word_embeddings")
    if tied is None:
        tied = _config_get(cfg, "tie_word_embeddings", False)
    embed_plain = ["model.embed_tokens.weight"]
    embed_wrapped = [
        "language_model.model.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
        "language_model.embed_tokens.weight",
    ]
    head_plain = ["lm_head.weight"]
    head_wrapped = ["language_model.lm_head.weight", "model.language_model.lm_head.weight"]
    if wrapped:
        embed, head = embed_wrapped + embed_plain, head_wrapped + head_plain
    else:
        embed, head = embed_plain + embed_wrapped, head_plain + head_wrapped
    if tied:
        head = head + embed
    return embed, head


def final_norm_key_candidates(architecture_config: Any) -> list[str]:
    """Candidate keys of the decoder's final norm (``model.norm.weight`` and its wrapped forms), most likely
    first: where the input embedding sits, the final norm sits beside it."""
    embed, _ = weight_key_candidates(architecture_config)
    return [k.replace("embed_tokens.weight", "norm.weight") for k in embed]


def read_target_tensor(target_path: str | Path, key_candidates: Sequence[str]) -> tuple[torch.Tensor, str]:
    """(tensor, key) of the first candidate key in the target's safetensors, reading only that tensor.

    Looks in ``*.safetensors.index.json`` weight maps first, then in every ``*.safetensors`` file of
    the folder (or the file itself): the embedding and lm_head of a 1T-parameter target are found
    without touching the rest.
    """
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
