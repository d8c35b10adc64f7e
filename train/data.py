"""Train/val split, length-bucketed batches and a resumable, elastic distributed sampler.

Everything here is a pure function of (sample ids, lengths, seed, epoch, rank, world size), so a
resumed run replays exactly the batches an uninterrupted run would have seen, and every rank can
compute the same global batch list without talking to the others.

The order rule, which makes resume elastic: an epoch's global list of micro-batches depends on the
data and the seed only, never on the world size. Where the run stands is one number, the global
micro-batches of the epoch already trained (``SamplerState.position``); the rest of the epoch is dealt
round-robin to however many ranks there are now (rank r of W takes r, r+W, ...), cut to whole optimizer
steps. So a run resumed on another world size trains exactly the micro-batches the saved run had not,
and, with W x grad_accum kept (``train.checkpoint.resume_point``), the same optimizer steps.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from redraft.core.batching import pack_sorted

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
    """Where the data stream is: the first ``position`` global micro-batches of ``epoch`` are trained (all ranks
    together: a micro-batch step of W ranks advances it by W)."""

    epoch: int = 0
    position: int = 0


class DistributedBucketSampler:
    """Rank ``r`` of ``W`` takes global batches ``r::W`` of what is left of the epoch, cut to whole steps.

    The cut keeps every rank doing the same number of micro-batches (collectives would hang otherwise) and
    drops the trailing micro-batches that would not fill an optimizer step of W x ``grad_accum``.
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

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's whole global list of micro-batches: the same for every world size (cached)."""
        if epoch not in self._cache:
            self._cache = {epoch: length_bucketed_batches(
                self.indices, self.lengths, tokens_per_batch=self.tokens_per_batch, max_samples=self.max_samples,
                mega_batch_samples=self.mega_batch_samples, seed=self.seed, epoch=epoch, shuffle=self.shuffle)}
        return self._cache[epoch]

    def _whole_steps(self, batches: list[list[int]]) -> list[list[int]]:
        per_rank = len(batches) // self.world_size
        per_rank -= per_rank % self.grad_accum
        return batches[: per_rank * self.world_size]

    def global_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's micro-batches that a run starting it at this world size trains, in global order."""
        return self._whole_steps(self.epoch_batches(epoch))

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of a whole ``epoch`` started at this world size."""
        return self.remaining(SamplerState(epoch, 0))

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.rank_batches(epoch)) // self.grad_accum

    def remaining(self, state: SamplerState) -> list[list[int]]:
        """This rank's micro-batches of ``state.epoch`` after the first ``state.position`` global ones: what the
        training loop runs next, also on resume at another world size."""
        return self._whole_steps(self.epoch_batches(state.epoch)[state.position:])[self.rank :: self.world_size]

    def check_trainable(self, where: str) -> None:
        """Refuse data that gives this rank no optimizer step (the loop would spin over empty epochs)."""
        if self.steps_in_epoch(0) == 0:
            raise ValueError(
                f"{where}: {len(self.indices)} training samples give no optimizer step for {self.world_size} "
                f"rank(s) x grad_accum {self.grad_accum}; lower tokens_per_batch/micro_batch_size or add data"
            )


# ----------------------------------------------------------------------------- tensors


def stored_loader(dataset: Dataset, batches: list[list[int]], num_workers: int, max_length: int) -> DataLoader:
    """Batches of stored rows (``redraft.core.dataset.stored``), pinned when a GPU will take them, so the trainer's
    ``batch.to(device)`` copies without blocking and decodes on the device."""
    from redraft.core.dataset.stored import collate_stored

    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers,
                      collate_fn=functools.partial(collate_stored, max_length=max_length),
                      pin_memory=torch.cuda.is_available())


class FeatureDataset(Dataset):
    """Map-style view of a DatasetReader so a DataLoader (and its workers) can fetch samples."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> Any:
        return self.reader.get_stored(int(i))  # decoded on the device (redraft.core.dataset.stored)


# ----------------------------------------------------------------------------- the training data, built


