"""The drafter a run trains: its config from the target and the data, then its weights (resume, warm start or new).

Resume restores the run's own checkpoint exactly: neither the warm start nor the vocabulary is redone, so the
vocabulary is the one the run was trained with, whatever the counts say now. ``--init-from`` warm-starts a new
run from another drafter whose shapes fit; otherwise the drafter starts from scratch with a draft vocabulary
built from the data's token counts. The embedding is always the target's (frozen).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.config import TrainConfig

log = logging.getLogger(__name__)

FINGERPRINT_KEYS = ("tokenizer_hash", "chat_template_hash")
# Config fields a user may override; all but these two are tied to the data when warm-starting.
OVERRIDABLE = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "max_position_embeddings", "rope_theta", "mask_token_id")
FREE_ON_INIT = ("max_position_embeddings", "rope_theta")


@dataclass
class BuiltDrafter:
    drafter: Any  # redraft.core.drafter.modeling.DrafterBase (redraft.core.drafter.kinds.build_drafter)
    target_path: Path
    lm_head_keys: list[str]  # where the target's output head is, for the last_hidden teacher
    warm_start: dict[str, Any] | None  # what --init-from did (recorded in every checkpoint)


def target_info(manifest: dict, target_path: Path) -> dict[str, Any]:
    """DrafterConfig.from_target's input: sizes from the manifest, heads/MLP/rope from the target config."""
    from redraft.core.drafter.config import MLA_FIELDS
    from redraft.core.target_weights import text_config

    cfg_file = target_path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{cfg_file}: target config not found (manifest target.path={manifest['target'].get('path')!r}); "
            "pass --target_path to the target model folder"
        )
    raw = json.loads(cfg_file.read_text())
    raw_text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    try:
        from transformers import AutoConfig

        text = text_config(AutoConfig.from_pretrained(str(target_path), local_files_only=True)).to_dict()
    except Exception as e:  # custom architectures (trust_remote_code) or wrappers unknown here
        log.info("AutoConfig could not read %s (%s); using config.json as is", target_path, e)
        text = raw_text
    for key in ("hidden_size", "vocab_size"):
        if key in text and int(text[key]) != int(manifest[key]):
            raise ValueError(f"{cfg_file}: {key}={text[key]} but the dataset manifest says {manifest[key]}")
    return {
        "hidden_size": int(manifest["hidden_size"]),
        "num_layers": int(manifest["num_layers"]),
        "vocab_size": int(manifest["vocab_size"]),
        "aux_layer_ids": list(manifest["aux_layer_ids"]),
        "architecture": manifest["target"].get("architecture") or (raw.get("architectures") or [None])[0],
        "num_attention_heads": text.get("num_attention_heads"),
        "num_key_value_heads": text.get("num_key_value_heads"),
        "head_dim": raw_text.get("head_dim"),  # DeepseekV3Config.head_dim is the rope dim: trust only the file
        "intermediate_size": text.get("intermediate_size"),
        "rms_norm_eps": text.get("rms_norm_eps"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "hidden_act": text.get("hidden_act"),
        "rope": {k: text[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if text.get(k) is not None},
        # an MLA target's latent sizes: what an MLA drafter copies (DeepSeek-V3, Kimi-K2.5)
        "mla": {k: text[k] for k in MLA_FIELDS if text.get(k) is not None} if text.get("kv_lora_rank") else None,
    }


def check_init_fingerprint(init_from: Path, manifest: dict, data: str) -> None:
    """Refuse --init-from a redraft drafter trained on data of another tokenizer or chat template.

    Shapes can agree while token ids mean different things (same vocab size, other tokenizer):
    the drafter's d2t mapping and everything it learnt would then be silently wrong. Foreign
    folders (no redraft.json) carry no fingerprint; only their shapes are checked.
    """
    from redraft.core.drafter.folder import REDRAFT_RECORD, CheckpointError

    path = init_from / REDRAFT_RECORD
    if not path.is_file():
        return
    try:
        recorded = (json.loads(path.read_text()).get("dataset") or {})
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    problems = [
        f"{key}: {init_from} was trained on {recorded[key]!r}, {data} has {manifest.get(key)!r}"
        for key in FINGERPRINT_KEYS
        if recorded.get(key) and manifest.get(key) and recorded[key] != manifest[key]
    ]
    if problems:
        raise CheckpointError(f"--init-from {init_from} does not fit the data: " + "; ".join(problems))


def drafter_config(cfg: TrainConfig, manifest: dict, target_path: Path) -> tuple[Any, Any]:
    """(the config this run trains, the --init-from state dict or None): from the target and the data, or from
    the warm-start drafter where its shapes agree with them."""
    from redraft.core.drafter.config import MLA_FIELDS, DrafterConfig
    from redraft.core.drafter.folder import load_drafter_checkpoint
    from train.checkpoint import check_init_compatible

    overrides = {k: getattr(cfg, k) for k in (*OVERRIDABLE, *MLA_FIELDS) if getattr(cfg, k) is not None}
    info = target_info(manifest, target_path)
    defaults = {}  # a warm start keeps the init drafter's mask token unless one is given
    if cfg.drafter_method in ("p-eagle", "dflash") and cfg.mask_token_id is None:
        defaults["mask_token_id"] = int(info["vocab_size"]) - 1
    if cfg.drafter_method == "dflash":  # the block the run trains: the new token and ttt_steps drafts
        defaults.update(num_layers=cfg.dflash_layers or 1, block_size=cfg.ttt_steps + 1)
    wanted = DrafterConfig.from_target(
        info, cfg.draft_vocab_size, attention=cfg.drafter_attention,
        method=cfg.drafter_method, torch_dtype="bfloat16" if cfg.dtype == "bf16" else "float32",
        **overrides, **defaults)
    if not cfg.init_from:
        return wanted, None
    init_cfg, init_state = load_drafter_checkpoint(
        cfg.init_from, target_architecture=wanted.target_architecture, target_num_layers=wanted.target_num_layers)
    # Shapes tied to the data must agree; architecture fields come from the init drafter unless overridden.
    # A rebuilt draft vocabulary takes this run's draft_vocab_size, as a scratch run does.
    rebuild = cfg.warm_start_vocab == "rebuild"
    fields = ("attention", "method", "hidden_size", "target_hidden_size", "vocab_size",
              *(() if rebuild else ("draft_vocab_size",)),
              "aux_layer_ids", *[k for k in overrides if k not in FREE_ON_INIT])
    check_init_compatible(init_cfg, wanted, cfg.init_from, fields)
    check_init_fingerprint(Path(cfg.init_from), manifest, cfg.data)
    merged = DrafterConfig.from_dict({
        **init_cfg.to_dict(), "target_architecture": wanted.target_architecture,
        "target_num_layers": wanted.target_num_layers, "torch_dtype": wanted.torch_dtype,
        **{k: v for k, v in overrides.items() if k in FREE_ON_INIT},
        **({"draft_vocab_size": wanted.draft_vocab_size} if rebuild else {}),
    })
    return merged, init_state


def build_drafter(cfg: TrainConfig, reader: Any, resume_from: Path | None) -> BuiltDrafter:
    """The drafter with its weights: the checkpoint's when resuming, else warm-started or new (module doc)."""
    from redraft.core.drafter.folder import WEIGHTS_NAME, read_record
    from redraft.core.drafter.kinds import build_drafter as new_drafter
    from redraft.core.drafter.serving_format import load_serving_weights
    from redraft.core.drafter.vocab import build_vocab_mapping
    from redraft.core.target_weights import weight_key_candidates
    from train.warm_start import warm_start

    manifest = reader.manifest
    target_path = Path(cfg.target_path or manifest["target"]["path"])
    config, init_state = drafter_config(cfg, manifest, target_path)
    drafter = new_drafter(config, attention_impl=cfg.attention_impl)
    embed_keys, head_keys = weight_key_candidates(json.loads((target_path / "config.json").read_text()))
    drafter.load_target_embedding(target_path, embed_keys)
    drafter.embed_tokens.weight.requires_grad_(False)
    warm_info = None
    if resume_from is not None:
        drafter.load_serving_state_dict(load_serving_weights(resume_from / WEIGHTS_NAME, config.block))
        warm_info = (read_record(resume_from) or {}).get("warm_start")
        if cfg.init_from:
            log.info("resuming %s: --init-from %s is not applied again (the checkpoint holds the warm-started "
                     "drafter)", resume_from, cfg.init_from)
    elif init_state is not None:
        warm_info = warm_start(drafter, init_state, reader.token_counts(), cfg.warm_start_vocab, cfg.init_from)
    else:
        drafter.set_vocab_mapping(*build_vocab_mapping(reader.token_counts(), config.draft_vocab_size))
    return BuiltDrafter(drafter, target_path, list(head_keys), warm_info)


def read_lm_head(built: BuiltDrafter, device: torch.device) -> torch.Tensor:
    """The target's output head, for the last_hidden teacher (the trainer applies it)."""
    from redraft.core.target_weights import read_target_tensor

    return read_target_tensor(built.target_path, built.lm_head_keys)[0].to(device)
