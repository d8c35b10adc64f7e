"""Training checkpoints: a drafter folder (core.drafter.folder) plus the full training state, written atomically.

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
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.atomic import atomic_write_text
from core.drafter.config import DrafterConfig
from core.drafter.folder import (
    LATEST,
    STEP_RE,
    CheckpointError,
    step_dirname,
    write_drafter_folder,
    write_json,
)

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
TRAINING_STATE = "training_state"
TRAINER_STATE = "trainer_state.json"


INIT_FROM_FIELDS = ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "aux_layer_ids")


def check_init_compatible(
    init: DrafterConfig, wanted: DrafterConfig, source: str, fields: tuple[str, ...] = INIT_FROM_FIELDS
) -> None:
    """Refuse an --init-from drafter whose shapes or layer ids disagree with the data (names both values)."""
    problems = [
        f"{name}: {source} has {getattr(init, name)!r}, the data/config needs {getattr(wanted, name)!r}"
        + (f" (set drafter_attention: {init.attention} to warm-start from it)" if name == "attention" else "")
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
        write_json(
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
