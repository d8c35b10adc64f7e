"""train/main.py with --drafter-attention mla: it learns, checkpoints in the MLA serving layout, warm-starts from an
MLA folder, and refuses a config that mixes the two kinds before any training step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_drafter import MLA_SERVING_KEYS
from helpers_train import base_args, foreign_folder, make_dataset, make_target, read_metrics, run_main
from safetensors.torch import load_file

from eval.export import ExportConfig, export_checkpoint
from redraft.core.drafter.folder import CheckpointError, load_drafter_checkpoint
from train.config import ConfigError, load_config

MLA = dict(drafter_attention="mla", q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_mla")
    target, vocab = make_target(root / "target")
    return make_dataset(root / "data", target, vocab), target


def test_mla_drafter_learns_and_saves_the_mla_layout(tiny, tmp_path):
    data, target = tiny
    out = tmp_path / "run"
    summary = run_main(base_args(data, out, max_steps=50, log_every=10, eval_every=50, **MLA))
    rows = read_metrics(out)
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]
    assert rows[-1]["acc"][0] > 0.9 > rows[0]["acc"][0]
    assert summary["val_acc0"] > 0.9
    ck = out / "step-0000050"
    assert set(load_file(str(ck / "model.safetensors"))) == MLA_SERVING_KEYS
    config = json.loads((ck / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_nope_head_dim"], config["qk_rope_head_dim"],
            config["v_head_dim"], config["num_key_value_heads"]) == (32, 512, 16, 64, 16, 4)
    cfg, _ = load_drafter_checkpoint(ck)
    assert cfg.attention == "mla" and cfg.kv_cache_bytes_per_token() == (512 + 64) * 2
    exported = export_checkpoint(ExportConfig(ckpt=str(ck), out=str(tmp_path / "vllm"), format="vllm"))
    assert json.loads((exported.out / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert "attention mla" in (exported.out / "README.md").read_text()


def test_warm_start_from_an_mla_folder_needs_the_mla_kind(tiny, tmp_path):
    data, _ = tiny
    first = tmp_path / "first"
    run_main(base_args(data, first, max_steps=3, **MLA))
    init = foreign_folder(first / "step-0000003", tmp_path / "eagle3-mla")
    run_main(base_args(data, tmp_path / "second", max_steps=1, lr=0.0, init_from=init, **MLA))
    old, new = load_file(str(init / "model.safetensors")), load_file(str(tmp_path / "second/step-0000001/model.safetensors"))
    assert set(new) == set(old) and all((old[k] == new[k]).all() for k in old)
    with pytest.raises(CheckpointError, match=r"attention: .* has 'mla', the data/config needs 'gqa' \(set "
                                              r"drafter_attention: mla"):
        run_main(base_args(data, tmp_path / "x", init_from=init))


@pytest.mark.parametrize(("extra", "pattern"), [
    (["--kv_lora_rank", "512"], "kv_lora_rank=512 is an MLA size but drafter_attention is gqa"),
    (["--drafter-attention", "mla", "--head_dim", "64"], "head_dim=64 is a GQA size but drafter_attention is mla"),
    (["--drafter-attention", "mla", "--num_key_value_heads", "2"], "num_key_value_heads=2 is a GQA size"),
    (["--drafter-attention", "flash"], "argument --drafter-attention: invalid choice: 'flash'"),
    pytest.param(["--attention-impl", "flex"], "attention_impl=flex: FlexAttention trains on CUDA only",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="refused where there is no CUDA")),
])
def test_mixed_kinds_are_refused_before_training(extra, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["--data", "d", "--out", "o", *extra])


def test_unservable_mla_sizes_are_refused_before_the_first_step(tiny, tmp_path):
    data, _ = tiny
    with pytest.raises(ValueError, match="latent of 320 is not served"):
        run_main(base_args(data, tmp_path / "x", kv_lora_rank=256, **MLA))
    assert not list((tmp_path / "x").glob("step-*")) if (tmp_path / "x").exists() else True


def _published_style_folder(src: Path, dst: Path) -> Path:
    """An eagle3-mla folder as published for Kimi-K2.5: SGLang's layers.0. names, model_type kimi_k2, head_dim 128,
    legacy rope keys only, a full draft vocabulary without d2t/t2d."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    state = load_file(str(src / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in state.items() if k not in ("d2t", "t2d")},
              str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    for key in ("rope_parameters", "rope_interleave", "draft_vocab_size"):
        config.pop(key, None)
    config.update(model_type="kimi_k2", head_dim=128)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_warm_start_from_a_published_style_eagle3_mla_folder(tiny, tmp_path):
    data, target = tiny
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    first = tmp_path / "first"
    run_main(base_args(data, first, max_steps=2, draft_vocab_size=vocab, **MLA))
    published = _published_style_folder(first / "step-0000002", tmp_path / "published")
    cfg, state = load_drafter_checkpoint(published, target_architecture="LlamaForCausalLM", target_num_layers=6)
    assert cfg.attention == "mla" and cfg.head_dim == 16 + 64 and cfg.draft_vocab_size == vocab
    assert int(state["d2t"].abs().sum()) == 0 and bool(state["t2d"].all())  # the engines' identity map
    summary = run_main(base_args(data, tmp_path / "warm", max_steps=2, init_from=published, **MLA))
    assert summary["step"] == 2
    record = json.loads((tmp_path / "warm/step-0000002/redraft.json").read_text())
    assert record["warm_start"]["vocab"] == "rebuild" and record["warm_start"]["draft_vocab_size"] == 64
