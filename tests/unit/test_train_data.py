"""train/data.py: split by id, length buckets, the resumable distributed sampler, collate."""

from __future__ import annotations

import random

import pytest
import torch

from redraft.core.dataset.batch import collate
from train.data import DistributedBucketSampler, SamplerState, length_bucketed_batches, split_by_id

IDS = [f"conv-{i}" for i in range(400)]
LENGTHS = [random.Random(i).randint(5, 300) for i in range(400)]


def _sampler(rank: int = 0, world: int = 1, **kw) -> DistributedBucketSampler:
    args = dict(tokens_per_batch=1024, max_samples=0, mega_batch_samples=64, seed=3, rank=rank, world_size=world)
    args.update(kw)
    return DistributedBucketSampler(list(range(len(LENGTHS))), LENGTHS, **args)


def test_split_is_deterministic_by_id_and_independent_of_order():
    train, val = split_by_id(IDS, 0.1, 1000, seed=0)
    assert sorted(train + val) == list(range(len(IDS)))
    assert 20 <= len(val) <= 60  # ~10% of 400
    shuffled = IDS[::-1]
    train2, val2 = split_by_id(shuffled, 0.1, 1000, seed=0)
    assert {shuffled[i] for i in val2} == {IDS[i] for i in val}
    _, val_other_seed = split_by_id(IDS, 0.1, 1000, seed=1)
    assert set(val_other_seed) != set(val)


def test_split_cap_keeps_a_subset_and_rejects_duplicates():
    _, val = split_by_id(IDS, 0.1, 1000, seed=0)
    _, capped = split_by_id(IDS, 0.1, 5, seed=0)
    assert len(capped) == 5 and set(capped) <= set(val)
    assert split_by_id(IDS, 0.0, 100, seed=0)[1] == []
    with pytest.raises(ValueError, match="conv-1"):
        split_by_id(["conv-1", "conv-2", "conv-1"], 0.1, 10, seed=0)


def test_batches_respect_token_budget_and_cover_every_sample_once():
    batches = length_bucketed_batches(range(400), LENGTHS, tokens_per_batch=1024, max_samples=0,
                                      mega_batch_samples=64, seed=0, epoch=0)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(400))
    for b in batches:
        assert len(b) == 1 or max(LENGTHS[i] for i in b) * len(b) <= 1024
    # sorting within mega-batches keeps padding low: far below a random batching's waste
    padded = sum(max(LENGTHS[i] for i in b) * len(b) for b in batches)
    assert padded < 1.25 * sum(LENGTHS)
    capped = length_bucketed_batches(range(400), LENGTHS, tokens_per_batch=0, max_samples=3,
                                     mega_batch_samples=64, seed=0, epoch=0)
    assert max(len(b) for b in capped) == 3


def test_long_sample_gets_its_own_batch():
    batches = length_bucketed_batches([0, 1, 2], [50, 5000, 60], tokens_per_batch=1000, max_samples=0,
                                      mega_batch_samples=8, seed=0, epoch=0, shuffle=False)
    assert [1] in batches and sorted(i for b in batches for i in b) == [0, 1, 2]


def test_epochs_are_deterministic_and_differ():
    a, b = _sampler(), _sampler()
    assert a.rank_batches(0) == b.rank_batches(0)
    assert a.rank_batches(0) != a.rank_batches(1)
    assert _sampler(seed=4).rank_batches(0) != a.rank_batches(0)


def test_two_ranks_see_disjoint_halves_of_the_same_global_list():
    r0, r1 = _sampler(0, 2), _sampler(1, 2)
    b0, b1 = r0.rank_batches(0), r1.rank_batches(0)
    assert len(b0) == len(b1) > 0
    ids0 = {i for b in b0 for i in b}
    ids1 = {i for b in b1 for i in b}
    assert not ids0 & ids1
    glob = r0.global_batches(0)
    assert ids0 | ids1 == {i for b in glob for i in b}
    # everything but fewer than `world` trailing batches is used
    full = length_bucketed_batches(range(400), LENGTHS, tokens_per_batch=1024, max_samples=0,
                                   mega_batch_samples=64, seed=3, epoch=0)
    assert len(full) - len(glob) < 2


def test_grad_accum_trims_to_whole_steps():
    s = _sampler(0, 2, grad_accum=3)
    assert len(s.rank_batches(0)) % 3 == 0
    assert s.steps_in_epoch(0) == len(s.rank_batches(0)) // 3


