"""The training rope as the engines serve it (no engine here: the conformance lane's rope check holds the same
facts against SGLang's and vLLM's own rope modules, tests/engine/loaders/test_rope_engines.py and tests/engine/vllm/test_rope_vllm_cpu.py).

- linear: positions divided by the factor before the frequencies, as both engines' LinearScalingRotaryEmbedding;
- MLA YaRN: always the truncated correction range (neither engine's DeepseekScalingRotaryEmbedding reads truncate);
- original_max_position_embeddings pinned in the DrafterConfig, so an export for a longer context keeps the rope;
- the configs SGLang serves another way are named by key, and eval.export refuses that format.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers_drafter import tiny_config, tiny_drafter, tiny_mla_config

from eval.export import ExportConfig, ExportError, export_checkpoint
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.folder import write_drafter_folder
from redraft.core.drafter.rope import Rope, engine_rope_deviations, rope_tables, yarn_mscale
from redraft.core.drafter.serving_format import serving_config

torch.set_num_threads(1)

RECORD = {"format": "redraft-checkpoint", "step": 1,
          "dataset": {"path": "/nowhere/data", "tokenizer_hash": "t" * 64, "target_config_hash": "h" * 64}}
DSV3 = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _engine_linear_table(theta: float, dim: int, factor: float, n: int) -> torch.Tensor:
    """The engines' LinearScalingRotaryEmbedding cache, written out: t / factor, then t x inv_freq, in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    t = torch.arange(n, dtype=torch.float) / factor
    return torch.einsum("i,j -> ij", t, inv)


@pytest.mark.parametrize("factor", [2.5, 4.0, 6.0])
def test_linear_rounds_the_angle_as_the_engines_do(factor):
    cfg = tiny_config(head_dim=64, rope_scaling={"rope_type": "linear", "factor": factor})
    pos = torch.arange(8192)
    cos, sin = Rope(cfg).cos_sin(pos, torch.float32)
    freqs = _engine_linear_table(cfg.rope_theta, 64, factor, 8192)
    assert torch.equal(cos, torch.cat((freqs.cos(), freqs.cos()), -1))
    assert torch.equal(sin, torch.cat((freqs.sin(), freqs.sin()), -1))
    # transformers' inv_freq / factor rounds the angle another way: measurably so unless factor is a power of 2
    inv = rope_tables(tiny_config(head_dim=64)).inv_freq / factor
    other = (pos.float()[:, None] * inv).cos()
    gap = float((other - freqs.cos()).abs().max())
    assert (gap > 1e-5) if factor != 4.0 else gap == 0.0


def test_mla_yarn_ignores_truncate_as_deepseek_yarn_does():
    on = rope_tables(tiny_mla_config(rope_scaling={**DSV3}))
    off = rope_tables(tiny_mla_config(rope_scaling={**DSV3, "truncate": False}))
    assert torch.equal(on.inv_freq, off.inv_freq)
    # the Llama-style drafter's YaRN (YaRNScalingRotaryEmbedding in both engines) does read it
    g_on = rope_tables(tiny_config(head_dim=64, rope_scaling={**DSV3}))
    g_off = rope_tables(tiny_config(head_dim=64, rope_scaling={**DSV3, "truncate": False}))
    assert not torch.equal(g_on.inv_freq, g_off.inv_freq)


@pytest.mark.parametrize("rope_type", ["yarn", "llama3"])
def test_original_length_is_pinned_so_a_longer_export_keeps_the_rope(rope_type):
    scaling = {"rope_type": rope_type, "factor": 4.0}
    if rope_type == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    cfg = tiny_config(rope_scaling=scaling, max_position_embeddings=4096)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    longer = DrafterConfig.from_dict({**cfg.to_dict(), "max_position_embeddings": 16384})  # what eval.export does
    assert torch.equal(rope_tables(longer).inv_freq, rope_tables(cfg).inv_freq)
    config = serving_config(longer, engine="vllm")
    assert config["max_position_embeddings"] == 16384
    assert config["rope_scaling"]["original_max_position_embeddings"] == 4096
    assert config["rope_parameters"]["original_max_position_embeddings"] == 4096
    assert "original_max_position_embeddings" not in tiny_config(rope_scaling={"rope_type": "linear",
                                                                               "factor": 2.0}).rope_scaling


