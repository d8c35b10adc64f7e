"""`bash slurm/extract.sh` outside Slurm runs the real stage on the embedded SmolLM2 target."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers_paths import ROOT

from extract.verify import verify_dataset
from redraft.core.dataset.reader import DatasetReader


def test_slurm_script_extracts_the_embedded_default(tmp_path):
    out = tmp_path / "ds"
    env = dict(os.environ, PYTHON=sys.executable)
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    run = subprocess.run(
        ["bash", "slurm/extract.sh", "--out", str(out), "--max-samples", "4", "--max-new-tokens", "8",
         "--samples-per-shard", "2", "--hidden-dtype", "fp8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "configs/demo/extract.yaml" in run.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["name"] == "smollm2-135m-instruct"
    assert manifest["num_layers"] == 30 and manifest["hidden_size"] == 576
    assert manifest["aux_layer_ids"] == [1, 14, 26]
    assert manifest["generation"]["max_new_tokens"] == 8
    assert verify_dataset(out) == []
    reader = DatasetReader(out)
    assert len(reader) == manifest["num_samples"] > 0
    sample = reader.get(0)
    assert sample.aux_hidden.shape == (len(sample.input_ids), 3 * 576)
    assert sample.topk_ids.shape[1] == 64
