"""Capture sequences built from the ids the target generated, and the check that they are stored as generated.

A regenerated assistant turn is captured as its prompt ids (the conversation so far, rendered once by
the chat template with the generation prompt, exactly what was sent to the target) followed by the
ids the target generated: stop token included when it wrote one, nothing appended when it was cut at
the token limit. Its text is never re-encoded: decode -> encode is not the identity (SmolLM2 splits a
"\\n\\n" token into two "\\n"), and a template closes a cut reply with an end-of-turn the target never wrote.

Multi-turn. The prompt of turn j+1 shows the target's reply to turn j the way the template renders
history (thinking templates drop the reasoning; text re-encodes differently), which is what an engine
serving the conversation computes on. So turn j is captured on prompt_j + output_j. When prompt_j starts,
token for token, with the sequence built so far (ChatML without reasoning, usually), the turn extends that
sample; otherwise it opens a new one. Every masked token is then a generated id whose context is exactly
the one it was generated in; earlier turns seen only through a later prompt are context (mask 0). A
conversation whose turns all chain is one sample (id = the record's id); otherwise each chain is a sample
with id ``{id}/turn-{k}`` (k: its first assistant turn, 1-based).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from extract.chat import encode_prompt
from extract.records import Generation, Record

MAX_LISTED_MISMATCHES = 10


def prompt_sha256(ids: Sequence[int]) -> str:
    """Digest of a prompt's token ids (sha256 of the compact JSON list), stored with each generated turn."""
    return hashlib.sha256(json.dumps([int(i) for i in ids], separators=(",", ":")).encode()).hexdigest()


def has_generation(record: Record) -> bool:
    """Whether any assistant turn of the record carries the ids the target generated."""
    return any(m.generation is not None for m in record.messages)


@dataclass
class GeneratedSample:
    """One capture sequence of generated turns (see the module docstring)."""

    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 exactly on the generated ids
    truncated: bool  # holds a reply cut at the token limit, or was cut at max_length
    turns: tuple[Generation, ...]


def generated_samples(tokenizer: Any, record: Record, max_length: int) -> list[GeneratedSample]:
    """The record's generated turns as capture sequences; assistant turns without ids are context only."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    chains: list[tuple[int, list[int], list[int], list[Generation]]] = []  # (first turn, ids, mask, turns)
    turn = 0
    for j, m in enumerate(record.messages):
        if m.role != "assistant":
            continue
        turn += 1
        if m.generation is None:
            continue
        prompt = encode_prompt(tokenizer, record.messages[:j])
        out = list(m.generation.output_ids)
        if chains and prompt[: len(chains[-1][1])] == chains[-1][1]:
            _, ids, mask, turns = chains[-1]
            gap = prompt[len(ids):]
            ids += gap + out
            mask += [0] * len(gap) + [1] * len(out)
            turns.append(m.generation)
        else:
            chains.append((turn, prompt + out, [0] * len(prompt) + [1] * len(out), [m.generation]))
    samples = []
    for first, ids, mask, turns in chains:
        sample_id = record.id if len(chains) == 1 else f"{record.id}/turn-{first}"
        cut = any(g.finish_reason == "length" for g in turns)
        samples.append(GeneratedSample(sample_id, ids[:max_length], mask[:max_length],
                                       cut or len(ids) > max_length, tuple(turns)))
    return samples


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for t, m in enumerate(mask):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def check_generated(
    input_ids: Sequence[int], loss_mask: Sequence[int], turns: Sequence[Generation], truncated: bool
) -> str | None:
    """None when the stored sample holds its generated turns exactly as generated, else what differs.

    Independent of how the sample was built: the k-th masked run is the k-th turn; it must start where
    that turn's prompt ended, the ids before it must be that prompt (by digest), the run must be the
    generated ids (only a sample cut at max_length may end inside one), every turn must be there (or cut
    away by max_length), and a sample holding a reply cut at the token limit must be flagged truncated.
    """
    ids = [int(i) for i in input_ids]
    runs = _runs([int(m) for m in loss_mask])
    ordered = sorted(turns, key=lambda g: g.prompt_tokens)
    for k, ((a, b), g) in enumerate(zip(runs, ordered, strict=False), start=1):
        out = list(g.output_ids)
        if a != g.prompt_tokens:
            return f"turn {k} starts at token {a}, but the prompt it was generated from had {g.prompt_tokens} tokens"
        if prompt_sha256(ids[:a]) != g.prompt_sha256:
            return f"the {a} tokens before turn {k} are not the prompt it was generated from"
        stored = ids[a:b]
        if len(stored) > len(out) or stored != out[: len(stored)]:
            j = next((i for i, (x, y) in enumerate(zip(stored, out, strict=False)) if x != y), min(len(stored), len(out)))
            return f"turn {k}: stored ids differ from the generated ids at reply token {j}"
        if len(stored) < len(out) and not (b == len(ids) and truncated):
            return f"turn {k}: {len(stored)} of {len(out)} generated ids stored"
        if g.finish_reason == "length" and not truncated:
            return f"turn {k} was cut at the token limit but the sample is not flagged truncated"
    if len(runs) > len(ordered):
        a, b = runs[len(ordered)]
        return f"masked tokens [{a}, {b}) are not a generated turn"
    for k, g in enumerate(ordered[len(runs):], start=len(runs) + 1):
        if not (truncated and g.prompt_tokens >= len(ids)):
            return f"generated turn {k} is not masked"
    return None


@dataclass
class ExactnessCounts:
    """Per-shard (and, summed, per-dataset) result of checking the generated samples as stored."""

    samples: int = 0
    turns: int = 0
    mismatched_samples: int = 0
    cut_samples: int = 0
    first_mismatches: list[dict[str, str]] = field(default_factory=list)

    def add(self, sample_id: str, turns: int, cut: bool, problem: str | None) -> None:
        self.samples += 1
        self.turns += turns
        self.cut_samples += int(cut)
        if problem is not None:
            self.mismatched_samples += 1
            if len(self.first_mismatches) < MAX_LISTED_MISMATCHES:
                self.first_mismatches.append({"id": sample_id, "problem": problem})

    def merge(self, other: ExactnessCounts) -> None:
        self.samples += other.samples
        self.turns += other.turns
        self.cut_samples += other.cut_samples
        self.mismatched_samples += other.mismatched_samples
        room = MAX_LISTED_MISMATCHES - len(self.first_mismatches)
        self.first_mismatches += other.first_mismatches[: max(room, 0)]

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples, "turns": self.turns, "mismatched_samples": self.mismatched_samples,
                "cut_samples": self.cut_samples, "first_mismatches": list(self.first_mismatches)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ExactnessCounts:
        return cls(int(obj["samples"]), int(obj["turns"]), int(obj["mismatched_samples"]), int(obj["cut_samples"]),
                   [dict(m) for m in obj.get("first_mismatches", [])])
