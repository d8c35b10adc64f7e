"""What a load wrote into a model: sentinels, row spans, shard names, the vocab map, the report.

Why sentinels: SGLang skips weight names it does not know and leaves the parameter as it was built
(``torch.empty``: whatever memory held), so "it loaded without an error" proves nothing. Every
parameter is filled with a value no checkpoint carries (NaN for floats, ``iinfo.min`` for integers)
before the load; what still holds it afterwards was never written, row by row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Span = tuple[int, int]  # rows [start, stop)


@dataclass(frozen=True)
class Shard:
    """Rows [start, stop) of a stacked parameter that one checkpoint tensor fills (``label``: its name)."""

    label: str
    start: int
    stop: int


CHUNK = 1 << 24  # elements per block when scanning: bounds the temporaries for a 1 B-parameter drafter
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def sentinel_fill(params: Iterable[torch.Tensor]) -> None:
    """NaN into float tensors, ``iinfo.min`` into integer ones; bool tensors cannot hold a sentinel."""
    with torch.no_grad():
        for p in params:
            if p.dtype.is_floating_point:
                p.fill_(float("nan"))
            elif p.dtype != torch.bool:
                p.fill_(torch.iinfo(p.dtype).min)


def _sentinel_bits(dtype: torch.dtype) -> tuple[torch.dtype, int] | None:
    """(integer view dtype, bit pattern) of the sentinel ``fill_`` writes, or None (bool, exotic floats)."""
    if dtype.is_floating_point:
        view = _INT_VIEW.get(dtype)
        if view is None:
            return None
        return view, int(torch.full((1,), float("nan"), dtype=dtype).view(view)[0])
    if dtype == torch.bool:
        return None
    return dtype, torch.iinfo(dtype).min


def _as_rows(p: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``p`` as [rows, -1] in the integer view its sentinel is compared in, and the pattern; None if none."""
    bits = _sentinel_bits(p.dtype)
    if bits is None or p.numel() == 0:  # an empty tensor (a loader's placeholder) holds nothing to check
        return None
    view, pattern = bits
    data = p.detach()
    rows = data.reshape(data.shape[0], -1) if data.dim() else data.reshape(1, 1)
    if view != rows.dtype:
        rows = rows.contiguous().view(view)
    return rows, pattern


def _blocks(rows: torch.Tensor) -> Iterator[torch.Tensor]:
    step = max(1, CHUNK // max(rows.shape[1], 1))
    for s in range(0, rows.shape[0], step):
        yield rows[s: s + step]


def sentinel_rows(p: torch.Tensor) -> torch.Tensor | None:
    """Per row (first dim): how many elements still hold the sentinel; None when it cannot hold one.

    Compared bit for bit through an integer view, block by block: no float upcast and no
    full-size temporaries (a Kimi-sized embedding is 1.2 B elements).
    """
    found = _as_rows(p)
    if found is None:
        return None
    rows, pattern = found
    return torch.cat([(b == pattern).sum(dim=1) for b in _blocks(rows)])


def holds_sentinel(p: torch.Tensor) -> bool | None:
    """Whether any element still holds the sentinel (a quicker test than counting); None if it cannot."""
    found = _as_rows(p)
    if found is None:
        return None
    rows, pattern = found
    return any(bool((b == pattern).any()) for b in _blocks(rows))


def spans(rows: torch.Tensor) -> list[Span]:
    """Maximal runs of True in a 1-d bool tensor, as [start, stop) pairs."""
    edges = torch.diff(rows.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    stops = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, stops, strict=True))


def written_spans(p: torch.Tensor) -> list[Span] | None:
    """Rows with at least one element no longer the sentinel; None when it cannot hold one.

    A row is all sentinel iff its min and its max (in the integer view) are the pattern: two
    vectorised reductions, about 1 s for a 1.2 B-element embedding on one core, where counting is 7.
    """
    found = _as_rows(p)
    if found is None:
        return None
    rows, pattern = found
    touched = torch.cat([(b.amin(dim=1) != pattern) | (b.amax(dim=1) != pattern) for b in _blocks(rows)])
    return spans(touched)


def format_spans(found: Sequence[Span], rows: int) -> str:
    parts = [f"{a}..{b - 1}" if b - a > 1 else f"{a}" for a, b in found[:4]]
    more = f" and {len(found) - 4} more ranges" if len(found) > 4 else ""
    return f"rows {', '.join(parts)}{more} of {rows}"


def shard_names(found: Sequence[Span], shards: Sequence[Shard]) -> list[str]:
    """The shards a set of row spans touches, e.g. ``['up_proj']`` for the second half of gate_up_proj."""
    hit = []
    for s in shards:
        if any(a < s.stop and b > s.start for a, b in found):
            hit.append(s.label)
    return hit


