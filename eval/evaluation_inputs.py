"""What an offline evaluation reads: the drafter (checked against the dataset), the samples, the teacher.

eval.acceptance and eval.online select the same held-out samples and load drafters the same way;
a drafter trained on another target, tokenizer or chat template is refused here by name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from redraft.core.batching import pack_batches
from redraft.core.drafter.folder import (
    CheckpointError,
    load_drafter_checkpoint,
    read_record,
    resolve_drafter_folder,
)
from redraft.core.drafter.kinds import build_drafter
from redraft.core.errors import UserError
from redraft.core.target_weights import read_target_tensor, weight_key_candidates
from redraft.core.teacher_targets import teacher_from_last_hidden, teacher_from_topk, topk_argmax

log = logging.getLogger(__name__)


class AcceptanceError(UserError):
    """A checkpoint, dataset or option combination that cannot be evaluated; the message names both sides."""


# ----------------------------------------------------------------------------- checkpoints


def resolve_checkpoint(path: str | Path) -> Path:
    """A drafter folder: ``path`` itself, or a run folder's ``latest`` step (else its newest step-*)."""
    try:
        return resolve_drafter_folder(path)
    except CheckpointError as e:
        raise AcceptanceError(str(e)) from e


def check_fits(cfg: Any, manifest: dict[str, Any], num_aux: int, source: str, data: str) -> None:
    """Refuse a drafter whose target hidden size, vocab or layer ids differ from the dataset's."""
    pairs = [
        ("target hidden size", cfg.target_hidden_size, int(manifest["hidden_size"]), "hidden_size"),
        ("vocab size", cfg.vocab_size, int(manifest["vocab_size"]), "vocab_size"),
        ("aux layer ids", list(cfg.aux_layer_ids), [int(i) for i in manifest.get("aux_layer_ids") or []],
         "aux_layer_ids"),
        ("number of aux layers", cfg.num_aux_layers, num_aux, "aux_hidden width / hidden_size"),
    ]
    problems = [f"{what}: drafter {source} has {mine!r}, dataset {data} has {theirs!r} ({key})"
                for what, mine, theirs, key in pairs if mine != theirs]
    if problems:
        raise AcceptanceError("checkpoint does not fit the data: " + "; ".join(problems))


def check_fingerprint(record: dict[str, Any] | None, manifest: dict[str, Any], source: str, data: str) -> None:
    """Refuse a redraft drafter trained on data from another tokenizer or chat template (same shapes, other ids)."""
    recorded = (record or {}).get("dataset") or {}
    problems = [f"{key}: drafter {source} was trained on {recorded[key]!r}, dataset {data} has {manifest[key]!r}"
                for key in ("tokenizer_hash", "chat_template_hash")
                if recorded.get(key) and manifest.get(key) and recorded[key] != manifest[key]]
    if problems:
        raise AcceptanceError("checkpoint does not fit the data: " + "; ".join(problems))


def target_folder(manifest: dict[str, Any], target: str | Path | None, data: str) -> Path:
    path = Path(target) if target else Path(str((manifest.get("target") or {}).get("path", "")))
    if not path.exists():
        raise AcceptanceError(
            f"target folder {str(path)!r} (from {'--target' if target else data + '/manifest.json target.path'}) "
            "does not exist; the drafter needs the target's input embedding: pass --target PATH"
        )
    return path


def _key_candidates(manifest: dict[str, Any], target: Path, which: str) -> list[str]:
    """Embedding (which='embed') or lm_head keys: the manifest's recorded key first, then the usual names."""
    tinfo = manifest.get("target") or {}
    keys = [tinfo[f"{which}_key"]] if tinfo.get(f"{which}_key") else []
    cfg_file = target / "config.json"
    if cfg_file.is_file():
        embed, head = weight_key_candidates(json.loads(cfg_file.read_text()))
        keys += embed if which == "embed" else head
    return list(dict.fromkeys(keys))


