"""SGLang adapter: argument building and response parsing in SGLang 0.5.23's shapes, without a GPU.

SGLang cannot run here, so the pure pieces are tested on response dicts shaped like
``sglang/srt/managers/tokenizer_manager.py`` builds them, and the whole backend is driven once by a
stand-in ``sglang`` module whose engine computes those responses from a tiny HF model. That end-to-end
check compares the result with the HF backend, which catches off-by-one errors in the teacher rows
and the layer-id conversion.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch

from core import layers
from extract.backends.base import GenerationConfig, TeacherSpec
from extract.backends.sglang import (
    LANGUAGE_MODEL_ONLY_ARCHITECTURES,
    SGLANG_MISSING,
    SGLangTarget,
    build_engine_kwargs,
    capture_request,
    check_response,
    check_teacher,
    generation_request,
    is_multimodal_config,
    parse_capture_output,
    parse_generate_output,
    read_target_info,
)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


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


@pytest.mark.sglang
def test_engine_kwargs_are_real_server_args_fields():
    from sglang.srt.server_args import ServerArgs

    kw = build_engine_kwargs("/m", engine_layer_ids=[1, 2, 3], architecture="LlamaForCausalLM",
                             multimodal=True, language_model_only_architectures=("LlamaForCausalLM",))
    # 0.5.23 builds ServerArgs with msgspec.defstruct from the arg_groups/fields namespaces.
    fields = set(getattr(ServerArgs, "__struct_fields__", ()))
    fields |= {name for klass in ServerArgs.__mro__ for name in getattr(klass, "__annotations__", {})}
    assert set(kw) <= fields, sorted(set(kw) - fields)


@pytest.mark.sglang
def test_engine_kwargs_pass_sglangs_own_aux_capture_validation(tmp_path):
    from helpers_models import make_tiny_llama
    from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture
    from sglang.srt.server_args import ServerArgs

    path = make_tiny_llama(tmp_path / "llama", num_layers=8)
    ids = layers.to_engine_layer_ids([1, 3, 4], "sglang", "LlamaForCausalLM")
    kw = build_engine_kwargs(str(path), engine_layer_ids=ids, architecture="LlamaForCausalLM", max_length=256)
    args = ServerArgs(**kw, device="cpu")  # no GPU here; everything else is what SGLangTarget starts
    assert (args.enable_return_aux_hidden_states, args.return_aux_hidden_state_layer_ids) == (True, ids)
    assert args.disable_radix_cache and args.chunked_prefill_size == -1 and args.skip_tokenizer_init
    handle_aux_hidden_state_capture(args)  # SGLang's check of capture without a draft model
    with pytest.raises(ValueError, match="without a draft"):  # the check does refuse what would break capture
        handle_aux_hidden_state_capture(ServerArgs(**{**kw, "speculative_draft_model_path": str(path)}, device="cpu"))


@pytest.mark.sglang
def test_language_model_only_copy_matches_the_installed_sglang():
    from sglang.srt.server_args import ServerArgs

    assert tuple(ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES) == LANGUAGE_MODEL_ONLY_ARCHITECTURES


def _engine_source() -> ast.ClassDef:
    """sglang.Engine's class definition, parsed from the installed source.

    Importing sglang.Engine pulls its HTTP server and scheduler stack (uvicorn, setproctitle, ...), which the
    engine venv (built for the loaders) does not have; the class body is what matters here.
    """
    spec = importlib.util.find_spec("sglang.srt.entrypoints.engine")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")


def _params(cls: ast.ClassDef, name: str) -> set[str]:
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name)
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs}


@pytest.mark.sglang
def test_requests_are_what_the_real_engine_accepts():
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    engine = _engine_source()
    assert any(isinstance(n, ast.AsyncFunctionDef) and n.name == "async_generate" for n in engine.body)
    init = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert "self.loop" in {ast.unparse(t) for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets}

    capture = capture_request([1, 2, 3], 8)
    assert set(capture) <= _params(engine, "async_generate"), sorted(set(capture) - _params(engine, "async_generate"))
    req = GenerateReqInput(**capture)
    req.normalize_batch_and_arguments()
    assert req.is_single and req.return_hidden_states is True and req.logprob_start_len == 0
    SamplingParams(**capture["sampling_params"])

    gen = generation_request([[1, 2], [3]], GenerationConfig(temperature=0.7, top_p=0.9, seed=3), [2])
    assert set(gen) <= _params(engine, "generate")
    req = GenerateReqInput(**gen)
    req.normalize_batch_and_arguments()
    assert not req.is_single and req.batch_size == 2
    params = SamplingParams(**gen["sampling_params"])
    assert params.sampling_seed == 3 and params.no_stop_trim and set(params.stop_token_ids) == {2}


# ---------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------


def test_capture_request_asks_for_prompt_logprobs_and_hidden_states():
    req = capture_request([1, 2, 3], 8)
    assert req == {
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 8,
    }


def test_generation_request_carries_sampling_and_stops():
    greedy = generation_request([[1, 2]], GenerationConfig(max_new_tokens=16), [2, 7])
    assert greedy["input_ids"] == [[1, 2]]
    assert greedy["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0,
                                         "stop_token_ids": [2, 7], "no_stop_trim": True}
    sampled = generation_request([[1]], GenerationConfig(temperature=0.7, top_p=0.9, seed=5), [2])
    assert sampled["sampling_params"]["sampling_seed"] == 5 and sampled["sampling_params"]["top_p"] == 0.9


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


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed here")
def test_missing_sglang_raises_clear_error(tmp_path):
    with pytest.raises(RuntimeError) as e:
        SGLangTarget(str(tmp_path))
    assert "pip install 'redraft[sglang]'" in str(e.value) and "--backend hf" in str(e.value)
    assert str(e.value) == SGLANG_MISSING


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from helpers_models import make_tiny_deepseek_v3, make_tiny_llama, make_wrapped_model

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


# ---------------------------------------------------------------------------------------------------------
# End to end through a stand-in sglang module
# ---------------------------------------------------------------------------------------------------------


class _Rows(list):
    """A response's hidden-state rows (a list, as SGLang sends them) that a weak reference can watch."""


