"""train/main.py with --drafter-method dflash: the block drafter learns the tiny data's cycle, checkpoints in vLLM's
DFlash layout, resumes, is evaluated offline and exported for vLLM (and refused for SGLang)."""

from __future__ import annotations

import json

import pytest
from helpers_train import base_args, make_dataset, make_target, read_metrics, run_main
from safetensors.torch import load_file

from eval.acceptance import main as acceptance_main
from eval.export import ExportConfig, ExportError, export_checkpoint
from redraft.core.drafter.folder import load_drafter_checkpoint

DFLASH = dict(drafter_method="dflash", dflash_layers=2, mask_token_id=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_dflash")
    target, vocab = make_target(root / "target")
    return make_dataset(root / "data", target, vocab), target


def test_dflash_drafter_learns_checkpoints_resumes_and_exports_for_vllm(tiny, tmp_path):
    data, _ = tiny
    out = tmp_path / "run"
    summary = run_main(base_args(data, out, max_steps=40, log_every=10, eval_every=40, save_every=20, **DFLASH))
    rows = read_metrics(out)
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]
    assert rows[-1]["acc"][0] > 0.9 > rows[0]["acc"][0]  # draft 1: the cycle's next token, from the block
    assert summary["val_acc0"] > 0.9
    ck = out / "step-0000040"
    keys = set(load_file(str(ck / "model.safetensors")))
    assert {"layers.1.self_attn.q_norm.weight", "hidden_norm.weight", "fc.weight", "d2t"} <= keys
    assert not any(k.startswith("midlayer.") for k in keys)
    config = json.loads((ck / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4  # ttt_steps 3 + 1
    assert config["dflash_config"]["mask_token_id"] == 3 and config["num_hidden_layers"] == 2
    cfg, _ = load_drafter_checkpoint(ck)
    assert (cfg.method, cfg.num_layers) == ("dflash", 2)
    # resume from the step-20 checkpoint: the run continues the block drafter, not an EAGLE layer
    run_main(base_args(data, out, max_steps=41, resume="auto", **DFLASH))
    assert (out / "step-0000041" / "model.safetensors").is_file()
    report = tmp_path / "acc.json"
    acceptance_main([str(ck), "--data", str(data), "--steps", "3", "--json", str(report), "--split", "all"])
    tau = json.loads(report.read_text())["checkpoints"][str(ck)]["tau"]
    assert tau > 3.0  # a learnt cycle: most of the 3 drafts accepted
    exported = export_checkpoint(ExportConfig(ckpt=str(ck), out=str(tmp_path / "vllm"), format="vllm"))
    assert json.loads((exported.out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    readme = (exported.out / "README.md").read_text()
    assert "# DFlash drafter" in readme and '"method": "dflash"' in readme
    with pytest.raises(ExportError, match="CUDA, NPU and XPU only"):
        export_checkpoint(ExportConfig(ckpt=str(ck), out=str(tmp_path / "sglang"), format="sglang"))
