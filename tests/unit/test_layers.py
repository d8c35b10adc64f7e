"""The layer-id convention, engine id conversion, and finding model parts in plain and wrapped models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

from extract import model_layout
from redraft.catalog.tiny_models import (
    TinyVLMConfig,
    TinyVLMForConditionalGeneration,
    tiny_deepseek_v3_config,
    tiny_llama_config,
)
from redraft.core import layers
from redraft.core.target_weights import text_config, weight_key_candidates

KIMI = "KimiK25ForConditionalGeneration"


# ---- default and validated ids ----------------------------------------------------------------------------


def test_default_ids_for_real_targets():
    assert layers.default_aux_layer_ids(61) == [1, 29, 57]  # Kimi-K2.5 / DeepSeek-V3
    assert layers.default_aux_layer_ids(30) == [1, 14, 26]  # SmolLM2-135M
    assert layers.default_aux_layer_ids(32) == [1, 15, 28]


@pytest.mark.parametrize("n", range(4, 12))
def test_default_ids_small_models_are_three_distinct_ascending_below_the_last_layer(n):
    ids = layers.default_aux_layer_ids(n)
    assert len(ids) == 3 and ids == sorted(set(ids))
    assert 0 <= ids[0] and ids[-1] < n - 1  # SGLang never returns the last layer's output
    assert layers.validate_aux_layer_ids(ids, n) == ids
    for arch in ("LlamaForCausalLM", KIMI):
        layers.check_servable(ids, arch, n)


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_default_ids_rejects_too_few_layers(n):
    with pytest.raises(ValueError, match="at least 4"):
        layers.default_aux_layer_ids(n)


def test_validate_sorts_and_rejects():
    assert layers.validate_aux_layer_ids([57, 1, 29], 61) == [1, 29, 57]
    with pytest.raises(ValueError, match=r"61.*\[0, 61\)"):
        layers.validate_aux_layer_ids([1, 29, 61], 61)
    with pytest.raises(ValueError, match=r"-1.*\[0, 61\)"):
        layers.validate_aux_layer_ids([-1, 29], 61)
    with pytest.raises(ValueError, match="twice"):
        layers.validate_aux_layer_ids([1, 1, 2], 61)
    with pytest.raises(ValueError, match="at least one"):
        layers.validate_aux_layer_ids([], 61)
    with pytest.raises(ValueError, match="not an int"):
        layers.validate_aux_layer_ids([1.0, 2], 61)


# ---- engine conversion ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "family"),
    [
        (KIMI, "deepseek"),
        ("DeepseekV3ForCausalLM", "deepseek"),
        ("DeepseekV2ForCausalLM", "deepseek"),
        ("KimiK2ForCausalLM", "deepseek"),
        ("LlamaForCausalLM", "llama"),
        ("Qwen3ForCausalLM", "llama"),
        ("", "llama"),
    ],
)
def test_serving_family(arch, family):
    assert layers.serving_family(arch) == family


def test_kimi_k25_engine_ids():
    ours = layers.default_aux_layer_ids(61)
    assert layers.to_engine_layer_ids(ours, "sglang", KIMI) == [1, 29, 57]  # read alike by SGLang 0.5.10 and 0.5.23
    assert layers.to_engine_layer_ids(ours, "vllm", KIMI) == [2, 30, 58]
    # SGLang's deepseek_v2.py reads both spellings as the same capture.
    assert layers.from_engine_layer_ids([2, 30, 58], "sglang", KIMI) == [1, 29, 57]
    assert layers.from_engine_layer_ids([1, 29, 57], "sglang", KIMI) == [1, 29, 57]
    assert layers.from_engine_layer_ids([2, 30, 58], "vllm", KIMI) == [1, 29, 57]


def test_smollm2_like_engine_ids():
    ours = layers.default_aux_layer_ids(30)
    assert layers.to_engine_layer_ids(ours, "sglang", "LlamaForCausalLM") == [1, 14, 26]
    assert layers.to_engine_layer_ids(ours, "vllm", "LlamaForCausalLM") == [2, 15, 27]
    assert layers.from_engine_layer_ids([1, 14, 26], "sglang", "LlamaForCausalLM") == [1, 14, 26]
    assert layers.from_engine_layer_ids([2, 15, 27], "vllm", "LlamaForCausalLM") == [1, 14, 26]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("arch", [KIMI, "DeepseekV3ForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("ids", [[1, 29, 57], [1, 14, 26], [2, 5, 9], [3], [1, 2, 3], [0, 3, 5]])
def test_round_trip(engine, arch, ids):
    engine_ids = layers.to_engine_layer_ids(ids, engine, arch)
    assert layers.from_engine_layer_ids(engine_ids, engine, arch) == ids


def _sglang_capture_points(engine_ids, arch):
    """What SGLang 0.5.23 captures (input-of-layer indices, in layer order) for configured ids, as read from its
    llama.py / deepseek_v2.py ``set_eagle3_layers_to_capture`` (the engine itself holds the same in
    tests/engine/sglang/test_sglang_capture.py)."""
    if layers.serving_family(arch) == "llama" or engine_ids[0] == 1:
        return sorted(i + 1 for i in engine_ids)
    return sorted(engine_ids)


@pytest.mark.parametrize("arch", [KIMI, "LlamaForCausalLM"])
def test_sglang_captures_exactly_our_layers(arch):
    # Our id i must be captured at the input of layer i + 1, layer 0's output included.
    for ids in ([1, 29, 57], [2, 30, 58], [1, 2, 3], [5, 6, 40], [0, 1, 2], [0, 7, 9]):
        engine_ids = layers.to_engine_layer_ids(ids, "sglang", arch)
        assert _sglang_capture_points(engine_ids, arch) == [i + 1 for i in ids]
        if ids[0] == 1 and layers.serving_family(arch) == "deepseek":  # 0.5.10 adds 1 to every id: the same layers
            assert sorted(i + 1 for i in engine_ids) == [i + 1 for i in ids]
    assert layers.to_engine_layer_ids([0, 1, 2], "sglang", KIMI) == [2, 3, 1]  # 1 never first


def test_engine_errors():
    with pytest.raises(ValueError, match="unknown serving engine"):
        layers.to_engine_layer_ids([1, 2, 3], "trtllm", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="embedding"):
        layers.from_engine_layer_ids([0, 3, 5], "vllm", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="embedding"):
        layers.from_engine_layer_ids([0, 3, 5], "sglang", KIMI)


# ---- weight keys ----------------------------------------------------------------------------------------


def test_weight_key_candidates_plain_tied_and_wrapped():
    embed, head = weight_key_candidates(tiny_llama_config(100))
    assert embed[0] == "model.embed_tokens.weight" and head[0] == "lm_head.weight"
    assert "model.embed_tokens.weight" not in head  # untied: never fall back to the embedding

    _, head = weight_key_candidates(tiny_llama_config(100, tie_word_embeddings=True))
    assert head[0] == "lm_head.weight" and "model.embed_tokens.weight" in head

    embed, head = weight_key_candidates(TinyVLMConfig(text_config=tiny_llama_config(100)))
    assert embed[0] == "language_model.model.embed_tokens.weight" and head[0] == "language_model.lm_head.weight"
    assert "model.language_model.embed_tokens.weight" in embed

    kimi_json = {"architectures": [KIMI], "text_config": {"model_type": "kimi_k2", "tie_word_embeddings": False}}
    embed, head = weight_key_candidates(kimi_json)
    assert embed[0] == "language_model.model.embed_tokens.weight" and head[0] == "language_model.lm_head.weight"


# ---- finding parts ----------------------------------------------------------------------------------------


def _llava():
    text = tiny_llama_config(120, num_layers=4, tie_word_embeddings=True)
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=119))


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {
        "llama": AutoModelForCausalLM.from_config(tiny_llama_config(120, num_layers=4)),
        "deepseek": AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(120, num_layers=4)),
        "kimi_like": TinyVLMForConditionalGeneration(TinyVLMConfig(text_config=tiny_llama_config(120, num_layers=5))),
        "llava": _llava(),
    }


@pytest.mark.parametrize(
    ("key", "text_path", "n_layers"),
    [
        ("llama", "model", 4),
        ("deepseek", "model", 4),
        ("kimi_like", "language_model.model", 5),
        ("llava", "model.language_model", 4),
    ],
)
def test_find_parts(models, key, text_path, n_layers):
    model = models[key]
    text = model.get_submodule(text_path)
    assert model_layout.find_text_model(model) is text
    assert model_layout.find_decoder_layers(model) is text.layers and len(text.layers) == n_layers
    head = model_layout.find_lm_head(model)
    assert isinstance(head, torch.nn.Linear) and head.weight.shape == (120, text.config.hidden_size)
    assert text_config(model.config).num_hidden_layers == n_layers


def test_find_lm_head_without_get_output_embeddings(models):
    class Bare(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.language_model = inner

    inner = models["llama"]
    bare = Bare(inner)
    assert model_layout.find_lm_head(bare) is inner.lm_head
    assert model_layout.find_text_model(bare) is inner.model


def test_find_text_model_error_names_the_class():
    with pytest.raises(ValueError, match="Linear"):
        model_layout.find_text_model(torch.nn.Linear(2, 2))


def test_ids_an_engine_cannot_capture_are_refused_before_any_work():
    """SGLang captures the input of layer i + 1, so the last layer's output cannot be asked of it (SGLang refused
    kimi-k25-mini's [1, 2, 3] at start: "--return-aux-hidden-state-layer-ids [4] out of range for a target with 4
    layers"): the extraction (and a drafter config) refuse such ids up front, by layer."""
    layers.check_servable([0, 1, 2], "LlamaForCausalLM", 4)
    layers.check_servable([0, 1, 2], "DeepseekV3ForCausalLM", 4)
    for arch in ("LlamaForCausalLM", KIMI):
        with pytest.raises(ValueError, match=r"aux layer ids \[1, 2, 3\]: layer 3 cannot be captured by SGLang"):
            layers.check_servable([1, 2, 3], arch, 4)
    from helpers_drafter import tiny_config

    with pytest.raises(ValueError, match=r"DrafterConfig.aux layer ids \[1, 2, 7\]: layer 7"):
        tiny_config(aux_layer_ids=[1, 2, 7], target_num_layers=8, target_architecture="DeepseekV3ForCausalLM")


def test_a_four_layer_deepseek_target_gets_ids_every_engine_can_capture():
    ids = layers.default_aux_layer_ids(4, "DeepseekV3ForCausalLM")
    assert ids == layers.default_aux_layer_ids(4) == [0, 1, 2]
    layers.check_servable(ids, "DeepseekV3ForCausalLM", 4)
