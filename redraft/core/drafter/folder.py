"""The drafter folder: what a servable drafter is on disk, and the one way to find one.

A drafter folder holds ``config.json`` (the engines' ``LlamaForCausalLMEagle3`` config),
``model.safetensors`` (serving weights, no embedding) and, when redraft wrote it, ``redraft.json``
(its DrafterConfig, the dataset fingerprint, held-out ids, the train config). A training run folder
holds ``step-XXXXXXX`` drafter folders and a ``latest`` file naming the newest complete one;
:func:`resolve_drafter_folder` is how every command turns either into a drafter folder.
SGLang/SpecForge folders (no ``redraft.json``) are read too, their layer ids interpreted for the target.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from redraft.core.atomic import atomic_write_text
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.serving_format import (
    drafter_config_from_serving,
    load_serving_weights,
    serving_config,
    serving_engines,
)
from redraft.core.errors import UserError

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
REDRAFT_RECORD = "redraft.json"
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d{7,})$")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class CheckpointError(UserError):
    """A drafter or run folder that is missing, incomplete, or does not fit the data."""


def step_dirname(step: int) -> str:
    return f"step-{step:07d}"


def write_json(path: Path, obj: Any) -> None:
    """Canonical, atomically written JSON (sorted keys, two-space indent, trailing newline)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def resolve_drafter_folder(path: str | Path) -> Path:
    """The drafter folder ``path`` names: itself, its ``latest`` step, else its newest ``step-*`` (by number)."""
    folder = Path(path)
    if (folder / WEIGHTS_NAME).is_file():
        return folder
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    latest = folder / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        if (folder / name / WEIGHTS_NAME).is_file():
            return folder / name
        raise CheckpointError(f"{latest} names {name!r}, which has no {WEIGHTS_NAME}")
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir()
                   if (m := STEP_RE.match(p.name)) and (p / WEIGHTS_NAME).is_file())
    if steps:
        return steps[-1][1]
    raise CheckpointError(f"{folder}: not a drafter folder (no {WEIGHTS_NAME}), and no {LATEST} or step-* inside")


def read_record(folder: str | Path) -> dict[str, Any] | None:
    """The folder's redraft.json, or None for a foreign (SGLang/SpecForge) drafter."""
    path = Path(folder) / REDRAFT_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return record


def write_drafter_folder(folder: Path, cfg: DrafterConfig, state: Mapping[str, torch.Tensor], record: Mapping) -> None:
    """config.json + model.safetensors + redraft.json: a servable drafter (and what eval reads back)."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    dtype = _DTYPE_NAMES.get(next(iter(floats)), None) if len(floats) == 1 else None
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    engine = serving_engines(cfg)[0]  # SGLang's layout where it serves the method; P-EAGLE and DFlash: vLLM
    write_json(folder / CONFIG_NAME, serving_config(cfg, engine=engine, torch_dtype=dtype))
    write_json(folder / REDRAFT_RECORD, {**record, "drafter": cfg.to_dict()})


def load_drafter_checkpoint(
    folder: str | Path, *, target_architecture: str | None = None, target_num_layers: int | None = None
) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(config, serving state dict) of a redraft checkpoint, or of an SGLang/SpecForge drafter folder.

    redraft checkpoints carry their DrafterConfig in redraft.json. A foreign folder only has
    config.json, so its layer ids are interpreted for ``target_architecture`` (with
    ``target_num_layers`` for the default ids); both must then be given. Weights come back under
    our names (``model.``/``layers.0.`` names mapped), without any ``embed_tokens.weight``.
    """
    folder = Path(folder)
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing (not a drafter folder)")
    record = read_record(folder)
    if record is not None:
        if "drafter" not in record:
            raise CheckpointError(f"{folder / REDRAFT_RECORD}: key 'drafter' is missing")
        cfg = DrafterConfig.from_dict(record["drafter"])
    else:
        cfg_path = folder / CONFIG_NAME
        if not cfg_path.is_file():
            raise CheckpointError(f"{folder}: neither {REDRAFT_RECORD} nor {CONFIG_NAME} is present")
        if target_architecture is None or target_num_layers is None:
            raise CheckpointError(
                f"{folder}: a foreign drafter folder (no {REDRAFT_RECORD}) needs target_architecture and "
                "target_num_layers to interpret its layer ids"
            )
        try:
            cfg = drafter_config_from_serving(
                json.loads(cfg_path.read_text()),
                target_architecture=target_architecture,
                target_num_layers=target_num_layers,
            )
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{cfg_path}: {e}") from e
    try:
        state = load_serving_weights(weights, cfg.block)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    if record is None and "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        # a full-vocab drafter needs no map: both engines then use draft ids as target ids (published Kimi
        # drafters ship so); the identity map says the same in our layout
        log.info("%s: no d2t in a full-vocabulary drafter; using the identity map, as the engines do", weights)
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    return cfg, state
