"""HFTarget on tiny Llama, DeepSeek-V3 (MLA + MoE) and wrapped (text model under language_model) targets."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from extract.backends.base import GenerationConfig, TeacherSpec
from extract.backends.hf import HFTarget, resolve_weight_keys, weight_file_keys
from redraft.catalog.tiny_models import make_tiny_deepseek_v3, make_tiny_llama, make_wrapped_model
from redraft.core import layers

KINDS = TeacherSpec(kinds=("topk", "last_hidden"), topk=6, chunk_tokens=5)
BATCH = [[5, 17, 30, 41, 52, 63, 74, 85, 96], [7, 8, 9, 200, 201], [100, 33, 12, 250, 3, 4, 60]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {
        "llama": make_tiny_llama(root / "llama"),
        "deepseek": make_tiny_deepseek_v3(root / "deepseek"),
        "wrapped": make_wrapped_model(root / "wrapped"),
        "wrapped_deepseek": make_wrapped_model(root / "wrapped_ds", text="deepseek_v3", num_layers=5),
        "tied": make_tiny_llama(root / "tied", num_layers=4, tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def targets(folders):
    return {key: HFTarget(str(path)) for key, path in folders.items()}


def _reference(target: HFTarget, seq: list[int]):
    """The whole CausalLM with output_hidden_states=True: the independent ground truth."""
    with torch.inference_mode():
        out = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    return out.hidden_states, torch.log_softmax(out.logits[0].double(), dim=-1)


@pytest.mark.parametrize("key", ["llama", "deepseek", "wrapped", "wrapped_deepseek", "tied"])
def test_capture_matches_output_hidden_states(targets, key):
    target = targets[key]
    ids = target.info.aux_layer_ids
    caps = target.capture(BATCH, KINDS)
    assert len(caps) == len(BATCH)
    for seq, cap in zip(BATCH, caps, strict=True):
        hs, logp = _reference(target, seq)
        expect = torch.cat([hs[i + 1][0] for i in ids], dim=-1)
        assert cap.aux_hidden.dtype == torch.float32 and cap.aux_hidden.device.type == "cpu"
        assert cap.aux_hidden.shape == (len(seq), len(ids) * target.info.hidden_size)
        torch.testing.assert_close(cap.aux_hidden, expect, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cap.last_hidden, hs[-1][0], atol=1e-4, rtol=1e-4)
        assert cap.topk_ids.shape == (len(seq), KINDS.topk) and cap.topk_ids.dtype == torch.int64
        top = torch.topk(logp, KINDS.topk, dim=-1)
        torch.testing.assert_close(cap.topk_logprobs.double(), top.values, atol=1e-4, rtol=0)
        torch.testing.assert_close(logp.gather(1, cap.topk_ids), cap.topk_logprobs.double(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("key", ["llama", "deepseek", "wrapped_deepseek"])
def test_a_long_sample_captured_in_chunks_equals_one_pass(targets, key):
    """capture_chunk_tokens: a sample longer than the chunk goes through the KV cache chunk by chunk (4 chunks of
    4, the last short, here; MLA and YaRN-free rope in the DeepSeek targets): the same aux states, final states
    and teacher as the whole CausalLM's one pass, and as this backend's one pass; a batch of several samples wider
    than the chunk is captured one sample at a time in the same order."""
    target = targets[key]
    ids = target.info.aux_layer_ids
    long = [int(x) for x in torch.randint(3, 200, (15,), generator=torch.Generator().manual_seed(1))]
    whole = target.capture([long, BATCH[1]], KINDS)
    target.chunk_tokens = 4
    try:
        chunked = target.capture([long, BATCH[1]], KINDS)
    finally:
        target.chunk_tokens = 0
    hs, logp = _reference(target, long)
    torch.testing.assert_close(chunked[0].aux_hidden, torch.cat([hs[i + 1][0] for i in ids], dim=-1), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(chunked[0].last_hidden, hs[-1][0], atol=1e-4, rtol=1e-4)
    for a, b in zip(whole, chunked, strict=True):
        assert a.aux_hidden.shape == b.aux_hidden.shape
        torch.testing.assert_close(b.aux_hidden, a.aux_hidden, atol=1e-5, rtol=1e-5)
        assert torch.equal(b.topk_ids, a.topk_ids)
        torch.testing.assert_close(b.topk_logprobs, a.topk_logprobs, atol=1e-5, rtol=0)


def test_the_last_layer_is_refused_and_the_teacher_state_is_post_norm(targets):
    """Id L-1 cannot be an aux layer (SGLang captures the input of layer i + 1, and the last layer has no next
    one: redraft.core.layers); the last_hidden teacher is the last layer's output after the final norm, HF's
    hidden_states[L]."""
    base = targets["llama"]
    last = base.info.num_layers - 1
    with pytest.raises(ValueError, match=f"layer {last} cannot be captured by SGLang"):
        HFTarget(base.info.path, aux_layer_ids=[0, last])
    cap = base.capture([BATCH[0]], TeacherSpec(kinds=("last_hidden",)))[0]
    hs, _ = _reference(base, BATCH[0])
    torch.testing.assert_close(cap.last_hidden, hs[last + 1][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key", ["llama", "deepseek", "wrapped"])
def test_padding_invariance(targets, key):
    target = targets[key]
    batched = target.capture(BATCH, KINDS)
    for seq, cap in zip(BATCH, batched, strict=True):
        alone = target.capture([seq], KINDS)[0]
        torch.testing.assert_close(cap.aux_hidden, alone.aux_hidden, atol=1e-4, rtol=0)
        torch.testing.assert_close(cap.last_hidden, alone.last_hidden, atol=1e-4, rtol=0)
        torch.testing.assert_close(cap.topk_logprobs, alone.topk_logprobs, atol=1e-4, rtol=0)


def test_teacher_kinds_are_honoured(targets):
    target = targets["llama"]
    only_top = target.capture(BATCH[:1], TeacherSpec(kinds=("topk",), topk=3))[0]
    assert only_top.last_hidden is None and only_top.topk_ids.shape == (len(BATCH[0]), 3)
    only_last = target.capture(BATCH[:1], TeacherSpec(kinds=("last_hidden",)))[0]
    assert only_last.topk_ids is None and only_last.topk_logprobs is None
    assert only_last.last_hidden.shape == (len(BATCH[0]), target.info.hidden_size)


def test_hooks_removed_and_no_full_logits(targets):
    target = targets["llama"]
    before = [dict(layer._forward_hooks) for layer in target.decoder_layers]  # transformers may add its own
    head_calls = []
    handle = target.lm_head.register_forward_hook(lambda *_: head_calls.append(1))
    try:
        target.capture(BATCH, KINDS)
    finally:
        handle.remove()
    assert head_calls == []  # the CausalLM head never ran: the teacher is chunked
    assert [dict(layer._forward_hooks) for layer in target.decoder_layers] == before

    with pytest.raises(IndexError):
        target.capture([[1, 2, target.info.vocab_size + 5]], KINDS)  # embedding lookup fails mid-forward
    assert [dict(layer._forward_hooks) for layer in target.decoder_layers] == before


def test_capture_rejects_empty_sequence(targets):
    assert targets["llama"].capture([], KINDS) == []
    with pytest.raises(ValueError, match="empty sequence at batch index 1"):
        targets["llama"].capture([[1, 2], []], KINDS)


# ---- TargetInfo ----------------------------------------------------------------------------------------


def test_target_info_llama(targets, folders):
    info = targets["llama"].info
    assert info.architecture == info.text_architecture == "LlamaForCausalLM"
    assert info.model_type == "llama"
    assert info.name == str(folders["llama"]) and info.path == str(folders["llama"].resolve())
    assert (info.hidden_size, info.num_layers, info.num_attention_heads, info.num_key_value_heads) == (64, 6, 4, 2)
    assert (info.head_dim, info.intermediate_size, info.max_position_embeddings) == (16, 128, 4096)
    assert info.vocab_size == len(targets["llama"].tokenizer)
    assert info.rms_norm_eps == pytest.approx(1e-5)
    assert info.rope["rope_theta"] == pytest.approx(10000.0)
    assert info.aux_layer_ids == tuple(layers.default_aux_layer_ids(6))
    with open(folders["llama"] / "config.json") as f:
        canon = json.dumps(json.load(f), sort_keys=True, separators=(",", ":"))
    assert info.config_hash == hashlib.sha256(canon.encode()).hexdigest()
    assert (info.embed_key, info.lm_head_key) == ("model.embed_tokens.weight", "lm_head.weight")


def test_target_info_deepseek_and_wrapped(targets):
    ds = targets["deepseek"].info
    assert (ds.architecture, ds.text_architecture, ds.model_type) == (
        "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM", "deepseek_v3",
    )
    assert layers.serving_family(ds.architecture) == "deepseek"
    w = targets["wrapped_deepseek"].info
    assert w.architecture == "TinyVLMForConditionalGeneration"
    assert (w.text_architecture, w.model_type, w.num_layers) == ("DeepseekV3ForCausalLM", "deepseek_v3", 5)
    assert (w.embed_key, w.lm_head_key) == ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight")
    assert targets["wrapped"].info.config_hash != targets["llama"].info.config_hash


def test_custom_aux_ids_and_errors(folders):
    target = HFTarget(str(folders["tied"]), name="tiny", aux_layer_ids=[2, 0])
    assert target.info.aux_layer_ids == (0, 2) and target.info.name == "tiny"
    with pytest.raises(ValueError, match=r"out of range \[0, 4\)"):
        HFTarget(str(folders["tied"]), aux_layer_ids=[1, 4])
    with pytest.raises(FileNotFoundError, match="never downloads"):
        HFTarget(str(folders["tied"] / "missing"))


def test_bf16_target_returns_fp32(folders):
    target = HFTarget(str(folders["tied"]), dtype="bfloat16")
    cap = target.capture([BATCH[1]], KINDS)[0]
    assert cap.aux_hidden.dtype == cap.last_hidden.dtype == cap.topk_logprobs.dtype == torch.float32
    assert torch.isfinite(cap.aux_hidden).all()


# ---- weight keys ---------------------------------------------------------------------------------------


def test_tied_embeddings_resolve_to_embed_key(targets, folders):
    with safe_open(str(folders["tied"] / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # save_pretrained drops the tied copy
    info = targets["tied"].info
    assert info.lm_head_key == info.embed_key == "model.embed_tokens.weight"


def test_key_resolution_layouts(targets, tmp_path):
    cfg = targets["wrapped"].model.config
    assert resolve_weight_keys(cfg, weight_file_keys(targets["wrapped"].info.path)) == (
        "language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
    )
    # transformers 5 VLM layout (Llava/Gemma3): text model under model.language_model, head at the top.
    vlm_keys = {"model.language_model.embed_tokens.weight", "lm_head.weight", "model.vision_tower.x.weight"}
    assert resolve_weight_keys(cfg, vlm_keys) == ("model.language_model.embed_tokens.weight", "lm_head.weight")
    with pytest.raises(ValueError, match="lm_head"):
        resolve_weight_keys(targets["llama"].model.config, {"model.embed_tokens.weight"})
    # Sharded checkpoints are read from the index, not the shards.
    index = {"metadata": {}, "weight_map": {"language_model.model.embed_tokens.weight": "a.safetensors",
                                            "language_model.lm_head.weight": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_file_keys(tmp_path) == set(index["weight_map"])


# ---- generation ----------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 30, 41], [7, 8], [100, 33, 12, 250, 3, 4]]


@pytest.mark.parametrize("key", ["llama", "wrapped"])
def test_greedy_is_deterministic_and_padding_free(targets, key):
    target = targets[key]
    gen = GenerationConfig(temperature=0.0, max_new_tokens=6)
    first = target.generate(PROMPTS, gen, stop_ids=[])
    assert first == target.generate(PROMPTS, gen, stop_ids=[])
    assert all(len(out) == 6 for out in first)
    for prompt, out in zip(PROMPTS, first, strict=True):
        assert target.generate([prompt], gen, stop_ids=[])[0] == out  # left padding changes nothing
        # The first greedy token is the teacher's top-1 after the prompt.
        cap = target.capture([prompt], TeacherSpec(kinds=("topk",), topk=1))[0]
        assert out[0] == int(cap.topk_ids[-1, 0])


def test_sampling_is_seeded(targets):
    target = targets["llama"]
    gen = GenerationConfig(temperature=1.0, top_p=0.95, max_new_tokens=8, seed=3)
    state = torch.random.get_rng_state()
    a = target.generate(PROMPTS, gen, stop_ids=[])
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is left alone
    assert a == target.generate(PROMPTS, gen, stop_ids=[])
    other = target.generate(PROMPTS, GenerationConfig(temperature=1.0, top_p=0.95, max_new_tokens=8, seed=4), [])
    assert other != a


def test_generation_stops_at_stop_ids(targets):
    target = targets["llama"]
    gen = GenerationConfig(temperature=0.0, max_new_tokens=8)
    free = target.generate(PROMPTS, gen, stop_ids=[])
    stop = free[0][2]
    cut = target.generate(PROMPTS, gen, stop_ids=[stop, 99999])
    for full, out in zip(free, cut, strict=True):
        expect = full[: full.index(stop) + 1] if stop in full else full
        assert out == expect
    assert cut[0][-1] == stop and len(cut[0]) <= 3


def test_mla_latent_norms_take_the_configs_eps_as_the_engines_do(tmp_path):
    """transformers' DeepseekV3 fixes q_a/kv_a_layernorm at eps 1e-6; vLLM and SGLang use rms_norm_eps. The hf
    backend follows the engines (at 1e-5 the two computed layer outputs 3e-5 apart on kimi-k25-mini)."""
    folder = make_tiny_deepseek_v3(tmp_path / "ds")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(cfg))
    target = HFTarget(str(folder))
    attn = [layer.self_attn for layer in target.decoder_layers]
    assert all(a.q_a_layernorm.variance_epsilon == 1e-5 and a.kv_a_layernorm.variance_epsilon == 1e-5 for a in attn)
    assert all(layer.input_layernorm.variance_epsilon == 1e-5 for layer in target.decoder_layers)
    # transformers itself still builds them at 1e-6 (if it ever reads the config, this test says so)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert plain.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon == 1e-6  # what transformers does