class _StandInEngine:
    """Answers like sglang.Engine does for a llama-family target, computed with transformers.

    Capture point (sglang/srt/models/llama.py::set_eagle3_layers_to_capture): engine id v is captured
    at the input of layer v + 1, i.e. HF hidden_states[v + 1]. Like the real engine it owns an event loop
    (``loop``) that ``async_generate`` runs on; its answers arrive staggered (request i after i steps),
    and it records how many earlier responses' hidden-state lists are still alive when each one is made.
    """

    started: list[dict] = []

    def __init__(self, **kwargs):
        from transformers import AutoModelForCausalLM

        assert kwargs["enable_return_aux_hidden_states"] and kwargs["disable_radix_cache"]
        self.kwargs = kwargs
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=torch.float32).eval()
        self.shut = False
        self.loop = asyncio.new_event_loop()
        self.in_flight = self.max_in_flight = 0
        self.lists: list[weakref.ref] = []
        self.max_lists_alive = 0
        _StandInEngine.started.append(kwargs)

    def _one_capture(self, ids: list[int], k: int) -> dict:
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
        capture = [v + 1 for v in self.kwargs["return_aux_hidden_state_layer_ids"]]
        aux = torch.cat([out.hidden_states[i][0] for i in capture], dim=-1)
        lp = torch.log_softmax(out.logits[0].float(), dim=-1)
        vals, idx = lp.topk(k, dim=-1)
        rows = [[(v, i, None) for v, i in zip(vr, ir, strict=True)] for vr, ir in zip(vals.tolist(), idx.tolist(),
                                                                                       strict=True)]
        return {
            "output_ids": [int(idx[-1, 0])],
            "meta_info": {"prompt_tokens": len(ids), "cached_tokens": 0, "hidden_states": [_Rows(aux.tolist())],
                          "input_top_logprobs": [None, *rows[:-1]], "output_top_logprobs": [rows[-1]],
                          "finish_reason": {"type": "length", "length": 1}},
        }

    def _one_generation(self, ids: list[int], params: dict) -> dict:
        seq, new = list(ids), []
        finish: dict = {"type": "length", "length": params["max_new_tokens"]}
        for _ in range(params["max_new_tokens"]):
            with torch.inference_mode():
                tok = int(self.model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(tok)
            new.append(tok)
            if tok in params["stop_token_ids"]:
                finish = {"type": "stop", "matched": tok}
                break
        return {"output_ids": new, "meta_info": {"finish_reason": finish}}

    def _answer(self, ids, sampling_params, return_hidden_states, return_logprob, logprob_start_len,
                top_logprobs_num) -> dict:
        if return_hidden_states:
            assert return_logprob and logprob_start_len == 0 and sampling_params["max_new_tokens"] == 1
            self.max_lists_alive = max(self.max_lists_alive, sum(r() is not None for r in self.lists))
            out = self._one_capture(ids, top_logprobs_num)
            self.lists.append(weakref.ref(out["meta_info"]["hidden_states"][0]))
            return out
        return self._one_generation(ids, sampling_params)

    def generate(self, input_ids, sampling_params, return_hidden_states=False, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None):
        """A batch: every response is gathered before any is returned (as in SGLang)."""
        assert not self.shut
        return [self._answer(ids, sampling_params, return_hidden_states, return_logprob, logprob_start_len,
                             top_logprobs_num) for ids in input_ids]

    async def async_generate(self, input_ids, sampling_params, return_hidden_states=False, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None):
        """One sequence (a flat id list gives a dict back, as in SGLang), answered after its turn comes."""
        assert not self.shut and input_ids and all(isinstance(t, int) for t in input_ids)
        assert asyncio.get_running_loop() is self.loop
        order = self.in_flight
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for _ in range(order + 1):  # request i answers after the ones before it
            await asyncio.sleep(0)
        self.in_flight -= 1
        return self._answer(input_ids, sampling_params, return_hidden_states, return_logprob, logprob_start_len,
                            top_logprobs_num)

    def shutdown(self):
        self.shut = True
        self.loop.close()


@pytest.fixture
def stand_in_sglang(monkeypatch):
    module = types.ModuleType("sglang")
    module.Engine = _StandInEngine
    module.__version__ = "stand-in"
    monkeypatch.setitem(sys.modules, "sglang", module)
    _StandInEngine.started.clear()
    return module


def test_backend_end_to_end_matches_hf(tiny_models, stand_in_sglang):
    from extract.backends.hf import HFTarget

    path = str(tiny_models["llama"])
    target = SGLangTarget(path, name="tiny", tp_size=2, dtype="float32", max_length=64)
    kw = _StandInEngine.started[-1]
    assert kw["tp_size"] == 2 and kw["skip_tokenizer_init"] is True
    assert kw["return_aux_hidden_state_layer_ids"] == layers.to_engine_layer_ids(
        target.info.aux_layer_ids, "sglang", "LlamaForCausalLM")
    hf = HFTarget(path, name="tiny")
    assert target.info == hf.info

    batch = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60], [1, 61, 62, 63], [1, 70, 71, 72, 73, 74, 75]]
    teacher = TeacherSpec(kinds=("topk",), topk=4)
    ours, ref = target.capture(batch, teacher), hf.capture(batch, teacher)
    for a, b in zip(ours, ref, strict=True):
        assert a.aux_hidden.dtype == torch.float32
        torch.testing.assert_close(a.aux_hidden, b.aux_hidden, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.topk_ids, b.topk_ids)
        torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, atol=1e-4, rtol=1e-4)
    engine = target.engine
    assert engine.max_in_flight == len(batch)  # every sequence was sent at once: the engine batches them
    # each response became tensors as it arrived: no earlier response's hidden-state lists were still alive
    assert engine.max_lists_alive == 0
    assert all(r() is None for r in engine.lists)
    with pytest.raises(ValueError, match="last_hidden"):
        target.capture(batch, TeacherSpec(kinds=("topk", "last_hidden")))
    with pytest.raises(ValueError, match="max_length=64"):
        target.capture([[1] * 65], teacher)

    gen = GenerationConfig(max_new_tokens=5)
    assert target.generate(batch, gen, [2]) == hf.generate(batch, gen, [2])

    target.close()
    assert target.engine is None
    with pytest.raises(RuntimeError, match="shut down"):
        target.capture(batch, teacher)
