"""Training checkpoints: a drafter folder (redraft.core.drafter.folder) plus the full training state, written atomically.

Layout of ``OUT/step-0000100/``::

    config.json          SGLang/vLLM ``LlamaForCausalLMEagle3`` config (servable as is)
    model.safetensors    serving weights (no embedding)
    redraft.json         DrafterConfig, dataset fingerprint, val ids, train config
    trainer_state.json   step, epoch, global sampler position, world size, micro-batches per step, LR schedule
    training_state/      accelerator.save_state (model, optimizer, per-rank RNG; DeepSpeed-aware)
    training_state.universal/   only after an elastic resume from here: DeepSpeed's universal form of it

Everything is written into ``OUT/.tmp-step-0000100`` and renamed once complete, then ``OUT/latest``
is replaced atomically, so a run killed at any moment leaves either the old or the new checkpoint. A step saved
again (a resumed run's final save) moves the old folder aside (``OUT/.replaced-step-0000100``) before the new one
takes its name and deletes it only after; a run killed between the two renames finds it there and puts it back
(``recover_replaced``), so there is never a moment without a complete checkpoint, even with ``keep_last: 1``.
One trainer at a time writes into OUT (``output_lock``).

Elastic resume (``resume_point``): a run resumes on another world size W' when its optimizer step, W x
grad_accum micro-batches, can be kept (grad_accum' = W x grad_accum / W'): the data order is the global one
(``train.data``), so the same micro-batches make the same steps and the LR schedule and step count carry
over unchanged; only the order of the gradient reduction differs (float rounding). DeepSpeed refuses to load
ZeRO optimizer partitions saved at another world size, so the saved state is first converted to DeepSpeed's
universal checkpoint (``deepspeed.checkpoint.ds_to_universal``, its supported path for this) and loaded
with ``checkpoint.load_universal``; without DeepSpeed the optimizer state is whole on every rank already.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.core.atomic import atomic_write_text
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.folder import (
    LATEST,
    STEP_RE,
    CheckpointError,
    step_dirname,
    write_drafter_folder,
    write_json,
)

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
LOCK_NAME = ".trainer.lock"
TRAINING_STATE = "training_state"
TRAINER_STATE = "trainer_state.json"
UNIVERSAL = "training_state.universal"
DEEPSPEED_TAG = "pytorch_model"  # accelerate's tag for the DeepSpeed engine's files under training_state/
ORDER_RULE = "global"  # trainer_state.json's position counts global micro-batches (older: this rank's)


INIT_FROM_FIELDS = ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "aux_layer_ids")


def check_init_compatible(
    init: DrafterConfig, wanted: DrafterConfig, source: str, fields: tuple[str, ...] = INIT_FROM_FIELDS
) -> None:
    """Refuse an --init-from drafter whose shapes or layer ids disagree with the data (names both values)."""
    problems = [
        f"{name}: {source} has {getattr(init, name)!r}, the data/config needs {getattr(wanted, name)!r}"
        + (f" (set drafter_attention: {init.attention} to warm-start from it)" if name == "attention" else "")
        + (f" (set drafter_method: {init.method} to warm-start from it)" if name == "method" else "")
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


@contextlib.contextmanager
def output_lock(out: str | Path, main_process: bool = True) -> Iterator[None]:
    """Refuse a second trainer on the same OUT while this one runs (held by the main process, which the launcher
    starts once per job). An flock: the kernel drops it when the holder dies, so a killed trainer never leaves
    OUT locked."""
    if not main_process:
        yield
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK_NAME, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise CheckpointError(f"{out}: another train/main.py is training into this folder ({holder}); wait for "
                                  "it to end or stop it, or pass another --out") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def recover_replaced(out: Path) -> None:
    """Finish a re-save a kill interrupted: a ``.replaced-step-*`` folder is deleted once its step is complete
    again, else renamed back (the new one never took its name)."""
    for old in sorted(Path(out).glob(f"{REPLACED_PREFIX}step-*")) if Path(out).is_dir() else []:
        final = old.with_name(old.name[len(REPLACED_PREFIX):])
        if is_complete(final):
            shutil.rmtree(old, ignore_errors=True)
        elif is_complete(old) and not final.exists():
            log.warning("%s: a re-save of this step was interrupted; the earlier checkpoint is put back", final)
            os.replace(old, final)


def find_resume_checkpoint(out: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: ``auto`` follows OUT/latest (else the newest complete step-*)."""
    if resume == "none":
        return None
    recover_replaced(Path(out))
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


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts, for this run's world size (``resume_point``)."""

    folder: Path
    step: int
    epoch: int
    position: int  # global micro-batches of ``epoch`` trained
    tokens_seen: int
    scheduler: dict[str, Any] | None
    saved_world_size: int
    micro_batches_per_step: int  # W x grad_accum of the saved run: what every step of this one keeps
    grad_accum: int  # for this run: micro_batches_per_step over this world size
    deepspeed: bool  # the saved training state is a DeepSpeed engine's
    data: dict[str, Any] | None = None  # the data source's own state (a stream's group sizes)
    total_steps: int | None = None  # the saved run's schedule length

    @property
    def world_size(self) -> int:
        return self.micro_batches_per_step // self.grad_accum

    @property
    def elastic(self) -> bool:
        return self.saved_world_size != self.world_size