def test_dynamic_is_named_as_an_sglang_deviation():
    cfg = tiny_config(head_dim=64, rope_theta=1e6, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    dev = engine_rope_deviations(cfg)
    assert set(dev) == {"sglang"}
    served = 1e6 * 3.0 ** (64 / 62)  # DynamicNTKScalingRotaryEmbedding's base at factor x max_position_embeddings
    assert "rope_scaling.rope_type='dynamic'" in dev["sglang"] and f"{served:.6g}" in dev["sglang"]
    assert engine_rope_deviations(tiny_config(rope_scaling={"rope_type": "dynamic", "factor": 1.0})) == {}


NO_MSCALE = {k: v for k, v in DSV3.items() if not k.startswith("mscale")}


@pytest.mark.parametrize(("scaling", "key", "sglang"), [
    ({**NO_MSCALE, "attention_factor": 1.0}, "rope_scaling.attention_factor=1.0", yarn_mscale(40.0)),
    ({**DSV3, "mscale": 0.0}, "rope_scaling.mscale=0.0", 1.0 / yarn_mscale(40.0)),
    ({**DSV3, "mscale": 0.707, "mscale_all_dim": 0.0}, "rope_scaling.mscale=0.707", yarn_mscale(40.0, 0.707)),
])
def test_yarn_magnitudes_sglang_reads_its_own_way_are_named(scaling, key, sglang):
    cfg = tiny_config(head_dim=64, rope_scaling=scaling)
    dev = engine_rope_deviations(cfg)
    assert set(dev) == {"sglang"} and key in dev["sglang"]
    assert f"{sglang:.6g}" in dev["sglang"] and f"{rope_tables(cfg).cos_sin_scale:.6g}" in dev["sglang"]


@pytest.mark.parametrize("scaling", [
    None, DSV3, {**DSV3, "mscale": 0.707, "mscale_all_dim": 0.707}, {**DSV3, "mscale_all_dim": 0.0},
    {**DSV3, "attention_factor": 1.0},  # equal to SGLang's mscale / mscale_all_dim ratio: no difference
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_configs_both_engines_serve_as_trained_have_no_deviation(scaling):
    assert engine_rope_deviations(tiny_config(head_dim=64, rope_scaling=scaling)) == {}
    if scaling is None or scaling["rope_type"] == "yarn":
        assert engine_rope_deviations(tiny_mla_config(rope_scaling=scaling)) == {}


def test_mla_magnitude_and_softmax_follow_deepseek_yarn_with_a_zero_mscale():
    t = rope_tables(tiny_mla_config(rope_scaling={**DSV3, "mscale": 0.0}))
    m = yarn_mscale(40.0, 1.0)
    assert math.isclose(t.cos_sin_scale, 1.0 / m, rel_tol=1e-12)
    assert math.isclose(t.softmax_scale, (8 + 64) ** -0.5 * m * m, rel_tol=1e-12)


def _ckpt(folder, **overrides):
    d = tiny_drafter(seed=0, torch_dtype="float32", **overrides)
    folder.mkdir(parents=True)
    write_drafter_folder(folder, d.config, d.serving_state_dict(), RECORD)


def test_export_refuses_the_engine_that_would_serve_another_rope(tmp_path):
    _ckpt(tmp_path / "ck", head_dim=8, rope_theta=1e6, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ExportError, match=r"--format sglang: rope_scaling.rope_type='dynamic' .*SGLang 0.5.23.*"
                                          r"--format vllm serves it as trained"):
        export_checkpoint(ExportConfig(ckpt=str(tmp_path / "ck"), out=str(tmp_path / "s"), format="sglang"))
    assert not (tmp_path / "s").exists()
    out = export_checkpoint(ExportConfig(ckpt=str(tmp_path / "ck"), out=str(tmp_path / "v"), format="vllm")).out
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "dynamic"
