"""train/main.py end to end in one CPU process, plus its config, checkpoint and tracking pieces."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_drafter import SERVING_KEYS
from helpers_paths import ROOT
from helpers_train import (
    AUX_IDS,
    base_args,
    foreign_folder,
    make_dataset,
    make_target,
    read_metrics,
    run_main,
)
from safetensors.torch import load_file

from redraft.core.drafter.folder import CheckpointError, load_drafter_checkpoint
from train.checkpoint import find_resume_checkpoint
from train.config import FIELDS, ConfigError, load_config
from train.data import split_by_id
from train.main import cosine_with_warmup
from train.tracking import simulated_acceptance_length


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(dataset folder, target folder, vocab) shared by this module's runs."""
    root = tmp_path_factory.mktemp("train_main")
    target, vocab = make_target(root / "target")
    data = make_dataset(root / "data", target, vocab)
    return data, target, vocab


# ----------------------------------------------------------------------------- config


def test_yaml_and_overrides_are_typed(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("lr: 2.0e-4\nmax_steps: 30\nhidden_size: 576\nbetas: [0.8, 0.9]\nlog_sample_ids: true\n")
    cfg = load_config(y, ["--data", "d", "--out=o", "--max-steps", "7", "--rope_theta", "5e5",
                          "--hidden-size", "none", "--dtype", "fp32", "--log_sample_ids", "--betas", "0.7,0.8"])
    assert cfg.lr == 2e-4 and cfg.max_steps == 7 and cfg.hidden_size is None and cfg.rope_theta == 5e5
    assert cfg.betas == (0.7, 0.8) and cfg.log_sample_ids is True and cfg.dtype == "fp32"
    assert load_config(y, ["--data", "d", "--out", "o"]).betas == (0.8, 0.9)


def test_unknown_keys_and_bad_values_are_refused_by_name(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("lr: 1e-4\nlearning_rate: 3\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(y, ["--data", "d", "--out", "o"])
    with pytest.raises(ConfigError, match="--max-stepz"):
        load_config(None, ["--data", "d", "--out", "o", "--max-stepz", "3"])
    with pytest.raises(ConfigError, match="max_steps"):
        load_config(None, ["--data", "d", "--out", "o", "--max_steps", "three"])
    with pytest.raises(ConfigError, match="dtype"):
        load_config(None, ["--data", "d", "--out", "o", "--dtype", "fp16"])
    with pytest.raises(ConfigError, match="data is required"):
        load_config(None, ["--out", "o"])


def test_shipped_train_configs_load():
    demo = load_config(ROOT / "configs/demo/train.yaml", ["--data", "d", "--out", "o"])
    assert (demo.hidden_size, demo.num_attention_heads, demo.num_key_value_heads, demo.head_dim,
            demo.intermediate_size, demo.dtype) == (576, 9, 3, 64, 768, "fp32")
    kimi = load_config(ROOT / "configs/kimi-k25.yaml", ["--data", "d", "--out", "o"])
    assert (kimi.hidden_size, kimi.num_attention_heads, kimi.num_key_value_heads, kimi.head_dim,
            kimi.intermediate_size, kimi.draft_vocab_size, kimi.lr, kimi.ttt_steps, kimi.max_length,
            kimi.max_position_embeddings, kimi.dtype) == (
        7168, 64, 64, 128, 18432, 32000, 5e-5, 7, 32768, 262144, "bf16")
    mla = load_config(ROOT / "configs/kimi-k25.yaml#train-mla", ["--data", "d", "--out", "o"])
    assert (mla.drafter_attention, mla.hidden_size, mla.num_attention_heads, mla.q_lora_rank, mla.kv_lora_rank,
            mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.intermediate_size) == (
        "mla", 7168, 64, 1536, 512, 128, 64, 128, 18432)  # Kimi-K2.5's text config
    same = [f for f in FIELDS if f not in ("drafter_attention", "num_key_value_heads", "head_dim", "q_lora_rank",
                                          "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    assert {f: getattr(mla, f) for f in same} == {f: getattr(kimi, f) for f in same}  # the rest is train.yaml's


@pytest.mark.parametrize("how", [["train/main.py"], ["-m", "train.main"]])
def test_help_lists_every_option(how):
    env = {**os.environ, "PYTHONPATH": ""}
    res = subprocess.run([sys.executable, *how, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    for name in FIELDS:
        assert f"--{name.replace('_', '-')}" in res.stdout, name


def test_schedule_and_acceptance_length():
    f = cosine_with_warmup(100, 0.1, 0.0)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5) and f(100) == pytest.approx(0.0, abs=1e-12)
    assert simulated_acceptance_length([0.8, 0.5, 0.0]) == pytest.approx(1 + 0.8 + 0.4)
    assert simulated_acceptance_length(torch.ones(7)) == 8.0


# ----------------------------------------------------------------------------- training runs


def test_training_learns_and_logs(tiny, tmp_path):
    data, _, _ = tiny
    out = tmp_path / "run"
    summary = run_main(base_args(data, out, max_steps=50, log_every=10, eval_every=25))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50]
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]
    assert rows[-1]["acc"][0] > 0.9 > rows[0]["acc"][0]
    for key in ("lr", "grad_norm", "tokens_per_s", "accept", "step_loss"):
        assert key in rows[0]
    val = read_metrics(out, "val")
    assert [r["step"] for r in val] == [25, 50]
    assert val[-1]["tau"] == pytest.approx(simulated_acceptance_length(val[-1]["acc"]))
    assert summary["step"] == 50 and summary["val_acc0"] > 0.9


def test_checkpoint_layout_latest_and_rotation(tiny, tmp_path):
    data, _, vocab = tiny
    out = tmp_path / "run"
    run_main(base_args(data, out, max_steps=12, save_every=4, keep_last=2))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step-")) == ["step-0000008", "step-0000012"]
    assert (out / "latest").read_text().strip() == "step-0000012"
    assert not list(out.glob(".tmp-*"))
    ck = out / "step-0000012"
    assert {p.name for p in ck.iterdir()} == {"config.json", "model.safetensors", "redraft.json",
                                              "trainer_state.json", "training_state"}
    weights = load_file(str(ck / "model.safetensors"))
    assert set(weights) == SERVING_KEYS
    assert weights["d2t"].shape == (64,) and weights["t2d"].shape == (vocab,) and int(weights["t2d"].sum()) == 64
    config = json.loads((ck / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True}
    assert (config["hidden_size"], config["draft_vocab_size"], config["vocab_size"]) == (64, 64, vocab)
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"
    record = json.loads((ck / "redraft.json").read_text())
    from redraft.core.dataset.reader import DatasetReader

    ids = DatasetReader(data).sample_ids
    _, val = split_by_id(ids, 0.15, 8, seed=0)
    assert record["val_ids"] == [ids[i] for i in val]
    assert record["dataset"]["tokenizer_hash"] == "t" * 64 and record["train_config"]["max_steps"] == 12
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["world_size"] == 1
    cfg, sd = load_drafter_checkpoint(ck)
    assert cfg.aux_layer_ids == AUX_IDS and cfg.draft_vocab_size == 64
    assert all(torch.equal(sd[k], weights[k]) for k in SERVING_KEYS)
    # the training state holds the same weights (plus the frozen embedding)
    ts = load_file(str(ck / "training_state" / "model.safetensors"))
    assert torch.equal(ts["drafter.fc.weight"], weights["fc.weight"])


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(wa) == set(wb)
    diffs = {k: (wa[k].double() - wb[k].double()).abs().max().item() for k in wa if not torch.equal(wa[k], wb[k])}
    assert not diffs, diffs
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_resume_is_bit_exact_and_ignores_tmp_leftovers(tiny, tmp_path):
    data, _, _ = tiny
    args = dict(max_steps=14, save_every=0, log_every=1)  # 11 steps/epoch: crosses an epoch boundary
    straight = tmp_path / "straight"
    run_main(base_args(data, straight, **args))
    interrupted = tmp_path / "interrupted"
    run_main(base_args(data, interrupted, stop_at_step=6, **args))
    assert (interrupted / "latest").read_text().strip() == "step-0000006"
    assert not (interrupted / "step-0000014").exists()
    # a save that died half way must be ignored by resume (and cleaned up by the next save)
    junk = interrupted / ".tmp-step-0000010"
    (junk / "training_state").mkdir(parents=True)
    (junk / "trainer_state.json").write_text("{}")
    assert find_resume_checkpoint(interrupted, "auto") == interrupted / "step-0000006"
    run_main(base_args(data, interrupted, resume="auto", **args))
    _same_weights(straight / "step-0000014", interrupted / "step-0000014")
    assert not junk.exists()
    a, b = read_metrics(straight), read_metrics(interrupted)
    assert [r["step"] for r in b] == list(range(1, 15))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_resume_auto_without_checkpoint_starts_fresh(tiny, tmp_path):
    data, _, _ = tiny
    summary = run_main(base_args(data, tmp_path / "fresh", max_steps=2, resume="auto"))
    assert summary["step"] == 2


def test_init_from_loads_weights_and_refuses_mismatches(tiny, tmp_path):
    data, _, _ = tiny
    first = tmp_path / "first"
    run_main(base_args(data, first, max_steps=3))
    init = foreign_folder(first / "step-0000003", tmp_path / "sglang_drafter")
    # lr 0: the saved weights are exactly the initial ones; on the same data the rebuilt vocabulary is the old one
    run_main(base_args(data, tmp_path / "second", max_steps=1, lr=0.0, init_from=init))
    _same_weights(init, tmp_path / "second" / "step-0000001")

    bad_ids = foreign_folder(first / "step-0000003", tmp_path / "bad_ids", layer_ids=[1, 3, 4])
    with pytest.raises(CheckpointError, match=r"aux_layer_ids: .* has \[1, 3, 4\], the data/config needs \[1, 2, 4\]"):
        run_main(base_args(data, tmp_path / "x", init_from=bad_ids))
    with pytest.raises(CheckpointError, match="draft_vocab_size: .* has 64, the data/config needs 32"):
        run_main(base_args(data, tmp_path / "x", init_from=init, draft_vocab_size=32, warm_start_vocab="keep"))
    bad_h = foreign_folder(first / "step-0000003", tmp_path / "bad_h", hidden_size=32, target_hidden_size=32)
    with pytest.raises(CheckpointError, match="hidden_size: .* has 32, the data/config needs 64"):
        run_main(base_args(data, tmp_path / "x", init_from=bad_h))
    assert not (tmp_path / "x").exists() or not list((tmp_path / "x").glob("step-*"))


def test_refuses_a_world_size_it_does_not_see(tiny, tmp_path, monkeypatch):
    data, _, _ = tiny
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2"):
        run_main(base_args(data, tmp_path / "x"))


def test_lr_follows_warmup_cosine(tiny, tmp_path):
    data, _, _ = tiny
    out = tmp_path / "lr"
    run_main(base_args(data, out, max_steps=10, log_every=1, warmup_ratio=0.2, lr=1e-3))
    lrs = [r["lr"] for r in read_metrics(out)]
    expect = [1e-3 * cosine_with_warmup(10, 0.2, 0.0)(s) for s in range(10)]
    assert lrs == pytest.approx(expect)
    assert lrs[0] == pytest.approx(5e-4) and max(lrs) == pytest.approx(1e-3) and math.isclose(lrs[-1], lrs[-1])


def test_wandb_offline_run_is_written(tiny, tmp_path, monkeypatch):
    data, _, _ = tiny
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "wb"
    run_main(base_args(data, out, max_steps=2, report_to="wandb", run_name="unit"))
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert read_metrics(out)[-1]["step"] == 2


class _Plugin:
    def __init__(self, ds: dict) -> None:
        self.deepspeed_config = ds


class _Acc:
    """Stand-in for accelerate's Accelerator: only .state.deepspeed_plugin is read."""

    def __init__(self, ds: dict | None) -> None:
        self.state = type("S", (), {"deepspeed_plugin": _Plugin(ds) if ds is not None else None})()


def test_deepspeed_json_is_filled_from_the_train_config_and_contradictions_refused():
    from train.main import configure_deepspeed

    cfg = load_config(None, ["--data", "d", "--out", "o", "--dtype", "fp32", "--grad_accum", "2"])
    ds = json.loads((ROOT / "configs/accelerate/ds-zero2-cpu.json").read_text())
    configure_deepspeed(_Acc(ds), cfg)
    assert (ds["gradient_clipping"], ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"]) == (
        0.5, 2, 1)
    gpu = json.loads((ROOT / "configs/accelerate/ds-zero2-bf16.json").read_text())
    with pytest.raises(ValueError, match="bf16.enabled=True contradicts the train config's dtype=fp32"):
        configure_deepspeed(_Acc(gpu), cfg)
    with pytest.raises(ValueError, match="gradient_clipping=1.0 contradicts"):
        configure_deepspeed(_Acc({"gradient_clipping": 1.0}), cfg)
    with pytest.raises(ValueError, match="stage 3"):
        configure_deepspeed(_Acc({"zero_optimization": {"stage": 3}}), cfg)
    configure_deepspeed(_Acc(None), cfg)  # no DeepSpeed: nothing to do


@pytest.mark.parametrize("name", ["cpu-2proc-zero2", "gpu-8-zero2-bf16", "multinode-zero2-bf16"])
def test_accelerate_configs_point_at_deepspeed_json_without_mixed_precision(name):
    import yaml

    cfg = yaml.safe_load((ROOT / f"configs/accelerate/{name}.yaml").read_text())
    assert cfg["distributed_type"] == "DEEPSPEED" and "mixed_precision" not in cfg
    ds = json.loads((ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]).read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_allow_untested_optimizer"] is True
    assert ds.get("bf16", {}).get("enabled", False) is ("bf16" in name)


def test_a_rank_logs_at_its_own_level_and_tag_through_the_runner():
    """train's command ends through redraft.core.cli.run, which sets logging up before main: a rank's level
    (warnings only off the main process) and its [rankN] tag must still take effect, and rank 0 keeps INFO."""
    code = ("import logging\nfrom redraft.core import cli\nfrom train.main import setup_logging\n"
            "log = logging.getLogger('train.t')\n"
            "def main(rank):\n    setup_logging(rank, rank == 0)\n    log.info('info %d', rank)\n"
            "    log.warning('warn %d', rank)\n"
            "import sys\nsys.exit(cli.run(lambda: main(int(sys.argv[1])), log))\n")
    err = {rank: subprocess.run([sys.executable, "-c", code, str(rank)], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, check=True).stderr for rank in (0, 1)}
    assert "[rank0] train.t INFO: info 0" in err[0] and "[rank0] train.t WARNING: warn 0" in err[0]
    assert "info 1" not in err[1] and "[rank1] train.t WARNING: warn 1" in err[1]
