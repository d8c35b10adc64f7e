"""Train/val split, length-bucketed batches and a resumable distributed sampler.

Everything here is a pure function of (sample ids, lengths, seed, epoch, rank, world size), so a
resumed run replays exactly the batches an uninterrupted run would have seen, and every rank can
compute the same global batch list without talking to the others.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from core.batching import pack_sorted

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- split


def _unit_hash(sample_id: str, seed: int) -> float:
    h = hashlib.sha256(f"{seed}\x00{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split_by_id(
    sample_ids: Sequence[str], val_fraction: float, val_max_samples: int, seed: int
) -> tuple[list[int], list[int]]:
    """(train indices, val indices). Membership depends only on (id, seed), not on order or world size,

    so adding samples to a dataset never moves an old sample between splits (except through the cap,
    which keeps the val samples with the smallest hashes).
    """
    seen: set[str] = set()
    for s in sample_ids:
        if s in seen:
            raise ValueError(f"sample id {s!r} appears more than once; the split needs unique ids")
        seen.add(s)
    scored = [(_unit_hash(str(s), seed), i) for i, s in enumerate(sample_ids)]
    val = sorted((h, i) for h, i in scored if h < val_fraction)
    if val_max_samples >= 0:
        val = val[:val_max_samples]
    val_idx = sorted(i for _, i in val)
    val_set = set(val_idx)
    train_idx = [i for i in range(len(sample_ids)) if i not in val_set]
    if not train_idx:
        raise ValueError(f"no training samples left after holding out {len(val_idx)} for validation")
    return train_idx, val_idx


# ----------------------------------------------------------------------------- batching


def length_bucketed_batches(
    indices: Sequence[int],
    lengths: Sequence[int],
    *,
    tokens_per_batch: int,
    max_samples: int,
    mega_batch_samples: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> list[list[int]]:
    """Global batches for one epoch: shuffle, cut into mega-batches, sort each by length, then pack.

    A batch holds as many samples as fit in ``tokens_per_batch`` padded tokens (longest × count) and
    at most ``max_samples`` (0: no cap). A sample longer than the budget gets a batch of its own.
    Batch order is shuffled again so long and short batches interleave.
    """
    order = list(indices)
    rng = random.Random(f"{seed}:{epoch}")
    if shuffle:
        rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), mega_batch_samples):
        mega = sorted(order[start : start + mega_batch_samples], key=lambda i: (-lengths[i], i))
        batches += pack_sorted(mega, lengths, tokens_per_batch, max_samples)
    if shuffle:
        rng.shuffle(batches)
    return batches


@dataclass
class SamplerState:
    """Where the data stream is: ``position`` micro-batches of this rank's share of ``epoch`` are done."""

    epoch: int = 0
    position: int = 0


class DistributedBucketSampler:
    """Rank ``r`` of ``W`` takes global batches ``r::W``; the global list is truncated to a multiple of W.

    Truncation keeps every rank doing the same number of micro-batches (collectives would hang otherwise).
    ``grad_accum`` also drops the trailing micro-batches that would not fill an optimizer step.
    """

    def __init__(
        self,
        indices: Sequence[int],
        lengths: Sequence[int],
        *,
        tokens_per_batch: int,
        max_samples: int,
        mega_batch_samples: int,
        seed: int,
        rank: int,
        world_size: int,
        grad_accum: int = 1,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.indices = list(indices)
        self.lengths = lengths
        self.tokens_per_batch = tokens_per_batch
        self.max_samples = max_samples
        self.mega_batch_samples = mega_batch_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.shuffle = shuffle
        self._cache: dict[int, list[list[int]]] = {}

    def global_batches(self, epoch: int) -> list[list[int]]:
        batches = length_bucketed_batches(
            self.indices,
            self.lengths,
            tokens_per_batch=self.tokens_per_batch,
            max_samples=self.max_samples,
            mega_batch_samples=self.mega_batch_samples,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
        )
        per_rank = len(batches) // self.world_size
        per_rank -= per_rank % self.grad_accum
        return batches[: per_rank * self.world_size]

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches for ``epoch`` (cached: the list is reused by resume and len)."""
        if epoch not in self._cache:
            self._cache = {epoch: self.global_batches(epoch)[self.rank :: self.world_size]}
        return self._cache[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.rank_batches(epoch)) // self.grad_accum

    def remaining(self, state: SamplerState) -> list[list[int]]:
        """The micro-batches of ``state.epoch`` not yet done: what the training loop runs next (also on resume)."""
        return self.rank_batches(state.epoch)[state.position :]

    def check_trainable(self, where: str) -> None:
        """Refuse data that gives this rank no optimizer step (the loop would spin over empty epochs)."""
        if self.steps_in_epoch(0) == 0:
            raise ValueError(
                f"{where}: {len(self.indices)} training samples give no optimizer step for {self.world_size} "
                f"rank(s) x grad_accum {self.grad_accum}; lower tokens_per_batch/micro_batch_size or add data"
            )


# ----------------------------------------------------------------------------- tensors


class FeatureDataset(Dataset):
    """Map-style view of a DatasetReader so a DataLoader (and its workers) can fetch samples."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> Any:
        return self.reader.get(int(i))
