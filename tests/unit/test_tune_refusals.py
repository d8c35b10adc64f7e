"""redraft.pipeline.tune's refusals before any stage runs (the end-to-end run is tests/engine/vllm/test_tune_vllm.py)."""

from __future__ import annotations

from redraft.pipeline import tune


def test_tune_refuses_two_traffic_sources(tmp_path, caplog):
    rc = tune.cli(["ckpt", "--target", "smollm2-135m-instruct", "--prompts", "mtbench", "--data", "x",
                   "--out", str(tmp_path / "t")])
    assert rc == 2
    assert "--prompts FILE_OR_NAME or as --data DATASET" in caplog.text
    assert not (tmp_path / "t").exists()
