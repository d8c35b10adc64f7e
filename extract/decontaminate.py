"""`--decontaminate`: no training record may have a user turn close to an evaluation prompt.

A drafter trained on conversations that quote the prompts it is evaluated on reports an acceptance
gain it would not have on fresh traffic. Every parsed input record (any input: files, folders,
built-in data) is checked, in input order and before the shard plan, so the plan and a resumed run
stay the same: a record with ANY user turn that overlaps an evaluation prompt (the one definition,
``extract.prompt_filters.EvalSet.match``, at ``--eval-overlap``) is left out and counted as skipped
``eval_overlap``. The prompts of ``--data self`` were already checked while they were sampled
(``--self-decontaminate``); they are not checked again when that check covers this one (the same
or more evaluation inputs, a threshold no higher), but they are counted in the same summary.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extract.chat import sha256_json
from extract.prompt_filters import EvalSet, FilterSettings
from extract.records import Record, read_records
from redraft.core.config import ConfigError

log = logging.getLogger(__name__)

REASON = "eval_overlap"  # the skip reason of a dropped record (the same name --data self uses)
MAX_IDS = 50  # dropped ids the manifest lists


def eval_prompts(specs: Sequence[str]) -> list[str]:
    """Every user turn of the evaluation inputs (built-in names such as mtbench, or files)."""
    from redraft.catalog.builtin import resolve_data

    if not specs:
        return []
    records = read_records([resolve_data(s) for s in specs], require_assistant=False).records
    return [m.content for r in records for m in r.messages if m.role == "user"]


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or a.samefile(b)
    except OSError:
        return False


def refuse_contradiction(inputs: Mapping[str, Path], sources: Sequence[str]) -> None:
    """ConfigError when an input is one of the evaluation inputs: every one of its records would be dropped."""
    from redraft.catalog.builtin import resolve_data

    for source in sources:
        where = resolve_data(source)
        for name, path in inputs.items():
            if _same(path, where):
                raise ConfigError(f"data {name!r} ({path}) is the decontamination source {source!r} ({where}): "
                                  f"every one of its records would be dropped; take it out of --data or "
                                  f"out of --decontaminate")


def self_check_covers(cfg: Any) -> bool:
    """Whether the check of `--data self`'s prompts already did this one (same or more sources, threshold <=)."""
    from redraft.catalog.builtin import resolve_data

    mine = [resolve_data(s) for s in cfg.decontaminate]
    theirs = [resolve_data(s) for s in cfg.self_decontaminate]
    return cfg.self_eval_overlap <= cfg.eval_overlap and all(any(_same(a, b) for b in theirs) for a in mine)


@dataclass
class Decontamination:
    """The check of one run: its settings, then what it found (fed record by record through :meth:`keep`)."""

    sources: tuple[str, ...]
    eval_overlap: float
    eval_set: EvalSet
    sha256: str
    exempt: tuple[Path, ...] = ()  # inputs already checked (the self-written prompts)
    checked: int = 0
    exempt_records: int = 0
    dropped_ids: list[str] = field(default_factory=list)
    dropped: int = 0
    self_dropped: int | None = None  # self-written samples dropped as eval_overlap while sampling
    _is_exempt: dict[Path, bool] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, sources: Sequence[str], eval_overlap: float) -> Decontamination:
        texts = eval_prompts(sources)
        if not texts:
            raise ConfigError(f"decontaminate: {list(sources)} hold no user turns to check against")
        settings = FilterSettings(eval_overlap=eval_overlap)
        return cls(tuple(sources), eval_overlap, EvalSet(texts, settings), sha256_json(texts))

    def keep(self, path: Path, record: Record) -> bool:
        """False when a user turn of the record is close to an evaluation prompt (counted and logged)."""
        self.checked += 1
        if path not in self._is_exempt:
            self._is_exempt[path] = any(_same(path, p) for p in self.exempt)
        if self._is_exempt[path]:
            self.exempt_records += 1
            return True
        for m in record.messages:
            if m.role != "user":
                continue
            hit = self.eval_set.match(m.content)
            if hit is not None:
                self.dropped += 1
                if len(self.dropped_ids) < MAX_IDS:
                    self.dropped_ids.append(record.id)
                    log.info("%s (%s): dropped, a user turn is close to the evaluation prompt %r", record.id,
                             record.origin, self.eval_set.texts[hit][:80])
                return False
        return True

    def plan(self) -> dict[str, Any]:
        """What decides which records are dropped (a rerun with other settings must not mix outputs)."""
        return {"sources": list(self.sources), "eval_prompts": len(self.eval_set), "sha256": self.sha256,
                "eval_overlap": self.eval_overlap, "definition": self.eval_set.settings.to_json()}

    def manifest(self) -> dict[str, Any]:
        out = {**self.plan(), "checked_records": self.checked, "dropped": self.dropped,
               "dropped_ids": list(self.dropped_ids)}
        if self.self_dropped is not None:
            out["self_prompts"] = {"records": self.exempt_records, "checked_while_sampling": bool(self.exempt),
                                   "dropped_while_sampling": self.self_dropped}
        return out

    def describe(self) -> str:
        text = (f"decontamination ({','.join(self.sources)}, overlap >= {self.eval_overlap}): dropped {self.dropped} "
                f"of {self.checked} records")
        if self.self_dropped is not None:
            text += f" (+{self.self_dropped} self-written prompts while sampling)"
        return text