@dataclass
class TrainData:
    """What the loop reads (the global order over a finished dataset): the dataset, its split, this rank's
    samplers and the run's length in steps. ``train.stream.StreamData`` offers the same methods."""

    reader: Any  # redraft.core.dataset.reader.DatasetReader
    teacher: str  # "topk" | "last_hidden", resolved from the config's "auto"
    train_idx: list[int]
    val_idx: list[int]
    sampler: DistributedBucketSampler
    val_sampler: DistributedBucketSampler
    total_steps: int
    max_length: int
    num_workers: int

    @property
    def num_samples(self) -> int | None:
        return len(self.reader)

    @property
    def val_ids(self) -> list[str]:
        return [self.reader.sample_ids[i] for i in self.val_idx]

    def chunks(self, state: SamplerState, before_wait: Any = None) -> Iterator[list[list[int]]]:
        """This rank's micro-batches of the rest of ``state.epoch`` (all there: one chunk)."""
        yield self.sampler.remaining(state)

    def loader(self, batches: list[list[int]]) -> DataLoader:
        return stored_loader(FeatureDataset(self.reader), batches, self.num_workers, self.max_length)

    def val_batches(self) -> list[list[int]]:
        return self.val_sampler.rank_batches(0)

    def exhausted(self) -> bool:
        """No further epoch can be read (a stream whose shards are gone); a finished dataset never is."""
        return False

    def saved(self, state: SamplerState, finished: bool = False) -> None:
        """A checkpoint at ``state`` was written (a stream consumes what lies behind it)."""

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def close(self, step: int, finished: bool) -> None:
        """The run is over (a stream tells its extraction to stop)."""

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


def resolve_teacher(cfg: Any, reader: Any) -> str:
    """The config's teacher (auto: top-k when stored) checked against what the data stores."""
    teacher = cfg.teacher
    if teacher == "auto":
        teacher = "topk" if reader.has_topk else "last_hidden"
    if (teacher == "topk" and not reader.has_topk) or (teacher == "last_hidden" and not reader.has_last_hidden):
        raise ValueError(f"teacher={teacher} but {cfg.data} stores teacher {reader.manifest.get('teacher')}")
    return teacher


def build_data(cfg: Any, rank: int, world_size: int) -> TrainData:
    """The run's data over a finished dataset (``cfg``: a TrainConfig), in the global order; ``data_order:
    stream`` (``--stream``: as extraction lands the shards) is ``train.stream.build_stream``'s."""
    from redraft.core.dataset.reader import DatasetReader

    reader = DatasetReader(cfg.data).require_samples()
    teacher = resolve_teacher(cfg, reader)
    lengths = [min(n, cfg.max_length) if cfg.max_length > 0 else n for n in reader.lengths]
    try:
        train_idx, val_idx = split_by_id(reader.sample_ids, cfg.val_fraction, cfg.val_max_samples, cfg.seed)
    except ValueError as e:
        from redraft.core.config import ConfigError

        raise ConfigError(f"val_fraction={cfg.val_fraction}, val_max_samples={cfg.val_max_samples} on "
                          f"{len(reader)} samples: {e}") from None
    batching = dict(tokens_per_batch=cfg.tokens_per_batch, max_samples=cfg.micro_batch_size,
                    mega_batch_samples=cfg.mega_batch_samples, seed=cfg.seed, rank=rank, world_size=world_size)
    sampler = DistributedBucketSampler(train_idx, lengths, grad_accum=cfg.grad_accum, **batching)
    val_sampler = DistributedBucketSampler(val_idx, lengths, shuffle=False, **batching)
    sampler.check_trainable(cfg.data)
    total_steps = cfg.max_steps or sum(sampler.steps_in_epoch(e) for e in range(cfg.num_epochs))
    log.info("data: %d train / %d val samples, %d steps/epoch/rank, %d total steps, teacher %s",
             len(train_idx), len(val_idx), sampler.steps_in_epoch(0), total_steps, teacher)
    return TrainData(reader, teacher, train_idx, val_idx, sampler, val_sampler, total_steps, cfg.max_length,
                     cfg.num_workers)
