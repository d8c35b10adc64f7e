"""What the regeneration tests share: the stored samples of a dataset, the check that every reply is stored as the
target generated it, an extraction config on a small target, and a recorder of the backend's replies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from regen_exactness import recording_loader

import extract.pipeline as pipeline
from extract.config import ExtractConfig
from redraft.core.dataset.reader import DatasetReader


@dataclass
class Stored:
    sample_id: str
    ids: list[int]
    mask: list[int]
    truncated: bool


def stored_samples(out: Path) -> list[Stored]:
    reader = DatasetReader(out)
    result = []
    for i in range(len(reader)):
        s = reader.get(i)
        result.append(Stored(reader.sample_ids[i], s.input_ids.tolist(), [int(m) for m in s.loss_mask.tolist()],
                             reader.truncated[i]))
    return result


def assert_stored_as_generated(samples: list[Stored], calls: list[tuple[list[int], list[int]]], stops: set[int]):
    """Every generated reply is stored right after the exact prompt it was generated from, masked, stop id
    included only when the target wrote it; nothing else is masked; samples holding a cut reply are flagged."""
    expected: dict[str, set[int]] = {s.sample_id: set() for s in samples}
    for prompt, output in calls:
        hits = [s for s in samples if s.ids[: len(prompt) + len(output)] == prompt + output
                and all(s.mask[len(prompt) : len(prompt) + len(output)])]
        assert hits, f"reply {output[:8]}... to a prompt of {len(prompt)} tokens is not stored as generated"
        for s in hits:
            expected[s.sample_id].update(range(len(prompt), len(prompt) + len(output)))
            if output[-1] not in stops:
                assert s.truncated, f"{s.sample_id} holds a reply cut at the token limit but is not flagged"
    for s in samples:
        masked = {t for t, m in enumerate(s.mask) if m}
        assert masked == expected[s.sample_id], f"{s.sample_id}: masked tokens other than generated ids"


def extract_cfg(target: Path, data: Path, out: Path, **kw) -> ExtractConfig:
    base = dict(target=str(target), data=[str(data)], out=str(out), samples_per_shard=4, max_length=512,
                batch_tokens=2048, topk=4, rank=0, world_size=1)
    base.update(kw)
    return ExtractConfig(**base).validate()


def recording_backend(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Record what the real backend's generate returns (the backend itself is untouched)."""
    calls: list[tuple[list[int], list[int]]] = []
    monkeypatch.setattr(pipeline, "load_backend", recording_loader(pipeline.load_backend, calls))
    return calls