def _load_checked(folder: Path, reader: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    manifest = reader.manifest
    tinfo = manifest.get("target") or {}
    try:
        cfg, state = load_drafter_checkpoint(
            folder, target_architecture=tinfo.get("architecture") or "LlamaForCausalLM",
            target_num_layers=int(manifest["num_layers"]),
        )
    except CheckpointError as e:
        raise AcceptanceError(str(e)) from e
    check_fits(cfg, manifest, reader.num_aux, str(folder), str(reader.root))
    check_fingerprint(read_record(folder), manifest, str(folder), str(reader.root))
    return cfg, state


def inspect_checkpoint(checkpoint: str | Path, reader: Any) -> tuple[Path, dict[str, Any] | None]:
    """(resolved folder, redraft record or None), after checking the drafter fits the data."""
    folder = resolve_checkpoint(checkpoint)
    _load_checked(folder, reader)
    return folder, read_record(folder)


def load_drafter(
    checkpoint: str | Path, reader: Any, *, target: str | Path | None = None, device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Path, dict[str, Any] | None]:
    """(drafter with the target embedding, resolved folder, redraft record or None) checked against the data."""
    folder = resolve_checkpoint(checkpoint)
    manifest = reader.manifest
    cfg, state = _load_checked(folder, reader)
    impl = "sdpa" if str(device).startswith("cuda") else "eager"
    drafter = build_drafter(cfg, attention_impl=impl)
    drafter.load_serving_state_dict(state)
    tpath = target_folder(manifest, target, str(reader.root))
    drafter.load_target_embedding(tpath, _key_candidates(manifest, tpath, "embed"))
    drafter.to(device=device, dtype=dtype).eval()
    return drafter, folder, read_record(folder)


# ----------------------------------------------------------------------------- samples


def select_samples(
    reader: Any, records: Sequence[dict[str, Any] | None], split: str, max_samples: int = 0
) -> tuple[list[int], str]:
    """(dataset indices in dataset order, description). See the module docstring for the rules."""
    if split not in ("val", "all"):
        raise AcceptanceError(f"--split must be 'val' or 'all', got {split!r}")
    indices = list(range(len(reader)))
    desc = "all"
    if split == "val":
        recorded = [set(map(str, r["val_ids"])) for r in records if r and r.get("val_ids") is not None]
        if not recorded:
            log.warning("no checkpoint records a validation split (imported drafters?): evaluating on ALL %d "
                        "samples, which may include training data", len(reader))
        else:
            if len(recorded) < len(records):
                log.warning("%d of %d checkpoints record no validation split; using the others' split",
                            len(records) - len(recorded), len(records))
            wanted = set.intersection(*recorded)
            if len(wanted) < max(len(s) for s in recorded):
                log.warning("checkpoints record different validation splits; using their intersection "
                            "(%d ids)", len(wanted))
            present = set(reader.sample_ids)
            missing = wanted - present
            if missing:
                log.warning("%d validation ids are not in %s (another dataset?); skipping them",
                            len(missing), reader.root)
            indices = [i for i, s in enumerate(reader.sample_ids) if s in wanted]
            if not indices:
                raise AcceptanceError(
                    f"the recorded validation split has no sample in {reader.root} (intersection of "
                    f"{len(recorded)} checkpoint split(s)); use --split all"
                )
            desc = "val"
    if max_samples > 0:
        indices = indices[:max_samples]
    return indices, desc


def make_batches(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches whose padded size B * T_max stays within ``batch_tokens`` (one sample at least)."""
    groups = pack_batches([lengths[i] for i in indices], batch_tokens)
    return [[indices[j] for j in group] for group in groups]


# ----------------------------------------------------------------------------- teacher


def teacher_for_batch(
    batch: Any, drafter: Any, kind: str, temperature: float, lm_head: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax [B, T] full vocab, teacher prob on the draft vocab at temperature T [B, T, Vd] or None at T=0)."""
    if kind == "topk":
        ids, lp = batch.topk_ids, batch.topk_logprobs.float()
        argmax = topk_argmax(ids, lp, drafter.config.vocab_size)
        if temperature <= 0:
            return argmax, None
        valid = (ids >= 0) & (ids < drafter.config.vocab_size)
        lp_t = torch.log_softmax(lp.masked_fill(~valid, float("-inf")) / temperature, dim=-1)  # truncated to the top-k
        return argmax, teacher_from_topk(ids, lp_t, drafter.t2d, drafter.d2t).p_on_draft
    if lm_head is None:
        raise AcceptanceError("teacher 'last_hidden' needs the target's lm_head")
    scale = temperature if temperature > 0 else 1.0
    t = teacher_from_last_hidden(batch.last_hidden.float() / scale, lm_head, drafter.t2d)
    return t.target_ids, (t.p_on_draft if temperature > 0 else None)


def teacher_kind(reader: Any, wanted: str) -> str:
    has_topk, has_last = reader.has_topk, bool(getattr(reader, "has_last_hidden", False))
    if wanted == "auto":
        wanted = "topk" if has_topk else "last_hidden"
    if (wanted == "topk" and not has_topk) or (wanted == "last_hidden" and not has_last):
        raise AcceptanceError(f"teacher {wanted!r} is not stored in {reader.root} (teacher {reader.teacher})")
    return wanted


def read_lm_head(manifest: dict[str, Any], target: Path, device: str) -> torch.Tensor:
    weight, _ = read_target_tensor(target, _key_candidates(manifest, target, "lm_head"))
    return weight.to(device=device, dtype=torch.float32)
