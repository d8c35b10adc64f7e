"""benchmarks/gpu_check.py, the script a lent GPU runs, runs here at tiny shapes: every part, one report."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers_faults import child_env
from helpers_paths import ROOT


def test_gpu_check_runs_every_part_at_tiny_shapes(tmp_path):
    res = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         env=child_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["tiny"] and report["errors"] == {}
    assert report["matmul"]["tflops"] > 0
    for impl in ("eager", "sdpa"):
        assert report["train_step"][impl]["tokens_per_s"] > 0
    eq = report["equality"]
    assert eq["sdpa"]["loss_rel_diff"] < 1e-6 and eq["sdpa"]["grad_max_rel_diff"] < 1e-5
    assert eq["flex"]["loss_rel_diff"] < 1e-6  # forward only on a CPU
    assert report["loader"]["tokens"] > 0 and "cores_per_rank" in report["loader"]
    ran = [c for c in report["long_context"]["cases"] if "seconds" in c]
    assert {(c["impl"], c["activation_checkpointing"]) for c in ran} == {(i, r) for i in ("eager", "sdpa")
                                                                        for r in (False, True)}
    assert all(c["tokens_per_s"] > 0 for c in ran) and len(ran) == 8  # 2 lengths x 2 kernels x 2 settings
    assert (tmp_path / "gpu-check.md").read_text().startswith("# GPU check")
