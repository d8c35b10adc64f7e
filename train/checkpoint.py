"""Checkpoint folders: serving files + redraft's record + the full training state, written atomically.

Layout of ``OUT/step-0000100/``::

    config.json          SGLang/vLLM ``LlamaForCausalLMEagle3`` config (servable as is)
    model.safetensors    serving weights (no embedding)
    redraft.json         DrafterConfig, dataset fingerprint, val ids, train config
    trainer_state.json   step, epoch, sampler position, world size
    training_state/      accelerator.save_state (model, optimizer, scheduler, per-rank RNG; DeepSpeed-aware)

Everything is written into ``OUT/.tmp-step-0000100`` and renamed once complete, then ``OUT/latest``
is replaced atomically, so a run killed at any moment leaves either the old or the new checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from extract.atomic import atomic_write_text
from train.drafter import DrafterConfig
from train.serving_format import (  # noqa: F401  (re-exported: the serving pieces live there now)
    SERVING_ARCH,
    drafter_config_from_serving,
    load_serving_weights,
    serving_config,
)

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step-(\d{7,})$")
TMP_PREFIX = ".tmp-"
LATEST = "latest"
TRAINING_STATE = "training_state"
REDRAFT_RECORD = "redraft.json"
TRAINER_STATE = "trainer_state.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete, or does not fit the data."""


def step_dirname(step: int) -> str:
    return f"step-{step:07d}"


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- serving files


def write_drafter_folder(folder: Path, cfg: DrafterConfig, state: Mapping[str, torch.Tensor], record: Mapping) -> None:
    """config.json + model.safetensors + redraft.json: a servable drafter (and what eval reads back)."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    dtype = _DTYPE_NAMES.get(next(iter(floats)), None) if len(floats) == 1 else None
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "config.json", serving_config(cfg, engine="sglang", torch_dtype=dtype))
    _write_json(folder / REDRAFT_RECORD, {**record, "drafter": cfg.to_dict()})


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
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing (not a drafter folder)")
    record_path = folder / REDRAFT_RECORD
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if "drafter" not in record:
            raise CheckpointError(f"{record_path}: key 'drafter' is missing")
        cfg = DrafterConfig.from_dict(record["drafter"])
    else:
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{folder}: neither {REDRAFT_RECORD} nor config.json is present")
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
        return cfg, load_serving_weights(weights)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


INIT_FROM_FIELDS = ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "aux_layer_ids")


def check_init_compatible(
    init: DrafterConfig, wanted: DrafterConfig, source: str, fields: tuple[str, ...] = INIT_FROM_FIELDS
) -> None:
    """Refuse an --init-from drafter whose shapes or layer ids disagree with the data (names both values)."""
    problems = [
        f"{name}: {source} has {getattr(init, name)!r}, the data/config needs {getattr(wanted, name)!r}"
        for name in dict.fromkeys(fields)
        if getattr(init, name) != getattr(wanted, name)
    ]
    if problems:
        raise CheckpointError(f"--init-from {source} does not fit: " + "; ".join(problems))


# ----------------------------------------------------------------------------- training checkpoints


def is_complete(folder: Path) -> bool:
    return (folder / TRAINER_STATE).is_file() and (folder / TRAINING_STATE).is_dir()


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete ``step-*`` folders, oldest first (``.tmp-*`` leftovers are never listed)."""
    found = []
    for p in Path(out).iterdir() if Path(out).is_dir() else []:
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_resume_checkpoint(out: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: ``auto`` follows OUT/latest (else the newest complete step-*)."""
    if resume == "none":
        return None
    if resume != "auto":
        folder = Path(resume)
        if not is_complete(folder):
            raise CheckpointError(f"resume={resume}: not a complete checkpoint (needs {TRAINER_STATE}, {TRAINING_STATE}/)")
        return folder
    out = Path(out)
    latest = out / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        if STEP_RE.match(name) and is_complete(out / name):
            return out / name
        log.warning("%s names %r, which is not a complete checkpoint; scanning %s", latest, name, out)
    ckpts = list_checkpoints(out)
    return ckpts[-1][1] if ckpts else None


def read_trainer_state(folder: Path) -> dict[str, Any]:
    path = Path(folder) / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable: {e}") from e
    for key in ("step", "epoch", "position", "world_size"):
        if key not in state:
            raise CheckpointError(f"{path}: key {key!r} is missing")
    return state


def save_checkpoint(
    accelerator: Any,
    out: str | Path,
    step: int,
    *,
    drafter: Any,
    record: Mapping[str, Any],
    trainer_state: Mapping[str, Any],
    keep_last: int,
) -> Path:
    """Write OUT/step-XXXXXXX atomically. Every rank must call this (DeepSpeed saves its shards per rank)."""
    out = Path(out)
    name = step_dirname(step)
    final, tmp = out / name, out / f"{TMP_PREFIX}{name}"
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / TRAINING_STATE))
    if accelerator.is_main_process:
        write_drafter_folder(tmp, drafter.config, drafter.serving_state_dict(), record)
        _write_json(
            tmp / TRAINER_STATE,
            {**trainer_state, "rng_states": f"{TRAINING_STATE}/random_states_<rank>.pkl (one per rank)"},
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # same step saved again (e.g. a resumed run's final save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(out / LATEST, name + "\n")
        rotate_checkpoints(out, keep_last, protect=final)
        log.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


def rotate_checkpoints(out: Path, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` step-* folders, and stale .tmp-* leftovers."""
    removed: list[Path] = []
    for p in out.glob(f"{TMP_PREFIX}step-*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in out.glob(".*.tmp-*"):  # a killed atomic_write_text (e.g. of `latest`)
        if p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    if keep_last > 0:
        ckpts = [p for _, p in list_checkpoints(out)]
        for p in ckpts[:-keep_last]:
            if protect is not None and p.resolve() == protect.resolve():
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
