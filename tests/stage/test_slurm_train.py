"""slurm/train.sh outside Slurm for real: two CPU ranks through the script's own launch line, then a resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers_paths import ROOT


def test_train_outside_slurm_really_trains_and_resumes(tmp_path):
    """The local path end to end: two CPU ranks via the script's own launch line, then a rerun resumes."""
    from helpers_train import base_args, make_dataset, make_target

    target, vocab = make_target(tmp_path / "target")
    data = make_dataset(tmp_path / "data", target, vocab, num_samples=32)
    config = tmp_path / "train.yaml"
    config.write_text("seed: 0\n")
    out = tmp_path / "out"
    env = {**os.environ, "CONFIG": str(config), "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline",
           "REDRAFT_NO_PROGRESS": "1", "PYTHON": sys.executable, "GPUS_PER_NODE": "2",
           "ACCEL_CONFIG": "configs/accelerate/cpu-2proc-zero2.yaml",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    for key in [k for k in env if k.startswith("SLURM_") or k == "WORLD_SIZE"]:
        env.pop(key)
    for steps in (2, 4):
        args = base_args(data, out, max_steps=steps, save_every=2, eval_every=0, log_every=1)
        run = subprocess.run(["bash", "slurm/train.sh", *args], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=900)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        assert (out / f"step-{steps:07d}").is_dir()
    state = json.loads((out / "step-0000004" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    assert "resum" in (run.stdout + run.stderr).lower()
