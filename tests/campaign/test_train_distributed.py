"""Two CPU ranks under `accelerate launch` + DeepSpeed ZeRO-2 over gloo (slow: real processes).

The first DeepSpeed init on a machine JIT-compiles its shm_comm op (~60 s, cached in
TORCH_EXTENSIONS_DIR / ~/.cache/torch_extensions); later launches take ~10-20 s each.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers_paths import ROOT
from helpers_train import base_args, make_dataset, make_target, read_metrics
from safetensors.torch import load_file

from redraft.core.dataset.reader import DatasetReader
from train.data import DistributedBucketSampler, split_by_id


def launch(args: list[str], log: Path, processes: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "REDRAFT_NO_PROGRESS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           "configs/accelerate/cpu-2proc-zero2.yaml", "--num_processes", str(processes), "train/main.py", *args]
    with open(log, "w") as f:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    assert res.returncode == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_dist")
    target, vocab = make_target(root / "target")
    return make_dataset(root / "data", target, vocab), root


def _ids(path: Path, epoch: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [i for r in rows if r["epoch"] == epoch for i in r["ids"]]


def test_two_ranks_split_the_data_and_resume(tiny):
    data, root = tiny
    args = dict(max_steps=6, save_every=3, eval_every=3, log_every=1, keep_last=0)
    straight = root / "straight"
    launch(base_args(data, straight, log_sample_ids=True, **args), root / "straight.log")

    # --- both ranks ran, each on its own half of the train split
    state = json.loads((straight / "step-0000006" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    ids0 = _ids(straight / "sample_ids" / "rank-0.jsonl", 0)
    ids1 = _ids(straight / "sample_ids" / "rank-1.jsonl", 0)
    assert ids0 and ids1 and not set(ids0) & set(ids1)
    reader = DatasetReader(data)
    train, val = split_by_id(reader.sample_ids, 0.15, 8, seed=0)
    expected = DistributedBucketSampler(train, reader.lengths, tokens_per_batch=160, max_samples=0,
                                        mega_batch_samples=512, seed=0, rank=0, world_size=2)
    assert set(ids0) | set(ids1) == {reader.sample_ids[i] for b in expected.global_batches(0) for i in b}
    assert not (set(ids0) | set(ids1)) & {reader.sample_ids[i] for i in val}
    ts = straight / "step-0000006" / "training_state" / "pytorch_model"
    assert {p.name for p in ts.glob("zero_pp_rank_*_optim_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert [r["step"] for r in read_metrics(straight)] == [1, 2, 3, 4, 5, 6]

    # --- stop at step 3, resume to 6: same weights as the straight run
    resumed = root / "resumed"
    launch(base_args(data, resumed, stop_at_step=3, **args), root / "first_half.log")
    assert (resumed / "latest").read_text().strip() == "step-0000003"
    launch(base_args(data, resumed, resume="auto", **args), root / "second_half.log")
    a = load_file(str(straight / "step-0000006" / "model.safetensors"))
    b = load_file(str(resumed / "step-0000006" / "model.safetensors"))
    assert set(a) == set(b)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst == 0.0, f"max |diff| after resume: {worst}"
    la = [r["loss"] for r in read_metrics(straight)]
    lb = [r["loss"] for r in read_metrics(resumed)]
    assert la == lb
    assert torch.isfinite(torch.tensor(la)).all()

    # --- SIGKILL the launcher and both ranks while step 6's checkpoint is being written;
    #     --resume auto redoes 4..6
    killed = root / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "REDRAFT_NO_PROGRESS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           "configs/accelerate/cpu-2proc-zero2.yaml", "--num_processes", "2", "train/main.py",
           *base_args(data, killed, **args)]
    with open(root / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 600
        while not (killed / ".tmp-step-0000006").exists():
            assert proc.poll() is None, "the run ended before its last checkpoint began"
            assert time.monotonic() < deadline, "no checkpoint write within 600 s"
            time.sleep(0.01)
        # SIGKILL the launcher and every rank at once (the ranks need not share its process group)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(tree, timeout=60)
        proc.wait()
    assert (killed / "latest").read_text().strip() == "step-0000003"
    assert not (killed / "step-0000006").exists()
    launch(base_args(data, killed, resume="auto", **args), root / "after_kill.log")
    c = load_file(str(killed / "step-0000006" / "model.safetensors"))
    worst = max((a[k].double() - c[k].double()).abs().max().item() for k in a)
    assert worst == 0.0, f"max |diff| after SIGKILL + resume: {worst}"


def _trained_ids(out: Path) -> list[str]:
    """Every sample id trained in epoch 0, over all ranks and all launches of the run (duplicates kept)."""
    return sorted(i for f in (out / "sample_ids").glob("rank-*.jsonl") for i in _ids(f, 0))


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_a_run_resumes_on_another_number_of_processes(tiny, before, after):
    """Elastic resume, both ways, under DeepSpeed ZeRO-2: saved at step 3 on ``before`` processes, resumed to 6 on
    ``after``. Every step keeps its micro-batches (grad_accum follows: 2 x 1 = 1 x 2), so the run trains each
    sample once, as the run that was not interrupted does, and ends at the same weights up to the order of the
    gradient reduction; the optimizer state came through DeepSpeed's universal checkpoint."""
    data, root = tiny
    accum = {2: 1, 1: 2}
    args = dict(max_steps=6, save_every=3, log_every=1, keep_last=0, log_sample_ids=True)
    straight, elastic = root / f"straight-{before}", root / f"elastic-{before}to{after}"
    launch(base_args(data, straight, grad_accum=accum[before], **args), root / f"{straight.name}.log", before)
    launch(base_args(data, elastic, grad_accum=accum[before], stop_at_step=3, **args), root / "e1.log", before)
    # the same command on another number of processes; its grad_accum comes from the checkpoint
    launch(base_args(data, elastic, grad_accum=accum[before], resume="auto", **args), root / "e2.log", after)
    log_text = (root / "e2.log").read_text()
    assert f"grad_accum {accum[after]}" in log_text and "universal" in log_text, log_text[-3000:]
    assert (elastic / "step-0000003" / "training_state.universal").is_dir()
    state = json.loads((elastic / "step-0000006" / "trainer_state.json").read_text())
    assert state["world_size"] == after and state["micro_batches_per_step"] == 2
    assert _trained_ids(elastic) == _trained_ids(straight)  # none lost, none twice
    a = load_file(str(straight / "step-0000006" / "model.safetensors"))
    b = load_file(str(elastic / "step-0000006" / "model.safetensors"))
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    scale = max(a[k].double().abs().max().item() for k in a)
    print(f"elastic {before}->{after}: max |diff| {worst:.2e} (largest weight {scale:.2e})")
    assert worst <= 1e-5, f"max |diff| after an elastic resume: {worst}"
    la, lb = [r["loss"] for r in read_metrics(straight)], [r["loss"] for r in read_metrics(elastic)]
    assert len(la) == len(lb) == 6 and la[:3] == lb[:3]
    assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) <= 1e-4


