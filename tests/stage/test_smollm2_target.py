"""The built-in SmolLM2 target converted from its GGUF for real: a portable HF folder that answers, converted once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import redraft.catalog.builtin as emb
from redraft.catalog.builtin import resolve_target

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from helpers_embedded import smollm2_dir

    return smollm2_dir()


def test_converted_smollm2_folder_is_portable(smollm2):
    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    assert "special_tokens_map.json" not in names
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["rope_theta"] == 100000
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg
    tok_cfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["model_input_names"] == ["input_ids", "attention_mask"]
    assert not list(smollm2.parent.glob(f".{smollm2.name}.tmp-*"))


def test_converted_smollm2_answers_paris(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in text, text


def test_second_resolve_reuses_the_converted_folder(smollm2, monkeypatch):
    monkeypatch.setenv(emb.CACHE_ENV, str(smollm2.parent))
    stamp = (smollm2 / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert resolve_target(SMOLLM2) == smollm2
    assert time.perf_counter() - t0 < 1.0
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == stamp
