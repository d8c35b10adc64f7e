"""Train/val split, length-bucketed batches, a resumable distributed sampler, and padding collate.

Everything here is a pure function of (sample ids, lengths, seed, epoch, rank, world size), so a
resumed run replays exactly the batches an uninterrupted run would have seen, and every rank can
compute the same global batch list without talking to the others.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.data import Dataset

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
        cur: list[int] = []
        cur_max = 0
        for i in mega:
            n = cur_max if cur else 0
            new_max = max(n, int(lengths[i]))
            fits_tokens = tokens_per_batch <= 0 or new_max * (len(cur) + 1) <= tokens_per_batch
            fits_count = max_samples <= 0 or len(cur) < max_samples
            if cur and not (fits_tokens and fits_count):
                batches.append(cur)
                cur, new_max = [], int(lengths[i])
            cur.append(i)
            cur_max = new_max
        if cur:
            batches.append(cur)
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

    def iterate(self, state: SamplerState) -> Iterator[tuple[int, int, list[int]]]:
        """Yield (epoch, position after this batch, batch) forever, starting at ``state``."""
        epoch, position = state.epoch, state.position
        empty_epochs = 0
        while True:
            batches = self.rank_batches(epoch)
            if not batches:
                empty_epochs += 1
                if empty_epochs > 1:
                    raise ValueError(
                        f"no batches for rank {self.rank}/{self.world_size}: {len(self.indices)} samples make "
                        f"fewer than {self.world_size * self.grad_accum} batches (world × grad_accum)"
                    )
            for pos in range(position, len(batches)):
                empty_epochs = 0
                yield epoch, pos + 1, batches[pos]
            epoch, position = epoch + 1, 0


# ----------------------------------------------------------------------------- tensors


class FeatureDataset(Dataset):
    """Map-style view of a DatasetReader so a DataLoader (and its workers) can fetch samples."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> Any:
        return self.reader.get(int(i))


@dataclass
class Batch:
    """RAW right-padded [B, T] tensors (ttt_forward does the alignment shift itself)."""

    input_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # int64 [B, T], 1 = real token
    loss_mask: torch.Tensor  # int64 [B, T]
    aux_hidden: torch.Tensor  # float [B, T, 3H]
    topk_ids: torch.Tensor | None  # int64 [B, T, K]
    topk_logprobs: torch.Tensor | None  # float32 [B, T, K]
    last_hidden: torch.Tensor | None  # float [B, T, H]
    sample_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Batch:
        """Move to ``device``; hidden states take ``dtype``, teacher log-probs stay fp32 for the loss."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                if f.name in ("aux_hidden", "last_hidden"):
                    v = v.to(device=device, dtype=dtype, non_blocking=True)
                else:
                    v = v.to(device=device, non_blocking=True)
            out[f.name] = v
        return Batch(**out)


def _pad(rows: list[torch.Tensor], length: int, value: float = 0) -> torch.Tensor:
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), value)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def _tensor(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t if dtype is None else t.to(dtype)


def collate(samples: list[Any], max_length: int = 0) -> Batch:
    """Right-pad SampleFeatures to the longest (optionally truncated) sample; padding has masks 0."""
    if not samples:
        raise ValueError("collate got an empty batch")
    cut = (lambda t: t[:max_length]) if max_length > 0 else (lambda t: t)
    ids = [cut(_tensor(s.input_ids, torch.int64)) for s in samples]
    T = max(t.shape[0] for t in ids)
    has_topk = samples[0].topk_ids is not None
    has_last = samples[0].last_hidden is not None
    for s in samples:
        if (s.topk_ids is not None) != has_topk or (s.last_hidden is not None) != has_last:
            raise ValueError(f"sample {s.sample_id!r} has different teacher fields than {samples[0].sample_id!r}")
    return Batch(
        input_ids=_pad(ids, T),
        attention_mask=_pad([torch.ones_like(t) for t in ids], T),
        loss_mask=_pad([cut(_tensor(s.loss_mask, torch.int64)) for s in samples], T),
        aux_hidden=_pad([cut(_tensor(s.aux_hidden)) for s in samples], T),
        topk_ids=_pad([cut(_tensor(s.topk_ids, torch.int64)) for s in samples], T) if has_topk else None,
        topk_logprobs=(
_pad([cut(_tensor(s.topk_logprobs, torch.float32)) for s in samples], T) if has_topk else None
        ),
        last_hidden=_pad([cut(_tensor(s.last_hidden)) for s in samples], T) if has_last else None,
        sample_ids=[str(s.sample_id) for s in samples],
    )
