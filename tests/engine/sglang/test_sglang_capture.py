"""``--backend sglang``: SGLang 0.5.23's own aux-hidden-state capture equals the HF backend's (issue 33).

SGLang's scheduler, model code and capture run here for real, on the CPU, with redraft's stand-in for its
compiled CPU kernels (``redraft/engines/sglang_cpu``: attention and bookkeeping ops, tested against SGLang's
Triton kernels in tests/engine/sglang/test_sglang_cpu_ops.py). On three targets in fp32 (SmolLM2: Llama, GQA; kimi-k25-mini:
DeepSeek-V3 with MLA, MoE, YaRN, 4 layers; a random 6-layer DeepSeek-V3), every layer SGLang will return is
captured and matched against the HF backend's per-layer output: that settles the layer-id convention by asking
the engine (``redraft.core.layers``), including SGLang's "first id is 1" rule for DeepSeek, asked with raw engine ids.
Then the whole stage (``python -m extract --backend sglang`` with regeneration in the same engine), what is
refused before the engine starts, and what redraft says when the engine dies.

Needs the SGLang CPU venv (``make sglang-cpu-venv``): skipped with the reason without it, a failure in the
SGLang lane (REDRAFT_REQUIRE_SGLANG_CPU=1). About 6 min on 2 cores (seven engine starts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from capture_speed import _row_rel, compare_captures
from helpers_embedded import kimi_mini_dir, sglang_venv_python, smollm2_dir
from sglang_capture import capture_every_layer, sequences

from extract.backends.base import TeacherSpec
from extract.backends.hf import HFTarget
from extract.backends.sglang import SGLangTarget, build_engine_kwargs, read_capture_file
from extract.config import ExtractConfig
from extract.pipeline import run_extraction
from extract.verify import verify_dataset
from redraft.core import layers
from redraft.core.dataset.reader import DatasetReader
from redraft.engines.driver_protocol import EngineError

pytestmark = pytest.mark.uses_kimi_mini  # run after the tier's other files (tests/conftest.py)

# The goals: per layer, median relative difference <= 1e-5 and max <= 1e-3; top-1 equal at >= 99.9%.
MEDIAN_REL, MAX_REL, TOP1 = 1e-5, 1e-3, 0.999
TEACHER = TeacherSpec(kinds=("topk",), topk=8)


def _served_deepseek(root: Path, **kw) -> Path:
    from redraft.catalog.tiny_models import make_served_deepseek_v3

    return make_served_deepseek_v3(root, **kw)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    return {"smollm2": smollm2_dir(), "kimi-k25-mini": kimi_mini_dir(),
            "deepseek-v3-6": _served_deepseek(tmp_path_factory.mktemp("ds6") / "ds6")}


@pytest.fixture(scope="module", params=["smollm2", "kimi-k25-mini", "deepseek-v3-6"])
def captured(request, targets):
    path = targets[request.param]
    hf = HFTarget(str(path))
    seqs = sequences(hf.tokenizer, hf.info.vocab_size)
    got = capture_every_layer(path, seqs, sglang_venv_python())
    return {"name": request.param, "hf": got["hf"], "seqs": seqs, "theirs": got["sglang"], "ref": got["hf_every"]}


def test_every_layer_sglang_returns_is_the_hf_backends_layer(captured):
    """Our id i (output of layer i) = what SGLang returns when asked through redraft.core.layers, for every layer it can
    return: the convention proven by the engine for Llama (SGLang adds 1) and DeepSeek (1 never written first)."""
    hf = captured["hf"]
    n = hf.info.num_layers - 1
    stats = compare_captures(captured["ref"], captured["theirs"], hf.info.hidden_size, n)
    print(captured["name"], json.dumps(stats))
    for k, layer in enumerate(stats["layers"]):
        assert layer["median"] <= MEDIAN_REL and layer["max"] <= MAX_REL, (captured["name"], k, layer)
    assert stats["top1_equal"] >= TOP1, stats
    # log-probs: logits are |hidden| x |lm_head| large, so a 1e-6 relative state difference is ~1e-4 here
    assert stats["topk_logprob_gap"]["median"] <= 1e-4 and stats["topk_logprob_gap"]["max"] <= 1e-2, stats


def test_the_default_aux_layers_are_the_hf_backends(captured):
    """The default ids' slices of the all-layer capture equal a default-id HF capture (what extraction stores)."""
    hf = captured["hf"]
    ours = hf.capture(captured["seqs"], TEACHER)
    h = hf.info.hidden_size
    cols = torch.cat([torch.arange(i * h, (i + 1) * h) for i in hf.info.aux_layer_ids])
    for a, b in zip(ours, captured["theirs"], strict=True):
        assert _row_rel(a.aux_hidden, b.aux_hidden[:, cols]).max().item() <= MAX_REL
        assert a.topk_ids.shape == b.topk_ids.shape and b.aux_hidden.dtype == torch.float32


def test_the_last_layer_is_out_of_reach_and_refused_before_the_engine_starts(targets):
    """SGLang captures the input of layer i + 1: asked for the last layer it refuses (DeepSeek: "out of range")
    or comes back one layer short (Llama). redraft refuses such ids by layer, before any engine starts."""
    path = targets["deepseek-v3-6"]
    with pytest.raises(ValueError, match="layer 5 cannot be captured by SGLang for a 6-layer target"):
        SGLangTarget(str(path), aux_layer_ids=[0, 2, 5], python=sglang_venv_python())


