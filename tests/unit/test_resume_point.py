"""train.checkpoint.resume_point: the elastic rule on real trainer_state.json files (the runs: test_train_distributed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redraft.core.drafter.folder import CheckpointError
from train.checkpoint import ORDER_RULE, TRAINER_STATE, TRAINING_STATE, resume_point


def _checkpoint(tmp_path: Path, **state) -> Path:
    folder = tmp_path / "step-0000004"
    (folder / TRAINING_STATE).mkdir(parents=True)
    ts = {"step": 4, "epoch": 0, "position": 8, "world_size": 2, "order_rule": ORDER_RULE,
          "micro_batches_per_step": 2, "tokens_seen": 640, **state}
    (folder / TRAINER_STATE).write_text(json.dumps(ts))
    return folder


@pytest.mark.parametrize("world,accum", [(1, 2), (2, 1)])
def test_the_step_keeps_its_micro_batches_on_any_world_size_that_divides_it(tmp_path, world, accum):
    point = resume_point(_checkpoint(tmp_path), world, grad_accum=1)
    assert (point.grad_accum, point.world_size, point.position, point.step) == (accum, world, 8, 4)
    assert point.elastic == (world != 2) and not point.deepspeed


def test_a_world_size_that_cannot_share_the_step_is_refused_by_name(tmp_path):
    folder = _checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"trainer_state.json: a step of this run is 2 micro-batches .* "
                                              r"3 processes cannot share evenly; resume on one of \[1, 2\]"):
        resume_point(folder, 3, grad_accum=1)


def test_a_checkpoint_from_before_the_global_order_resumes_on_its_own_world_size_only(tmp_path):
    folder = _checkpoint(tmp_path, order_rule=None, micro_batches_per_step=None, position=4)
    assert resume_point(folder, 2, grad_accum=1).position == 8  # its position counted this rank's micro-batches
    with pytest.raises(CheckpointError, match="without elastic resume; resume it on 2 process"):
        resume_point(folder, 1, grad_accum=1)