def resume_point(folder: Path, world_size: int, grad_accum: int) -> ResumePoint:
    """Read a checkpoint's trainer state and fit it to ``world_size`` ranks (the elastic rule, module doc).

    A saved step of M micro-batches needs M divisible by the new world size; ``grad_accum`` (this run's
    config) gives way to M / world_size when they differ, with a warning. Checkpoints from before the global
    order rule resume on their own world size only.
    """
    ts = read_trainer_state(folder)
    path = Path(folder) / TRAINER_STATE
    saved_world = int(ts["world_size"])
    global_rule = ts.get("order_rule") == ORDER_RULE
    if not global_rule and saved_world != world_size:
        raise CheckpointError(f"{path}: saved with world size {saved_world} by a redraft without elastic resume; "
                              f"resume it on {saved_world} process(es)")
    mbps = int(ts.get("micro_batches_per_step") or saved_world * grad_accum)
    if mbps % world_size:
        fits = [w for w in range(1, mbps + 1) if mbps % w == 0]
        raise CheckpointError(f"{path}: a step of this run is {mbps} micro-batches (world size {saved_world} x "
                              f"grad_accum {mbps // saved_world}), which {world_size} processes cannot share "
                              f"evenly; resume on one of {fits} processes")
    accum = mbps // world_size
    if accum != grad_accum:
        log.warning("%s: resuming a run of %d process(es) x grad_accum %d on %d: grad_accum %d (not the config's "
                    "%d), so that every step stays %d micro-batches", folder, saved_world, mbps // saved_world,
                    world_size, accum, grad_accum, mbps)
    position = int(ts["position"]) * (1 if global_rule else saved_world)
    point = ResumePoint(folder=Path(folder), step=int(ts["step"]), epoch=int(ts["epoch"]), position=position,
                        tokens_seen=int(ts.get("tokens_seen", 0)), scheduler=ts.get("scheduler"),
                        saved_world_size=saved_world, micro_batches_per_step=mbps, grad_accum=accum,
                        deepspeed=(Path(folder) / TRAINING_STATE / DEEPSPEED_TAG).is_dir(), data=ts.get("data"),
                        total_steps=int(ts["total_steps"]) if ts.get("total_steps") else None)
    return point


def universal_training_state(point: ResumePoint, accelerator: Any) -> Path:
    """The saved DeepSpeed state in DeepSpeed's universal form, for a load at another world size.

    Converted once by rank 0 into ``training_state.universal`` beside the original (written under a temporary
    name and renamed, so a killed conversion is redone, never half-read); every rank then loads it.
    """
    final = point.folder / UNIVERSAL
    if accelerator.is_main_process and not final.is_dir():
        tmp = point.folder / f"{TMP_PREFIX}{UNIVERSAL}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
               "--input_folder", str(point.folder / TRAINING_STATE / DEEPSPEED_TAG),
               "--output_folder", str(tmp / DEEPSPEED_TAG), "--inject_missing_state",
               "--num_extract_workers", "1", "--num_merge_workers", "1"]
        log.info("elastic resume: converting %s to DeepSpeed's universal checkpoint", point.folder / TRAINING_STATE)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{point.folder / TRAINING_STATE}: DeepSpeed's ds_to_universal failed "
                                  f"(exit {res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
        for rng in (point.folder / TRAINING_STATE).glob("random_states_*.pkl"):
            shutil.copy2(rng, tmp / rng.name)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


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
        replaced = out / f"{REPLACED_PREFIX}{name}"
        if final.exists():  # same step saved again (e.g. a resumed run's final save): aside until the new one is in
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        atomic_write_text(out / LATEST, name + "\n")
        shutil.rmtree(replaced, ignore_errors=True)
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
