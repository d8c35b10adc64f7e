"""SGLang adapter: argument building and response parsing in SGLang 0.5.23's shapes, without an engine.

The pure pieces are tested on response dicts shaped like ``sglang/srt/managers/tokenizer_manager.py`` builds
them; SGLang's real engine runs the whole backend in tests/engine/sglang/test_sglang_capture.py (the SGLang lane), which
compares it with the HF backend layer by layer.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch

from extract.backends.base import TeacherSpec
from extract.backends.sglang import (
    LANGUAGE_MODEL_ONLY_ARCHITECTURES,
    build_engine_kwargs,
    check_teacher,
    is_multimodal_config,
    read_target_info,
)
from redraft.engines.request import TokenRequest, sglang_sampling_params
from redraft.engines.sglang_driver import (
    capture_request,
    check_response,
    parse_generate_output,
    spec_counters,
)
from redraft.engines.sglang_driver import parse_capture_output as _parse


def parse_capture_output(output, k, **kw):
    """The driver's parsed tensors, read as attributes (as the backend's Captured)."""
    return types.SimpleNamespace(last_hidden=None, **_parse(output, k, **kw))


# ---------------------------------------------------------------------------------------------------------
# Responses in SGLang's shape
# ---------------------------------------------------------------------------------------------------------


def _row(ids_lps: list[tuple[int, float]]) -> list[tuple]:
    """A top-logprobs row as SGLang returns it in process: (logprob, token_id, text) tuples."""
    return [(lp, i, None) for i, lp in ids_lps]


def _response(n: int, width: int, k: int, *, cached: int = 0, hidden_rows: int | None = None) -> dict:
    """A capture response for an n-token prompt, with teacher row t's top id = 100 + t."""
    rows = [[float(t * width + j) for j in range(width)] for t in range(hidden_rows if hidden_rows is not None else n)]
    teacher = [_row([(100 + t, -0.1), *((200 + t * 10 + j, -1.0 - j) for j in range(k - 1))]) for t in range(n)]
    return {
        "output_ids": [100 + n - 1],
        "meta_info": {
            "prompt_tokens": n,
            "completion_tokens": 1,
            "cached_tokens": cached,
            "finish_reason": {"type": "length", "length": 1},
            "hidden_states": [rows],
            "input_top_logprobs": [None, *teacher[:-1]],  # leading placeholder, last row popped
            "output_top_logprobs": [teacher[-1]],
        },
    }


# ---------------------------------------------------------------------------------------------------------
# Engine arguments
# ---------------------------------------------------------------------------------------------------------


def test_engine_kwargs_turn_on_aux_capture_and_off_everything_that_drops_tokens():
    kw = build_engine_kwargs("/models/t", engine_layer_ids=[1, 14, 26], architecture="LlamaForCausalLM",
                             tp_size=8, ep_size=8, dtype="bfloat16", mem_fraction_static=0.7, max_length=4096)
    assert kw == {
        "model_path": "/models/t", "tp_size": 8, "ep_size": 8, "dtype": "bfloat16", "mem_fraction_static": 0.7,
        "trust_remote_code": False, "enable_return_aux_hidden_states": True, "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": [1, 14, 26], "disable_radix_cache": True,
        "chunked_prefill_size": -1, "enable_two_batch_overlap": False, "skip_tokenizer_init": True,
    }


def test_language_model_only_only_for_multimodal_architectures_sglang_supports():
    base = dict(engine_layer_ids=[2, 30, 58])
    kw = build_engine_kwargs("/m", architecture=LANGUAGE_MODEL_ONLY_ARCHITECTURES[0], multimodal=True, **base)
    assert kw["language_model_only"] is True
    # SGLang 0.5.23 rejects language_model_only for Kimi-K2.5, so it is not set (the encoder just loads).
    kw = build_engine_kwargs("/m", architecture="KimiK25ForConditionalGeneration", multimodal=True, **base)
    assert "language_model_only" not in kw
    kw = build_engine_kwargs("/m", architecture=LANGUAGE_MODEL_ONLY_ARCHITECTURES[0], multimodal=False, **base)
    assert "language_model_only" not in kw
    kw = build_engine_kwargs("/m", architecture="KimiK25ForConditionalGeneration", multimodal=True,
                             language_model_only_architectures=("KimiK25ForConditionalGeneration",), **base)
    assert kw["language_model_only"] is True


def test_kimi_vision_tower_warning_and_the_language_only_way_out(caplog):
    """SGLang 0.5.23 can only skip loading Kimi-K2.5's tower weights through language_only (a user's choice)."""
    base = dict(engine_layer_ids=[2, 30, 58], architecture="KimiK25ForConditionalGeneration", multimodal=True)
    with caplog.at_level("WARNING", logger="extract.backends.sglang"):
        build_engine_kwargs("/m", **base)
    assert "language_only" in caplog.text and "vision encoder is loaded" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="extract.backends.sglang"):
        kw = build_engine_kwargs("/m", engine_kwargs={"language_only": True, "context_length": 8192}, **base)
    assert kw["language_only"] is True and kw["context_length"] == 8192 and "language_model_only" not in kw
    assert "vision encoder" not in caplog.text


