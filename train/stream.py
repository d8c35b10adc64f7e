"""Training on shards as extraction lands them: the stream order, the window reader, what is consumed when.

The order rule (``data_order: stream``, with or without ``--stream``): shards in index order form groups of
``stream_group_shards``; group g's samples are shuffled and length-bucketed together (``length_bucketed_batches``
with a seed of (seed, group), per epoch), cut to whole optimizer steps (W x grad_accum micro-batches, kept
across an elastic resume), and the epoch's global list of micro-batches is the groups' lists one after the
other. The window must hold a group and one more shard. A group's batches depend on its shards only, so the list grows by whole groups as shards land,
and the trainer can run the prefix it has. Ranks are dealt that list as in the global order (``train.data``):
rank r of W takes r, r+W, ... of what is left, in whole optimizer steps; only at the epoch's end is the tail
that does not fill a step dropped. So a run that streams and a run over the finished folder with
``data_order: stream`` train the same micro-batches in the same order, and resume (also on another world size)
works as it does offline.

Rank 0 looks at the folder and broadcasts what has landed, so every rank takes the same decisions. A shard is
trained only when its seal checks (``redraft.core.dataset.window.landed_shard``). After each checkpoint, the groups
whose every micro-batch lies behind the saved position are consumed (deleted unless ``stream_keep``): a run
killed after that never needs them again. When the trainer has to wait for a group with progress not yet
saved, it saves first, so the window it waits on can drain.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from redraft.core.config import ConfigError
from redraft.core.dataset.format import DatasetError, shard_relpath, teacher_kinds
from redraft.core.dataset.liveness import TRAINER, Heartbeat, PeerGone, extraction_check, heartbeat_interval
from redraft.core.dataset.window import (
    HEADER_NAME,
    PLAN_NAME,
    WINDOW_NAME,
    consume,
    is_consumed,
    landed_shard,
    plan_fingerprint,
    read_window,
    window_fit_problem,
)
from train.data import SamplerState, length_bucketed_batches, resolve_teacher, stored_loader

log = logging.getLogger(__name__)

KEY_STRIDE = 1 << 32  # a sample's key: shard * KEY_STRIDE + its row in the shard (stable whoever reads it)


def _broadcast(accelerator: Any, value: Any) -> Any:
    if accelerator is None or accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


@dataclass
class _Group:
    index: int
    shards: list[int]
    reader: Any  # DatasetReader over this group's shards
    batches: list[list[int]]  # keys, this epoch


class WindowDataset(Dataset):
    """Sample by key over the groups the source has open (what the DataLoader reads)."""

    def __init__(self, groups: dict[int, _Group], group_shards: int) -> None:
        self.groups, self.group_shards = groups, group_shards
        self._row0: dict[int, int] = {}
        for g in groups.values():
            start = 0
            for s, hdr in zip(g.shards, g.reader._headers, strict=True):
                self._row0[s] = start
                start += len(hdr.samples)

    def __len__(self) -> int:
        return sum(len(g.reader) for g in self.groups.values())

    def __getitem__(self, key: int) -> Any:
        shard, row = divmod(int(key), KEY_STRIDE)
        return self.groups[shard // self.group_shards].reader.get_stored(self._row0[shard] + row)


@dataclass
class StreamSource:
    """The data of a ``data_order: stream`` run (a finished folder, or one being filled with ``--stream``)."""

    root: Path
    cfg: Any  # TrainConfig
    rank: int
    world_size: int
    accelerator: Any = None
    wait: bool = False  # --stream: shards may still be landing
    header: dict[str, Any] = field(default_factory=dict)
    num_shards: int = 0
    plan: str = ""
    group_sizes: dict[str, list[int]] = field(default_factory=dict)  # epoch -> micro-batches per group
    consumed_upto: int = 0  # groups [0, consumed_upto) are consumed (rank 0)
    _groups: dict[int, _Group] = field(default_factory=dict)
    _epoch: int = -1
    _verified: set[int] = field(default_factory=set)  # shards whose file matched their seal (rank 0)
    _heartbeat: Heartbeat | None = None  # rank 0 of a --stream run: extraction sees the trainer alive
    _extraction: Callable[[], None] | None = None  # rank 0 of a --stream run: raises PeerGone when it is gone

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.wait and self.rank == 0:
            timeout = float(self.cfg.stream_peer_timeout)
            self._heartbeat = Heartbeat(self.root, TRAINER, heartbeat_interval(timeout)).start()
            self._extraction = extraction_check(self.root, timeout)
        if not self.wait:  # a finished dataset: its manifest says everything (plan.json may not exist)
            from redraft.core.dataset.format import load_manifest

            manifest = load_manifest(self.root)
            totals = ("shards", "num_samples", "num_tokens", "num_loss_tokens")  # of the whole set, not a group's
            self.header = {k: v for k, v in manifest.items() if k not in totals}
            self.num_shards = len(manifest["shards"])
            return
        for name in (PLAN_NAME, HEADER_NAME):
            self._wait_for(lambda n=name: self._everyone((self.root / n).is_file), f"{self.root / name} (written by "
                           "extraction before its first shard)")
        self.header = json.loads((self.root / HEADER_NAME).read_text())
        self.num_shards = int(json.loads((self.root / PLAN_NAME).read_text())["num_shards"])
        self.plan = plan_fingerprint(self.root)
        self._check_window()

    def _check_window(self) -> None:
        """Refuse a group the extraction's window cannot hold with one more shard (both would wait for ever)."""
        window = read_window(self.root)
        if window is None:  # written by an extraction older than the check
            return
        plan = json.loads((self.root / PLAN_NAME).read_text())
        largest = int(plan.get("largest_shard_bytes") or 0) if plan.get("shard_bytes_exact") else 0
        problem = window_fit_problem(window.get("window_bytes", 0), window.get("window_shards", 0), largest,
                                     self.group_shards)
        if problem:
            raise ConfigError(f"{self.root / WINDOW_NAME} (extraction's window) and this trainer: {problem}")

    # --------------------------------------------------------------------------------------- groups

    @property
    def group_shards(self) -> int:
        return int(self.cfg.stream_group_shards)

    @property
    def num_groups(self) -> int:
        return -(-self.num_shards // self.group_shards)

    def shards_of(self, group: int) -> list[int]:
        return list(range(group * self.group_shards, min((group + 1) * self.group_shards, self.num_shards)))

    def _landed(self, group: int) -> bool:
        """Rank 0's look at the folder, shared with every rank. --stream: every shard sealed, and its file as
        sealed (a corrupt or foreign shard is refused by name, on every rank); a finished folder: the files
        are there. A shard's checksum is read once (rank 0 reads each landed shard in full one time)."""
        ok, error = True, None
        if self.rank == 0:
            try:
                ok = all(self._shard_ok(s) for s in self.shards_of(group))
            except DatasetError as e:
                error = str(e)
        ok, error = _broadcast(self.accelerator, (ok, error))
        if error is not None:
            raise DatasetError(error)
        return bool(ok)

    def _shard_ok(self, shard: int) -> bool:
        if not self.wait:
            return (self.root / shard_relpath(shard)).is_file()
        if shard not in self._verified:
            if landed_shard(self.root, shard, self.plan) is None:
                if is_consumed(self.root, shard):
                    raise DatasetError(
                        f"{self.root}: shard {shard} (group {shard // self.group_shards}) was consumed by an earlier "
                        f"train/main.py --stream on this folder (its seal is in consumed/), so it will never land "
                        "again: continue that run with --resume auto and its --out, or extract into a new folder")
                return False
            self._verified.add(shard)
        return True

    def _everyone(self, look: Callable[[], Any]) -> Any:
        """Rank 0's ``look()``, on every rank (the ranks wait in step, whatever each would see itself)."""
        return _broadcast(self.accelerator, look() if self.rank == 0 else None)

    def _check_extraction(self) -> None:
        """Raise PeerGone on every rank when rank 0 sees that extraction ended early or stopped beating."""
        gone = None
        if self._extraction is not None:
            try:
                self._extraction()
            except PeerGone as e:
                gone = (str(e), e.exit_code)
        gone = _broadcast(self.accelerator, gone)
        if gone is not None:
            raise PeerGone(*gone)

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()`` (the same answer on every rank), looking at extraction's end state and heartbeat
        between polls: a trainer waiting here has saved its progress (``before_wait``), so stopping loses nothing."""
        start = time.perf_counter()
        last = start - 15.0  # the first wait is reported at once, then every 15 s
        while not ready():
            if not self.wait:
                raise DatasetError(f"{what}: not there (data_order=stream reads a finished folder unless --stream)")
            self._check_extraction()
            now = time.perf_counter()
            if now - last >= 15.0:
                log.info("waiting for %s (%.0f s so far)", what, now - start)
                last = now
            time.sleep(self.cfg.stream_poll_s)

    def _open(self, group: int, epoch: int) -> _Group:
        from redraft.core.dataset.reader import DatasetReader

        shards = self.shards_of(group)
        manifest = {**self.header, "shards": [{"path": shard_relpath(s)} for s in shards]}
        reader = DatasetReader(self.root, manifest=manifest)
        keys, lengths = [], {}
        for s, hdr in zip(shards, reader._headers, strict=True):
            for j, sample in enumerate(hdr.samples):
                key = s * KEY_STRIDE + j
                keys.append(key)
                n = int(sample["num_tokens"])
                lengths[key] = min(n, self.cfg.max_length) if self.cfg.max_length > 0 else n
        batches = length_bucketed_batches(
            keys, lengths, tokens_per_batch=self.cfg.tokens_per_batch, max_samples=self.cfg.micro_batch_size,
            mega_batch_samples=self.cfg.mega_batch_samples, seed=self.cfg.seed * 1_000_003 + group, epoch=epoch)
        # Whole steps per group (fewer than W x grad_accum micro-batches dropped): no step spans two groups, so
        # a group is consumed as soon as its own steps are saved and the window never waits on the next one.
        step = self.world_size * self.cfg.grad_accum
        return _Group(group, shards, reader, batches[: len(batches) // step * step])

    def group(self, group: int, epoch: int, before_wait: Callable[[], None] | None = None) -> _Group:
        """Group ``group`` of ``epoch``, opened once it has landed (waiting for it with --stream, after calling
        ``before_wait`` on every rank)."""
        if self._epoch != epoch:
            self._groups, self._epoch = {}, epoch
        if group not in self._groups:
            if not self._landed(group):
                if before_wait is not None:
                    before_wait()
                self._wait_for(lambda: self._landed(group),
                               f"group {group} of {self.num_groups} (shards {self.shards_of(group)}) in {self.root}")
            self._groups[group] = self._open(group, epoch)
            sizes = self.group_sizes.setdefault(str(epoch), [])
            if len(sizes) == group:
                sizes.append(len(self._groups[group].batches))
        return self._groups[group]

    def first_group_reader(self) -> Any:
        """The reader of group 0 (its token counts build the draft vocabulary; the header is the manifest)."""
        return self.group(0, 0).reader

    # --------------------------------------------------------------------------------------- the order

    def chunks(self, state: SamplerState, before_wait: Callable[[], None]) -> Iterator[list[list[int]]]:
        """This rank's micro-batches of ``state.epoch`` after the first ``state.position`` global ones, a group at
        a time as groups land; ``before_wait`` runs (on every rank) before the source waits for a group. Groups
        hold whole steps and a position is saved at a step's end, so every chunk is whole steps."""
        epoch, done = state.epoch, state.position
        sizes = self.group_sizes.get(str(epoch), [])
        first, pos = 0, 0  # the first group not yet trained, and the global index of its first micro-batch
        while first < len(sizes) and pos + sizes[first] <= done:  # trained already (perhaps deleted): not reopened
            pos += sizes[first]
            first += 1
        for g in range(first, self.num_groups):
            group = self.group(g, epoch, before_wait)
            batches = group.batches[max(done - pos, 0):]
            pos += len(group.batches)
            if batches:
                yield batches[self.rank :: self.world_size]
            for k in [k for k in self._groups if k < g]:  # this rank is done with them
                del self._groups[k]

    def loader(self, batches: list[list[int]]) -> Any:
        return stored_loader(WindowDataset(dict(self._groups), self.group_shards), batches, self.cfg.num_workers,
                             self.cfg.max_length)

    # --------------------------------------------------------------------------------------- consumption

    def saved(self, state: SamplerState, finished: bool = False) -> None:
        """After a checkpoint at ``state``: consume the groups whose micro-batches are all behind it, every group
        when the stream is ``finished`` (rank 0; only --stream consumes, and only in the first epoch)."""
        if self.rank != 0 or state.epoch != 0 or not self.wait:
            return
        sizes = self.group_sizes.get("0", [])
        end = 0
        for g, n in enumerate(sizes):
            end += n
            if g >= self.consumed_upto and (finished or end <= state.position):
                for s in self.shards_of(g):
                    consume(self.root, s, keep=self.cfg.stream_keep)
                self.consumed_upto = g + 1
                log.info("consumed group %d (shards %s)%s", g, self.shards_of(g),
                         ", kept" if self.cfg.stream_keep else ", deleted")

    def exhausted(self) -> bool:
        """No further epoch to train: --stream deletes the shards once trained (unless stream_keep)."""
        return self.wait and not self.cfg.stream_keep

    def estimated_steps(self) -> int:
        """The schedule's length when max_steps is 0: group 0's micro-batches times the number of groups, in
        whole steps, times num_epochs. Fixed once group 0 has landed, the same for a stream and for the
        finished folder, so both runs follow one schedule."""
        per_group = len(self.group(0, 0).batches)
        return max(per_group * self.num_groups // (self.world_size * self.cfg.grad_accum), 1) * self.cfg.num_epochs

    def close(self, step: int, finished: bool) -> None:
        """The run is over: tell an extraction waiting for room to stop (rank 0, --stream only)."""
        if self.rank == 0 and self.wait:
            from redraft.core.dataset.window import close_stream

            close_stream(self.root, {"step": step, "stream_trained_to_its_end": finished})
            if self._heartbeat is not None:
                self._heartbeat.stop()

    def state_dict(self) -> dict[str, Any]:
        return {"group_sizes": self.group_sizes, "consumed_upto": self.consumed_upto}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.group_sizes = {str(k): [int(n) for n in v] for k, v in state.get("group_sizes", {}).items()}
            self.consumed_upto = int(state.get("consumed_upto", 0))


@dataclass
class StreamData:
    """TrainData's methods for ``data_order: stream`` (train.data.TrainData says what each is for)."""

    source: StreamSource
    reader: Any  # group 0's reader: the header as manifest, its token counts for the draft vocabulary
    teacher: str
    total_steps: int
    num_samples: int | None = None  # not known before the stream ends
    val_ids: list[str] = field(default_factory=list)  # no held-out split: evaluate with eval.acceptance

    def chunks(self, state: SamplerState, before_wait: Callable[[], None]) -> Iterator[list[list[int]]]:
        return self.source.chunks(state, before_wait)

    def loader(self, batches: list[list[int]]) -> Any:
        return self.source.loader(batches)

    def val_batches(self) -> list[list[int]]:
        return []

    def exhausted(self) -> bool:
        return self.source.exhausted()

    def saved(self, state: SamplerState, finished: bool = False) -> None:
        self.source.saved(state, finished)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def close(self, step: int, finished: bool) -> None:
        self.source.close(step, finished)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.source.load_state_dict(state)


@dataclass
class HeaderOnly:
    """What a resumed stream knows of its dataset without group 0 (consumed, perhaps deleted): the header.
    The vocabulary comes from the checkpoint, so no token counts are needed."""

    manifest: dict[str, Any]

    @property
    def has_topk(self) -> bool:
        return "topk" in teacher_kinds(self.manifest.get("teacher"))

    @property
    def has_last_hidden(self) -> bool:
        return "last_hidden" in teacher_kinds(self.manifest.get("teacher"))

    def token_counts(self) -> Any:
        raise RuntimeError("a resumed stream builds no vocabulary (the checkpoint holds it)")


def build_stream(cfg: Any, rank: int, world_size: int, accelerator: Any = None,
                 resumed_total_steps: int | None = None) -> StreamData:
    """The stream of ``cfg.data``. A new run waits (with --stream) for group 0, whose tokens make the draft
    vocabulary and, with max_steps 0, the schedule's length; a resumed run takes both from its checkpoint."""
    source = StreamSource(Path(cfg.data), cfg, rank, world_size, accelerator, wait=bool(cfg.stream))
    if resumed_total_steps is not None:
        reader: Any = HeaderOnly(source.header)
        total = resumed_total_steps
    else:
        reader = source.first_group_reader()
        total = cfg.max_steps or source.estimated_steps()
    teacher = resolve_teacher(cfg, reader)
    log.info("data: stream of %d shards in %d groups of %d from %s%s, %d total steps%s, teacher %s",
             source.num_shards, source.num_groups, source.group_shards, cfg.data,
             " (as they land)" if cfg.stream else "", total, "" if cfg.max_steps else " (estimated from group 0)",
             teacher)
    return StreamData(source, reader, teacher, total)