def test_two_ranks_sharing_each_sample_train_as_one(tiny):
    """sequence_parallel 2 (issue 45): two processes hold half of every micro-batch's rows each, under DeepSpeed
    ZeRO-2 over gloo, and train as one process with the whole micro-batches: the same loss at every step and the
    same weights, up to the order of fp32 sums. Then a resume that asks another sequence_parallel is refused."""
    data, root = tiny
    args = dict(max_steps=4, save_every=4, eval_every=4, log_every=1, keep_last=0)
    one, split = root / "sp-one", root / "sp-two"
    launch(base_args(data, one, **args), root / "sp-one.log", 1)
    launch(base_args(data, split, sequence_parallel=2, log_sample_ids=True, **args), root / "sp-two.log", 2)
    state = json.loads((split / "step-0000004" / "trainer_state.json").read_text())
    assert state["world_size"] == 1 and state["sequence_parallel"] == 2  # one data-parallel rank of two processes
    assert _ids(split / "sample_ids" / "rank-0.jsonl", 0) == _ids(split / "sample_ids" / "rank-1.jsonl", 0)
    ma, mb = read_metrics(one), read_metrics(split)
    assert [r["tokens"] for r in ma] == [r["tokens"] for r in mb]
    for x, y in zip(ma, mb, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
        assert y["acc"] == pytest.approx(x["acc"], abs=1e-9)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)  # Adam alone would hide a scaled gradient
    va, vb = read_metrics(one, "val"), read_metrics(split, "val")
    assert len(va) == len(vb) == 1 and vb[0]["loss"] == pytest.approx(va[0]["loss"], rel=1e-5)
    a = load_file(str(one / "step-0000004" / "model.safetensors"))
    b = load_file(str(split / "step-0000004" / "model.safetensors"))
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    print(f"sequence parallel 2 vs 1: max |weight diff| {worst:.2e}")
    assert worst <= 1e-5

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}
    res = subprocess.run([sys.executable, "train/main.py", *base_args(data, split, resume="auto", max_steps=6)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "sequence_parallel=2" in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1