def test_engine_kwargs_accept_extras_but_refuse_to_break_capture():
    base = dict(engine_layer_ids=[1, 2, 3], architecture="LlamaForCausalLM", max_length=4096)
    kw = build_engine_kwargs("/m", engine_kwargs={"attention_backend": "fa3", "chunked_prefill_size": 8192}, **base)
    assert kw["attention_backend"] == "fa3" and kw["chunked_prefill_size"] == 8192
    assert build_engine_kwargs("/m", engine_kwargs={"disable_radix_cache": True}, **base)["disable_radix_cache"]
    for bad in ({"disable_radix_cache": False}, {"enable_two_batch_overlap": True},
                {"speculative_draft_model_path": "/d"}, {"return_aux_hidden_state_layer_ids": [5]},
                {"chunked_prefill_size": 2048}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            build_engine_kwargs("/m", engine_kwargs=bad, **base)


def test_multimodal_detection():
    assert is_multimodal_config({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {}})
    assert is_multimodal_config({"vision_config": {}})
    assert not is_multimodal_config({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30})


# ---------------------------------------------------------------------------------------------------------
# Against the real SGLang 0.5.23 (marked `sglang`: skipped where it is not installed, run by the conformance
# lane in its engine venv, where a missing SGLang fails them; see tests/conftest.py)
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------


def test_capture_request_asks_for_prompt_logprobs_and_hidden_states():
    req = capture_request([1, 2, 3], 8)
    assert req == {
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 8,
    }


def test_sampling_params_carry_sampling_and_stops():
    greedy = sglang_sampling_params(TokenRequest("0", [1, 2], 16, stop_token_ids=[2, 7]))
    assert greedy["max_new_tokens"] == 16 and greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0
    assert greedy["stop_token_ids"] == [2, 7] and greedy["no_stop_trim"] and "sampling_seed" not in greedy
    sampled = sglang_sampling_params(TokenRequest("0", [1], 8, temperature=0.7, top_p=0.9, seed=5))
    assert sampled["sampling_seed"] == 5 and sampled["top_p"] == 0.9


def test_spec_counters_read_sglangs_histogram_per_position():
    """SGLang's histogram counts verify rounds by drafts accepted; position j accepted in rounds with > j."""
    meta = {"spec_verify_ct": 5, "spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 15,
            "spec_accept_length": 2.2, "spec_correct_drafts_histogram": [1, 2, 1, 1]}
    c = spec_counters(meta, 3)
    assert (c["num_drafts"], c["num_accepted_tokens"], c["num_draft_tokens"]) == (5, 7, 15)
    assert c["num_accepted_tokens_per_pos"] == [4, 2, 1] and sum(c["num_accepted_tokens_per_pos"]) == 7


def test_only_topk_teacher_is_possible():
    check_teacher(TeacherSpec(kinds=("topk",)))
    for kinds in (("last_hidden",), ("topk", "last_hidden")):
        with pytest.raises(ValueError, match="--backend hf"):
            check_teacher(TeacherSpec(kinds=kinds))


# ---------------------------------------------------------------------------------------------------------
# Response parsing
# ---------------------------------------------------------------------------------------------------------


def test_parse_capture_aligns_teacher_rows_with_positions():
    n, width, k = 5, 6, 3
    cap = parse_capture_output(_response(n, width, k), k, aux_width=width)
    assert cap.aux_hidden.dtype == torch.float32 and cap.aux_hidden.shape == (n, width)
    assert cap.aux_hidden[2, 1].item() == 2 * width + 1
    assert cap.topk_ids.dtype == torch.int64 and cap.topk_ids.shape == (n, k)
    assert cap.topk_logprobs.dtype == torch.float32 and cap.topk_logprobs.shape == (n, k)
    assert cap.topk_ids[:, 0].tolist() == [100 + t for t in range(n)]  # row t = distribution after token t
    assert cap.topk_ids[3].tolist() == [103, 230, 231]
    assert torch.all(cap.topk_logprobs[:, :-1] >= cap.topk_logprobs[:, 1:])
    assert cap.last_hidden is None


def test_parse_capture_sorts_rows_keeps_k_and_reads_json_lists():
    resp = _response(3, 4, 4)
    meta = resp["meta_info"]
    meta["input_top_logprobs"][1] = [[-3.0, 9, "a"], [-0.5, 7, "b"], [-2.0, 8, None], [-4.0, 6, None]]
    cap = parse_capture_output(resp, 2)
    assert cap.topk_ids[0].tolist() == [7, 8]
    assert cap.topk_logprobs[0].tolist() == [-0.5, -2.0]
    assert cap.topk_ids.shape == (3, 2)


def test_parse_capture_single_token_prompt_uses_output_row():
    cap = parse_capture_output(_response(1, 4, 2), 2)
    assert cap.aux_hidden.shape == (1, 4) and cap.topk_ids[0, 0].item() == 100


def test_parse_capture_errors_are_specific():
    resp = _response(4, 6, 3)
    del resp["meta_info"]["hidden_states"]
    with pytest.raises(ValueError, match="enable_return_aux_hidden_states"):
        parse_capture_output(resp, 3)
    with pytest.raises(ValueError, match="need teacher k=5"):
        parse_capture_output(_response(4, 6, 3), 5)
    with pytest.raises(ValueError, match="width 6, expected 18"):
        parse_capture_output(_response(4, 6, 3), 3, aux_width=18)
    resp = _response(4, 6, 3)
    resp["meta_info"]["hidden_states"] = [[0.0] * 6]  # return_hidden_states="last" shape
    with pytest.raises(ValueError, match="last"):
        parse_capture_output(resp, 3)
    resp = _response(4, 6, 3)
    del resp["meta_info"]["output_top_logprobs"]
    with pytest.raises(ValueError, match="logprob_start_len=0"):
        parse_capture_output(resp, 3)


def test_check_response_catches_dropped_tokens():
    check_response(0, [1] * 5, _response(5, 4, 2))
    with pytest.raises(ValueError, match="sample #0.*chunked prefill"):
        check_response(0, [1] * 5, _response(5, 4, 2, hidden_rows=2))
    with pytest.raises(ValueError, match="sample #1.*radix cache"):
        check_response(1, [2] * 3, _response(3, 4, 2, cached=2))
    with pytest.raises(ValueError, match="prompt_tokens=5"):
        check_response(0, [1] * 4, _response(5, 4, 2))
    bad = _response(3, 4, 2)
    bad["meta_info"]["input_top_logprobs"] = bad["meta_info"]["input_top_logprobs"][:2]
    with pytest.raises(ValueError, match="2 input_top_logprobs rows for 3"):
        check_response(0, [1] * 3, bad)


def test_parse_generate_output_ends_with_the_matched_stop():
    stop = {"type": "stop", "matched": 2}
    assert parse_generate_output({"output_ids": [5, 6, 2], "meta_info": {"finish_reason": stop}}) == [5, 6, 2]
    assert parse_generate_output({"output_ids": [5, 6], "meta_info": {"finish_reason": stop}}) == [5, 6, 2]
    length = {"type": "length", "length": 3}
    assert parse_generate_output({"output_ids": [5, 6, 7], "meta_info": {"finish_reason": length}}) == [5, 6, 7]
    by_str = {"type": "stop", "matched": "</s>"}
    assert parse_generate_output({"output_ids": [5], "meta_info": {"finish_reason": by_str}}) == [5]


# ---------------------------------------------------------------------------------------------------------
# Target facts and the missing-SGLang error
# ---------------------------------------------------------------------------------------------------------


def test_no_sglang_anywhere_names_the_make_target(tmp_path, monkeypatch):
    from redraft.engines import sglang as runner

    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("SGLANG_CPU_VENV", str(tmp_path / "none"))
    with pytest.raises(runner.EngineError, match="make sglang-cpu-venv"):
        runner.engine_runtime()
    with pytest.raises(runner.EngineError, match="no such file"):
        runner.engine_runtime(str(tmp_path / "python"))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from redraft.catalog.tiny_models import make_tiny_deepseek_v3, make_tiny_llama, make_wrapped_model

    root = tmp_path_factory.mktemp("sglang-targets")
    return {
        "llama": make_tiny_llama(root / "llama", num_layers=8),
        "llama_tied": make_tiny_llama(root / "llama_tied", num_layers=4, tie_word_embeddings=True),
        "deepseek_v3": make_tiny_deepseek_v3(root / "dsv3", num_layers=6),
        "wrapped": make_wrapped_model(root / "wrapped", num_layers=6, text="deepseek_v3"),
    }


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "deepseek_v3", "wrapped"])
def test_target_info_matches_the_hf_backend(tiny_models, kind):
    from extract.backends.hf import HFTarget

    path = tiny_models[kind]
    ours = read_target_info(path, name="t")
    theirs = HFTarget(str(path), name="t").info
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)


def test_target_info_custom_ids_and_errors(tiny_models, tmp_path):
    info = read_target_info(tiny_models["llama"], aux_layer_ids=[5, 0, 3])
    assert info.aux_layer_ids == (0, 3, 5)
    with pytest.raises(ValueError, match="out of range"):
        read_target_info(tiny_models["llama"], aux_layer_ids=[0, 3, 8])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_target_info(tmp_path)