def test_sglang_shifts_deepseek_ids_only_when_the_first_is_1(targets, tmp_path):
    """Asked of the engine with raw ids: on deepseek_v2.py, [1, 2, 3] (first is 1) captures the inputs of layers
    2, 3, 4 (our 1, 2, 3), [2, 3, 1] the inputs of 1, 2, 3 (our 0, 1, 2); from_engine_layer_ids reads both."""
    from redraft.engines.sglang import SGLangEngine

    path = targets["deepseek-v3-6"]
    hf = HFTarget(str(path), aux_layer_ids=[0, 1, 2, 3, 4])
    seq = [list(range(3, 40))]
    every = hf.capture(seq, TEACHER)[0].aux_hidden
    h = hf.info.hidden_size
    arch = hf.info.architecture
    for written in ([1, 2, 3], [2, 3, 1]):
        kw = build_engine_kwargs(str(path), engine_layer_ids=written, architecture=arch, dtype="float32",
                                 max_length=256)
        with SGLangEngine(kw, python=sglang_venv_python(), capture_dir=str(tmp_path), aux_width=3 * h) as engine:
            row = engine.capture(seq, TEACHER.topk)[0]
        got = read_capture_file(row["path"], seq[0]).aux_hidden
        ours = layers.from_engine_layer_ids(written, "sglang", arch)
        want = torch.cat([every[:, i * h:(i + 1) * h] for i in ours], dim=-1)
        assert _row_rel(want, got).max().item() <= MAX_REL, (written, ours)
    assert layers.from_engine_layer_ids([1, 2, 3], "sglang", arch) == [1, 2, 3]
    assert layers.from_engine_layer_ids([2, 3, 1], "sglang", arch) == [0, 1, 2]


# ----------------------------------------------------------------------------------------------- the whole stage


def _cfg(out: Path, backend: str, **kw) -> ExtractConfig:
    base = dict(target=str(smollm2_dir()), data=["mtbench"], out=str(out), max_samples=4, samples_per_shard=2,
                max_length=512, batch_tokens=2048, topk=4, regenerate=True, max_user_turns=1, max_new_tokens=16,
                rank=0, world_size=1, backend=backend, dtype="float32")
    base.update(kw)
    return ExtractConfig(**base).validate()


def test_the_sglang_dataset_verifies_and_matches_hf(tmp_path):
    """extract --backend sglang, regeneration in the same engine: same replies, same (bf16-stored) features."""
    run_extraction(_cfg(tmp_path / "hf", "hf"))
    run_extraction(_cfg(tmp_path / "sglang", "sglang", engine_python=sglang_venv_python(),
                        capture_dir=str(tmp_path / "files")))
    for name in ("hf", "sglang"):
        assert verify_dataset(tmp_path / name, deep=True) == [], name
    manifest = json.loads((tmp_path / "sglang" / "manifest.json").read_text())
    assert manifest["backend"] == "sglang"
    a, b = DatasetReader(tmp_path / "hf"), DatasetReader(tmp_path / "sglang")
    assert len(a) == len(b) == 4 and list(a.sample_ids) == list(b.sample_ids)
    for i in range(len(a)):
        x, y = a.get(i), b.get(i)
        assert torch.equal(x.input_ids, y.input_ids)  # the same replies, greedy, in both engines
        assert torch.equal(x.loss_mask, y.loss_mask)
        # stored as bf16: an fp32 difference of ~1e-6 moves a value across a bf16 rounding edge now and then
        assert _row_rel(x.aux_hidden, y.aux_hidden).max().item() < 1e-2
        assert (x.topk_ids[:, 0] == y.topk_ids[:, 0]).float().mean().item() >= TOP1
    assert not any((tmp_path / "files").glob("*")), "capture files were left behind"


# ----------------------------------------------------------------------------------------------- refusals


def test_a_deepseek_config_without_moe_layer_freq_is_refused_by_key(tmp_path):
    path = _served_deepseek(tmp_path / "no-freq", moe_layer_freq=False)
    with pytest.raises(ValueError, match=r"config.json: no moe_layer_freq; SGLang's deepseek_v2.py reads it"):
        SGLangTarget(str(path), python=sglang_venv_python())


@pytest.mark.parametrize("args, key", [({"attention_backend": "torch_native"}, "attention_backend"),
                                       ({"decode_attention_backend": "triton"}, "decode_attention_backend"),
                                       ({"tp_size": 2}, "tp_size")])
def test_cpu_settings_that_break_capture_or_speculation_are_refused_by_key(args, key):
    from redraft.engines.sglang import cpu_engine_kwargs

    with pytest.raises(ValueError, match=rf"engine_args\['{key}'\]"):
        cpu_engine_kwargs(args)


def test_another_sglang_in_the_venv_is_refused_by_version(tmp_path):
    from redraft.engines.sglang import engine_runtime

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(sglang_venv_python(), venv / "bin" / "python")
    (venv / ".redraft-sglang-cpu").write_text("stamp")
    (venv / "lib" / "python3.11" / "site-packages" / "sglang-0.5.24.dist-info").mkdir(parents=True)
    with pytest.raises(EngineError, match=r"SGLang 0\.5\.24 is installed.*written for SGLang 0\.5\.23 only"):
        engine_runtime(str(venv / "bin" / "python"))


def test_an_engine_that_dies_leaves_redrafts_message_with_its_first_traceback(tmp_path):
    """SGLang kills its parent when a scheduler dies: that parent is the driver, so redraft lives to say what
    failed, quoting the engine log's first traceback (here: a config SGLang's llama.py refuses while its scheduler
    builds the model, "Unsupported activation")."""
    broken = tmp_path / "broken"
    shutil.copytree(smollm2_dir(), broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    with pytest.raises(EngineError) as e:
        SGLangTarget(str(broken), dtype="float32", max_length=256, python=sglang_venv_python())
    text = str(e.value)
    assert "capture (SGLang): loading the model: the engine failed" in text
    assert "Traceback (most recent call last)" in text and "Unsupported activation: relu" in text