def _run(sampler: DistributedBucketSampler, state: SamplerState, n: int) -> list[tuple[int, int, list[int]]]:
    """The training loop's walk over the data (train/main.py Trainer.fit): remaining(state), then the next epoch;
    the position counts global micro-batches (a step of W ranks advances it by W)."""
    out = []
    while len(out) < n:
        for batch in sampler.remaining(state):
            state.position += sampler.world_size
            out.append((state.epoch, state.position, batch))
            if len(out) == n:
                return out
        state.epoch, state.position = state.epoch + 1, 0
    return out


def _ranks(world: int, grad_accum: int, state: SamplerState, steps: int) -> list[list[list[int]]]:
    """``steps`` optimizer steps of every rank of ``world`` from ``state``: per step, the micro-batches trained."""
    per_rank = [_run(_sampler(r, world, grad_accum=grad_accum), SamplerState(state.epoch, state.position),
                     steps * grad_accum) for r in range(world)]
    return [sorted(b for rank in per_rank for _, _, b in rank[k * grad_accum:(k + 1) * grad_accum])
            for k in range(steps)]


@pytest.mark.parametrize("before,after", [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 2), (4, 1))])
def test_a_resume_on_another_world_size_trains_the_same_steps(before, after):
    """The elastic rule: a position saved by W ranks, resumed by W' with W x grad_accum kept, gives the same
    micro-batches in every later step as the run that was not interrupted (across an epoch's end too)."""
    (w0, ga0), (w1, ga1) = before, after
    assert w0 * ga0 == w1 * ga1
    n0 = _sampler(0, w0, grad_accum=ga0).steps_in_epoch(0)
    straight = _ranks(w0, ga0, SamplerState(), n0 + 4)
    for cut in (0, 3, n0 - 1, n0):  # steps trained before the save
        epoch, position = (1, 0) if cut == n0 else (0, cut * w0 * ga0)
        resumed = _ranks(w1, ga1, SamplerState(epoch, position), len(straight) - cut)
        assert resumed == straight[cut:], cut


def test_resume_replays_exactly_across_epochs():
    s = _sampler(1, 2)
    n0 = len(s.rank_batches(0))
    straight = _run(s, SamplerState(), n0 + 5)
    assert straight[n0][0] == 1 and straight[n0][1] == 2  # epoch rolled over: 1 global micro-batch per rank
    for cut in (0, 3, n0 - 1, n0, n0 + 2):
        epoch, pos, _ = straight[cut - 1] if cut else (0, 0, None)  # cut = n0: saved at an epoch's end
        tail = _run(_sampler(1, 2), SamplerState(epoch, pos), len(straight) - cut)
        assert [b for _, _, b in tail] == [b for _, _, b in straight[cut:]]


def test_too_little_data_is_an_error_not_a_hang():
    s = DistributedBucketSampler([0], [10], tokens_per_batch=100, max_samples=0, mega_batch_samples=8,
                                 seed=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="1 training samples give no optimizer step for 2 rank"):
        s.check_trainable("data/")


class _S:
    def __init__(self, sid, n, k=3, h=4, last=False):
        self.sample_id = sid
        self.input_ids = torch.arange(1, n + 1)
        self.loss_mask = torch.ones(n, dtype=torch.bool)
        self.aux_hidden = torch.randn(n, 3 * h)
        self.topk_ids = torch.randint(0, 9, (n, k))
        self.topk_logprobs = torch.randn(n, k)
        self.last_hidden = torch.randn(n, h) if last else None


def test_collate_right_pads_raw_tensors_and_moves_dtype():
    a, b = _S("a", 5), _S("b", 3)
    batch = collate([a, b])
    assert batch.input_ids.shape == (2, 5) and batch.input_ids.dtype == torch.int64
    assert batch.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert batch.loss_mask[1].tolist() == [1, 1, 1, 0, 0]
    assert torch.equal(batch.aux_hidden[1, :3], b.aux_hidden) and batch.aux_hidden[1, 3:].abs().sum() == 0
    assert torch.equal(batch.topk_ids[0], a.topk_ids) and batch.topk_logprobs.shape == (2, 5, 3)
    assert batch.last_hidden is None and batch.sample_ids == ["a", "b"] and batch.num_tokens == 8
    moved = batch.to("cpu", torch.bfloat16)
    assert moved.aux_hidden.dtype == torch.bfloat16 and moved.topk_logprobs.dtype == torch.float32
    assert moved.input_ids.dtype == torch.int64
    cut = collate([a, b], max_length=4)
    assert cut.input_ids.shape == (2, 4) and cut.aux_hidden.shape == (2, 4, 12)


def test_collate_refuses_mixed_teacher_fields():
    with pytest.raises(ValueError, match="'b'"):
        collate([_S("a", 3), _S("b", 3, last=True)])
