"""The SGLang adapter against the real SGLang 0.5.23 package (the conformance lane's engine venv): the engine
arguments are real ServerArgs fields that pass SGLang's own capture checks, and the requests are what it accepts."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from extract.backends.sglang import LANGUAGE_MODEL_ONLY_ARCHITECTURES, build_engine_kwargs
from redraft.core import layers
from redraft.engines.request import TokenRequest, sglang_sampling_params
from redraft.engines.sglang_driver import capture_request


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
    from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture
    from sglang.srt.server_args import ServerArgs

    from redraft.catalog.tiny_models import make_tiny_llama

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

    params = SamplingParams(**sglang_sampling_params(TokenRequest("0", [1, 2], 16, temperature=0.7, top_p=0.9,
                                                                  seed=3, stop_token_ids=[2])))
    assert params.sampling_seed == 3 and params.no_stop_trim and set(params.stop_token_ids) == {2}
    assert "generate" in {n.name for n in engine.body if isinstance(n, ast.FunctionDef)}