def describe_unwritten(name: str, p: torch.Tensor, shards: Sequence[Shard]) -> str:
    """One line: how much of ``p`` was never written, where, and which shard that is."""
    left = sentinel_rows(p)
    assert left is not None
    n = int(left.sum())
    found = spans(left > 0)
    where = format_spans(found, p.shape[0] if p.dim() else 1)
    named = shard_names(found, shards)
    shard = f" (the {'/'.join(named)} shard{'s' if len(named) > 1 else ''})" if named else ""
    return f"{n}/{p.numel()} elements never written; {where}{shard}"


def nonfinite_keys(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Checkpoint keys holding NaN or inf: they would read as "never written" after the load."""
    return [k for k, t in tensors.items() if t.dtype.is_floating_point and not bool(torch.isfinite(t).all())]


def vocab_map_problems(target_ids: torch.Tensor, draft_vocab: int, vocab: int) -> list[str]:
    """The draft -> target id map an engine holds: one entry per draft id, inside the vocab, one-to-one."""
    ids = target_ids.detach().to(torch.int64).flatten()
    out = []
    if ids.numel() != draft_vocab:
        out.append(f"d2t has {ids.numel()} entries but draft_vocab_size is {draft_vocab}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        out.append(f"d2t maps draft ids outside the target vocab [0, {vocab}): "
                   f"target ids {int(ids.min())}..{int(ids.max())}")
    if ids.unique().numel() != ids.numel():
        out.append(f"d2t is not one-to-one ({ids.numel() - ids.unique().numel()} draft ids share a target id)")
    return out


def t2d_disagreement(target_ids: torch.Tensor, t2d: torch.Tensor) -> str | None:
    """Engines ignore t2d, so a t2d that names other tokens than d2t is worth a warning, not a failure."""
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        return f"t2d is {t2d.dtype} {tuple(t2d.shape)}, expected bool [vocab]"
    ids = target_ids.to(torch.int64).flatten()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.numel()):
        return None  # already a d2t problem
    from_d2t = torch.zeros_like(t2d)
    from_d2t[ids] = True
    differ = int((from_d2t != t2d).sum())
    return f"t2d disagrees with d2t at {differ} target ids (both engines ignore t2d)" if differ else None


@dataclass
class KeyUse:
    """Where one checkpoint key went: parameter -> row spans, or why it went nowhere."""

    key: str
    wrote: dict[str, list[Span]] = field(default_factory=dict)
    together_with: list[str] = field(default_factory=list)  # keys the engine only takes as a group
    vocab_map: bool = False  # taken as the draft->target map outside the parameters (SGLang hot_token_id)
    by_design: str | None = None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "wrote": {k: [list(s) for s in v] for k, v in self.wrote.items()},
                "together_with": self.together_with, "vocab_map": self.vocab_map, "by_design": self.by_design,
                "problem": self.problem}


@dataclass
class Report:
    """One engine's load of one folder; PASS only when nothing was lost, ignored or misplaced."""

    engine: str
    folder: str
    architecture: str = ""
    model_class: str = ""
    version: str = ""
    params: int = 0
    by_design: dict[str, str] = field(default_factory=dict)  # parameter left to the target -> why
    keys: list[KeyUse] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the human-readable table (NOT LOADED / IGNORED / ...)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        """``VERDICT <engine> PASS: ...`` or ``VERDICT <engine> FAIL (n problems): first; second; ...``."""
        if self.ok:
            design = f" ({len(self.by_design)} provided by the target by design)" if self.by_design else ""
            skipped = [u.key for u in self.keys if u.by_design]
            skip = f" ({', '.join(skipped)} skipped by design)" if skipped else ""
            return (f"VERDICT {self.engine} PASS: {self.model_class}: {self.params}/{self.params} parameters "
                    f"loaded{design}, {len(self.keys)}/{len(self.keys)} checkpoint keys used{skip}")
        n = len(self.problems)
        flat = [" ".join(m.split()) for m in self.problems[:4]]  # engine errors span lines; a verdict does not
        shown = [m if len(m) <= 180 else m[:177] + "..." for m in flat]
        if n > 4:
            shown.append(f"... {n - 4} more")
        return f"VERDICT {self.engine} FAIL ({n} problem{'s' if n != 1 else ''}): " + "; ".join(shown)

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "folder": self.folder, "architecture": self.architecture,
                "model_class": self.model_class, "version": self.version, "params": self.params,
                "by_design": self.by_design, "keys": [u.to_json() for u in self.keys], "problems": self.problems,
                "warnings": self.warnings, "ok": self.ok}
