"""kimi-k25-mini without building it: the kept values are Kimi-K2.5's, the name and its recipe-keyed folder, the
tokenizer's special ids and the chat template (tests/stage/test_kimi_mini.py uses the built folder)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers_kimi import DEVIATED, EOT, KIMI_K25, KIMI_SPECIALS
from helpers_paths import ROOT

from redraft.catalog.builtin import BUILTIN_TARGETS, KIMI_MINI
from redraft.catalog.kimi_mini import architecture as kimi_arch
from redraft.catalog.kimi_mini import tokenizer as kimi_tok
from redraft.catalog.kimi_mini import training as kimi_train


def test_kept_values_are_kimi_k25s_and_only_sizes_shrink():
    cfg = kimi_arch.text_config()
    shrunk = set(kimi_arch.KIMI_K25_SHRUNK)
    assert "architectures / model_type" in kimi_arch.KIMI_K25_DEVIATIONS and cfg["model_type"] == "deepseek_v3"
    for key, kimi in KIMI_K25.items():
        if key in DEVIATED:
            continue
        if key in shrunk:
            assert kimi_arch.KIMI_K25_SHRUNK[key][0] == kimi, key
            assert cfg[key] < kimi, key
        else:
            assert cfg[key] == kimi, key
    assert shrunk == {"hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok",
                      "q_lora_rank"}
    assert cfg["q_lora_rank"] <= cfg["hidden_size"]  # a low-rank path no wider than the model
    # vLLM CPU's MLA decode kernel supports exactly the latent 512 + 64 = 576
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    # Kimi's active FFN width per token equals its dense width; the miniature keeps the identity
    for c in (KIMI_K25, cfg):
        assert (c["num_experts_per_tok"] + c["n_shared_experts"]) * c["moe_intermediate_size"] == c["intermediate_size"]


def test_name_is_a_builtin_with_a_recipe_keyed_folder(monkeypatch, tmp_path):
    import redraft.catalog.builtin as emb

    assert KIMI_MINI == "kimi-k25-mini" and KIMI_MINI in BUILTIN_TARGETS
    digest = kimi_train.recipe_digest()
    assert BUILTIN_TARGETS[KIMI_MINI].version == digest[:12]
    monkeypatch.setenv(emb.CACHE_ENV, str(tmp_path))
    calls = []

    def fake(spec, out, dtype):
        calls.append(dtype)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setitem(emb._CONVERTERS, KIMI_MINI, fake)
    path = emb.resolve_target(KIMI_MINI)
    assert path == tmp_path / f"{KIMI_MINI}-{digest[:12]}"
    assert emb.resolve_target(KIMI_MINI) == path and calls == ["float32"]


def test_extract_help_lists_every_builtin_target():
    out = subprocess.run([sys.executable, "-m", "extract", "--help"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    for name in BUILTIN_TARGETS:
        assert name in out


@pytest.fixture(scope="module")
def tokenizer():
    return kimi_tok.build_tokenizer()


def test_tokenizer_has_kimis_special_tokens_at_kimis_ids(tokenizer):
    from extract.chat import stop_token_ids

    for token, i in KIMI_SPECIALS.items():
        assert tokenizer.convert_tokens_to_ids(token) == i and kimi_tok.SPECIAL_TOKENS[token] == i
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("[BOS]", "[EOS]", "[PAD]")
    assert stop_token_ids(tokenizer) == [163585, EOT]
    vocab = tokenizer.get_vocab()
    assert len(tokenizer) == 49152 + len(kimi_tok.SPECIAL_TOKENS) and max(vocab.values()) < KIMI_K25["vocab_size"]
    assert not any(t in vocab for t in ("<|im_start|>", "<|endoftext|>"))  # SmolLM2's specials are renamed
    text = "hello there, how are you?"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_renders_kimi_k25_thinking_turns(tokenizer):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "how are you?"},
            {"role": "assistant", "content": "fine", "reasoning_content": "be nice"}]
    assert tokenizer.chat_template == kimi_tok.CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
                    "<|im_user|>user<|im_middle|>hi<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|><think></think>hello<|im_end|>"
                    "<|im_user|>user<|im_middle|>how are you?<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|><think>be nice</think>fine<|im_end|>")
    gen = tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")


def test_test_helper_template_is_the_products():
    from redraft.catalog.tiny_tokenizers import KIMI_K25_TEMPLATE

    assert KIMI_K25_TEMPLATE is kimi_tok.CHAT_TEMPLATE
