"""Sequence parallelism (issue 45): two gloo ranks, each holding half of every sample's rows, give one rank's loss
and gradients.

The reference is the plain unroll of the whole batch in one process (no all-to-all, no shard, no halo), run
beside the sharded one on the same weights and batch; the group's loss is the sum of the ranks' shares and its
gradient the sum of theirs (what the trainer's data-parallel mean of loss x size gives). fp32; every parameter's
gradient within 1e-5 of the reference, relative to its largest entry. The batch has a padded sample, a prompt
outside the loss and a length that does not split evenly (the shard pads it), and the last TTT steps of rank 0
are scored against rank 1's teacher rows (the halo).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
CASES = {  # name: (drafter overrides, attention impl, activation checkpointing)
    "gqa-eager": ({}, "eager", False),
    "gqa-sdpa": ({}, "sdpa", False),
    "gqa-eager-checkpointed": ({}, "eager", True),
    "mla-eager": ({"attention": "mla"}, "eager", False),
    "eagle31-gqa-sdpa": ({"method": "eagle3.1"}, "sdpa", False),
}
STEPS = 3
SEQ = 23  # odd: the two ranks hold 12 rows each after padding


def _batch(c, seq: int):
    from redraft.core.dataset.batch import Batch

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, c.vocab_size, (2, seq), generator=g)
    real = torch.ones(2, seq, dtype=torch.int64)
    real[1, seq - 7:] = 0  # right padding
    loss_mask = real.clone()
    loss_mask[:, :5] = 0  # a prompt
    topk = 6
    topk_ids = torch.stack([torch.randperm(c.vocab_size, generator=g)[:topk] for _ in range(2 * seq)]).view(2, seq, topk)
    topk_logprobs = torch.log_softmax(torch.randn(2, seq, topk, generator=g) * 2, -1)
    aux = torch.randn(2, seq, c.num_aux_layers * c.target_hidden_size, generator=g)
    return Batch(input_ids=ids * real, attention_mask=real, loss_mask=loss_mask, aux_hidden=aux, topk_ids=topk_ids,
                 topk_logprobs=topk_logprobs, last_hidden=None, sample_ids=["a", "b"])


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _case(name: str, sp) -> dict:
    import torch.distributed as dist
    from helpers_drafter import tiny_drafter

    from train.ttt import TTTModel

    overrides, impl, recompute = CASES[name]
    heads = {} if overrides.get("attention") == "mla" else {"num_key_value_heads": 2}  # MLA: 4 kv heads
    drafter = tiny_drafter(seed=11, **heads, **overrides)
    drafter.attention_impl = impl
    batch = _batch(drafter.config, SEQ)

    whole = TTTModel(drafter, steps=STEPS, decay=0.8, recompute=recompute)
    out = whole(batch)
    out.loss.backward()
    ref_loss, ref_counts, ref_grads = float(out.loss.detach()), out.step_counts.tolist(), _grads(whole)
    drafter.zero_grad(set_to_none=True)

    split = TTTModel(drafter, steps=STEPS, decay=0.8, recompute=recompute, sequence_parallel=sp)
    out = split(split.shard(batch))
    out.loss.backward()
    loss = sp.all_reduce_sum(out.loss.detach())
    counts = sp.all_reduce_sum(out.step_counts)
    worst = {}
    for n, g in _grads(split).items():
        dist.all_reduce(g, group=sp.group)
        ref = ref_grads[n]
        worst[n] = float((g - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    return {"loss": float(loss), "ref_loss": ref_loss, "counts": counts.tolist(), "ref_counts": ref_counts,
            "grad_rel": worst, "same_grad_names": sorted(worst) == sorted(ref_grads)}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from redraft.core.drafter.sequence_parallel import sequence_groups

    sp = sequence_groups(world=2, size=2, rank=rank)
    results = {name: _case(name, sp) for name in CASES}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sp") / "results.json"
    mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=2, start_method="spawn")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_give_one_ranks_loss_and_gradients(results: dict, name: str) -> None:
    r = results[name]
    print(f"{name}: loss rel {abs(r['loss'] - r['ref_loss']) / abs(r['ref_loss']):.1e}, "
          f"worst gradient rel {max(r['grad_rel'].values()):.1e}")
    assert r["counts"] == r["ref_counts"] and sum(r["ref_counts"]) > 0
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
    assert r["same_grad_names"]
    assert max(r["grad_rel"].values()) <= 1e-5, r["grad_rel"]


def test_the_shard_pads_and_keeps_the_halo() -> None:
    from redraft.core.dataset.batch import Batch

    t = torch.arange(7)[None]
    b = Batch(input_ids=t, attention_mask=torch.ones_like(t), loss_mask=torch.ones_like(t), aux_hidden=t[..., None].float(),
              topk_ids=t[..., None], topk_logprobs=t[..., None].float(), last_hidden=None, sample_ids=["x"])
    first, second = b.sequence_shard(0, 2, halo=3), b.sequence_shard(1, 2, halo=3)
    assert first.shard == (0, 4) and second.shard == (4, 8)
    assert first.input_ids.tolist() == second.input_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]
    assert first.attention_mask.tolist() == [[1] * 7 + [0]]
    assert first.aux_hidden[0, :, 0].tolist() == [0, 1, 2, 3] and second.aux_hidden[0, :, 0].tolist() == [4, 5, 6, 0]
    assert first.topk_ids[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert second.topk_ids[0, :, 0].tolist() == [4, 5, 6, 0, 0, 0, 0]


def test_kv_heads_the_group_cannot_split_are_refused_by_name() -> None:
    from helpers_drafter import tiny_drafter

    from redraft.core.config import ConfigError
    from redraft.core.drafter.sequence_parallel import SequenceParallel

    with pytest.raises(ConfigError, match="sequence_parallel=3 does not divide the drafter's 2 kv heads"):
        tiny_drafter(num_key_value_heads=2).set_sequence_parallel(SequenceParallel(size=3, rank=0))
