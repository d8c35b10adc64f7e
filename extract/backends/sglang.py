"""SGLang target: capture through SGLang's EAGLE-3 aux-hidden-state capture, in-process via ``sglang.Engine``.

Why SGLang at all: it serves the target with the same kernels, TP/EP sharding and capture point as
production, so the features a drafter is trained on are the ones it will see when served.

Every engine argument and response field below was checked against the sglang 0.5.23 wheel (the pin
of ``redraft[sglang]``); paths are relative to ``python/`` in sgl-project/sglang:

- Engine kwargs are ``ServerArgs`` fields (``sglang/srt/entrypoints/engine.py::Engine.__init__``), declared in
  ``sglang/srt/arg_groups/fields/``: ``exec_.py`` (enable_return_aux_hidden_states,
  return_aux_hidden_state_layer_ids, enable_two_batch_overlap), ``spec.py`` (speculative_algorithm),
  ``memory.py`` (disable_radix_cache), ``schedule.py`` (chunked_prefill_size, mem_fraction_static),
  ``parallel.py`` (tp_size, ep_size), ``model.py`` (model_path, dtype, trust_remote_code), ``serving.py``
  (skip_tokenizer_init), ``disagg.py`` (language_model_only); ``sglang/srt/server_args.py``
  (ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES).
- Aux capture without a draft: ``sglang/srt/arg_groups/validation_hook.py::handle_aux_hidden_state_capture``
  (speculative_algorithm only names the convention and is reset to None; needs pp_size == 1) and
  ``sglang/srt/layers/logits_processor.py`` (full capture mode returns the packed aux tensor in place
  of the last-layer state).
- ``Engine.generate`` arguments: ``sglang/srt/entrypoints/engine.py``; sampling keys:
  ``sglang/srt/sampling/sampling_params.py``.
- Response: ``output_ids`` and ``meta_info`` keys ``hidden_states``, ``input_top_logprobs``,
  ``output_top_logprobs``, ``prompt_tokens``, ``cached_tokens``, ``finish_reason``:
  ``sglang/srt/managers/tokenizer_manager.py``. Prefill hidden states are one ``[T][3H]`` list per request:
  ``sglang/srt/managers/scheduler_components/batch_result_processor.py::_append_prefill_hidden_states``
  (``.cpu().clone().tolist()``: there is no tensor form of per-token hidden states in 0.5.23).
- Memory: as Python floats those lists cost about 32 bytes per value, 8x fp32 (688 KB per token at
  Kimi-K2.5's 3 x 7168). ``Engine.generate`` with a batch gathers every response before returning
  (``tokenizer_manager.py::_handle_batch_request`` -> ``_collect_batch_responses``), so a whole batch's
  lists would coexist. Capture therefore sends one ``Engine.async_generate`` per sequence, concurrently on
  the engine's own event loop (``Engine.loop``, which ``Engine.generate`` also runs on; the scheduler
  batches them as usual), and turns each response's hidden states into a float32 tensor as soon as it
  arrives. What remains as lists at once is what one scheduler output carries, bounded by SGLang's own
  prefill batch.
  ``input_top_logprobs`` starts with ``None`` and drops the last prompt row, whose distribution is
  the first output token's: ``scheduler_components/logprob_result_processor.py::_process_input_top_logprobs``.
  Input logprobs are a plain log-softmax of the logits (``sglang/srt/layers/logprob_processor.py``); output
  logprobs are too when sampling is greedy (``sglang/srt/layers/sampler.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from core import layers
from core.target_weights import text_config
from extract.backends.base import Captured, GenerationConfig, TargetBackend, TargetInfo, TeacherSpec

log = logging.getLogger(__name__)

SGLANG_MISSING = (
    "the sglang backend needs SGLang, which is not installed: pip install 'redraft[sglang]' "
    "(needs a CUDA machine). --backend hf works everywhere, CPU included."
)

# ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES of sglang 0.5.23 (sglang/srt/server_args.py). At run time the
# installed SGLang's own list is used; this copy only serves when that attribute is missing.
LANGUAGE_MODEL_ONLY_ARCHITECTURES = (
    "DeepseekV4ForCausalLM",
    "MuseGlimmerForConditionalGeneration",
    "Cosmos3ForConditionalGeneration",
    "Cosmos3EdgeForConditionalGeneration",
)

# Engine arguments the capture depends on; engine_kwargs may not change them.
_CAPTURE_CRITICAL = (
    "enable_return_aux_hidden_states",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "return_aux_hidden_state_layer_ids",
    "disable_radix_cache",
    "enable_two_batch_overlap",
    "skip_tokenizer_init",
    "pp_size",
)

_TEXT_ARCH_BY_MODEL_TYPE = {"kimi_k2": "DeepseekV3ForCausalLM"}  # not in transformers' causal-LM mapping


# ---------------------------------------------------------------------------------------------------------
# Engine and request arguments
# ---------------------------------------------------------------------------------------------------------


def build_engine_kwargs(
    model_path: str,
    *,
    engine_layer_ids: Sequence[int],
    architecture: str,
    multimodal: bool = False,
    tp_size: int = 1,
    ep_size: int = 1,
    dtype: str = "bfloat16",
    mem_fraction_static: float = 0.8,
    max_length: int = 8192,
    trust_remote_code: bool = False,
    language_model_only_architectures: Sequence[str] = LANGUAGE_MODEL_ONLY_ARCHITECTURES,
    engine_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` arguments for capture-only aux extraction.

    ``engine_layer_ids`` are already in SGLang's convention (``core.layers.to_engine_layer_ids``).
    """
    kwargs: dict[str, Any] = {
        "model_path": str(model_path),
        "tp_size": int(tp_size),
        "ep_size": int(ep_size),
        "dtype": dtype,
        "mem_fraction_static": float(mem_fraction_static),
        "trust_remote_code": bool(trust_remote_code),
        # Capture without a draft model: speculative_algorithm only names the capture convention.
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": [int(i) for i in engine_layer_ids],
        # A radix-cache hit returns hidden states for the uncached suffix only.
        "disable_radix_cache": True,
        # Chunked prefill drops the hidden states of middle chunks; -1 switches it off.
        "chunked_prefill_size": -1,
        # Two-batch overlap runs MoE layers in stages that skip the capture hooks.
        "enable_two_batch_overlap": False,
        # We send and read token ids only (our tokenizer does the chat template), so SGLang's
        # tokenizer/detokenizer processes would be pure overhead (and Kimi's needs remote code).
        "skip_tokenizer_init": True,
    }
    if multimodal:
        if architecture in language_model_only_architectures:
            kwargs["language_model_only"] = True  # skip the vision tower: text-only capture
        elif not (engine_kwargs or {}).get("language_only"):
            log.warning(
                "%s is multimodal and this SGLang does not accept language_model_only for it, so the vision encoder "
                "is loaded too (memory only: the captured text features do not change). In SGLang 0.5.23 "
                "KimiK25ForConditionalGeneration builds its MoonViT tower in any case; engine_args "
                "{\"language_only\": true} skips loading its weights, but that flag belongs to SGLang's encoder "
                "disaggregation and also starts its encoder bootstrap server (docs/kimi-k25.md)", architecture,
            )
    for key, value in (engine_kwargs or {}).items():
        if key in _CAPTURE_CRITICAL and kwargs.get(key) != value:
            raise ValueError(
                f"engine_kwargs[{key!r}]={value!r} would break aux capture (redraft sets {kwargs.get(key)!r})"
            )
        if key == "chunked_prefill_size" and value is not None and 0 < int(value) < max_length:
            raise ValueError(
                f"engine_kwargs['chunked_prefill_size']={value} is below max_length={max_length}: chunked prefill "
                "drops the hidden states of middle chunks; use -1 or a value >= max_length"
            )
        kwargs[key] = value
    return kwargs


def check_teacher(teacher: TeacherSpec) -> None:
    """SGLang returns top-k log-probabilities, never the post-norm final state."""
    if "last_hidden" in teacher.kinds:
        raise ValueError(
            "the sglang backend cannot produce the 'last_hidden' teacher: SGLang's aux capture returns the "
            "aux layers only, not the post-final-norm state. Use --teacher topk, or --backend hf for last_hidden."
        )


def capture_request(ids: Sequence[int], teacher_k: int) -> dict[str, Any]:
    """``Engine.async_generate`` arguments for one sequence: a 1-token greedy step with prompt logprobs.

    logprob_start_len=0 matters twice: it asks for top-k rows at every prompt position, and SGLang prunes
    returned hidden states to the same start. Greedy keeps the last row a plain log-softmax.
    """
    return {
        "input_ids": [int(t) for t in ids],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": int(teacher_k),
    }


def generation_request(
    prompts: Sequence[Sequence[int]], gen: GenerationConfig, stop_ids: Sequence[int],
    seeds: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``Engine.generate`` arguments for regeneration. SGLang honours sampling_seed only with
    ``enable_deterministic_inference`` (pass it through engine_kwargs for reproducible sampling);
    ``seeds`` gives each prompt its own (one sampling-params dict per prompt)."""
    params: dict[str, Any] = {
        "max_new_tokens": int(gen.max_new_tokens),
        "temperature": float(gen.temperature),
        "top_p": float(gen.top_p),
        "stop_token_ids": [int(t) for t in stop_ids],
        "no_stop_trim": True,
    }
    ids = [[int(t) for t in p] for p in prompts]
    if gen.temperature > 0 and seeds is not None:
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        return {"input_ids": ids, "sampling_params": [{**params, "sampling_seed": int(s)} for s in seeds]}
    if gen.temperature > 0:
        params["sampling_seed"] = int(gen.seed)
    return {"input_ids": ids, "sampling_params": params}


# ---------------------------------------------------------------------------------------------------------
# Response parsing
# ---------------------------------------------------------------------------------------------------------


def _as_list(outputs: Any) -> list[Mapping[str, Any]]:
    """Engine.generate returns a dict for one prompt and a list for a batch."""
    return [outputs] if isinstance(outputs, Mapping) else list(outputs)


def _meta(output: Mapping[str, Any], index: int | None = None) -> Mapping[str, Any]:
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping):
        where = "" if index is None else f" #{index}"
        raise ValueError(f"SGLang response{where} has no meta_info dict (keys: {sorted(output)})")
    return meta


def _prompt_hidden_rows(meta: Mapping[str, Any]) -> list:
    hs = meta.get("hidden_states")
    if not hs:
        raise ValueError(
            "SGLang response has no meta_info['hidden_states']: the engine must be started with "
            "enable_return_aux_hidden_states=True and the request sent with return_hidden_states=True"
        )
    rows = hs[0]  # the prefill block; decode steps (none with max_new_tokens=1) would follow
    if not rows or not isinstance(rows[0], (list, tuple)):
        raise ValueError(
            "meta_info['hidden_states'][0] is not a [T][hidden] block; was return_hidden_states='last' used?"
        )
    return rows


def check_response(index: int, prompt: Sequence[int], output: Mapping[str, Any]) -> None:
    """Fail loudly when SGLang returned features for fewer tokens than it was given.

    Radix-cache hits and chunked prefill both shorten the returned hidden states silently.
    """
    meta = _meta(output, index)
    n = len(prompt)
    cached = meta.get("cached_tokens") or 0
    if cached:
        raise ValueError(
            f"sample #{index}: SGLang served {cached} of {n} prompt tokens from the radix cache, so their hidden "
            "states are missing; start the engine with disable_radix_cache=True"
        )
    if meta.get("prompt_tokens", n) != n:
        raise ValueError(f"sample #{index}: sent {n} tokens but SGLang counted prompt_tokens={meta['prompt_tokens']}")
    got = len(_prompt_hidden_rows(meta))
    if got != n:
        raise ValueError(
            f"sample #{index}: SGLang returned hidden states for {got} of {n} prompt tokens; chunked prefill drops "
            "middle chunks (use chunked_prefill_size=-1 or >= max_length) and radix-cache hits drop the prefix"
        )
    top = meta.get("input_top_logprobs")
    if top is not None and len(top) != n:
        raise ValueError(f"sample #{index}: {len(top)} input_top_logprobs rows for {n} prompt tokens")


def _topk_row(row: Any, k: int, where: str) -> tuple[list[int], list[float]]:
    """One position's (logprob, token_id, text) entries -> the k best ids and logprobs, descending."""
    if not row or len(row) < k:
        raise ValueError(f"{where}: {0 if not row else len(row)} top logprobs, need teacher k={k}")
    entries = sorted(((float(e[0]), int(e[1])) for e in row), key=lambda e: -e[0])[:k]
    return [e[1] for e in entries], [e[0] for e in entries]


def parse_capture_output(output: Mapping[str, Any], teacher_k: int, *, aux_width: int | None = None) -> Captured:
    """One SGLang capture response -> Captured (aux [T, n_aux*H], top-k teacher rows [T, K]).

    Teacher row t (the distribution after reading tokens 0..t) is ``input_top_logprobs[t + 1]`` for
    t < T-1 (row 0 is SGLang's placeholder None), and ``output_top_logprobs[0]`` for the last token.
    """
    meta = _meta(output)
    rows = _prompt_hidden_rows(meta)
    aux = torch.tensor(rows, dtype=torch.float32)
    if aux.dim() != 2:
        raise ValueError(f"hidden states are not a [T][hidden] block (shape {tuple(aux.shape)})")
    n = aux.shape[0]
    if aux_width is not None and aux.shape[1] != aux_width:
        raise ValueError(
            f"SGLang returned hidden states of width {aux.shape[1]}, expected {aux_width} (n_aux * hidden_size); "
            "is the engine returning last-layer states instead of the aux capture?"
        )
    top_in = meta.get("input_top_logprobs")
    top_out = meta.get("output_top_logprobs")
    if top_in is None or not top_out:
        raise ValueError(
            "SGLang response lacks input_top_logprobs/output_top_logprobs: send return_logprob=True, "
            "logprob_start_len=0 and top_logprobs_num=K"
        )
    if len(top_in) != n:
        raise ValueError(f"{len(top_in)} input_top_logprobs rows for {n} hidden-state rows")
    ids, lps = [], []
    for t in range(n):
        row = top_in[t + 1] if t + 1 < n else top_out[0]
        where = f"teacher row {t}" + (" (output_top_logprobs[0])" if t + 1 >= n else "")
        i, lp = _topk_row(row, teacher_k, where)
        ids.append(i)
        lps.append(lp)
    return Captured(
        aux_hidden=aux,
        topk_ids=torch.tensor(ids, dtype=torch.int64),
        topk_logprobs=torch.tensor(lps, dtype=torch.float32),
    )


def parse_generate_output(output: Mapping[str, Any]) -> list[int]:
    """New token ids of one regeneration, ending with the stop id when one was matched."""
    ids = [int(t) for t in output.get("output_ids") or []]
    finish = _meta(output).get("finish_reason")
    matched = finish.get("matched") if isinstance(finish, Mapping) else None
    if isinstance(matched, int) and not isinstance(matched, bool) and (not ids or ids[-1] != matched):
        ids.append(matched)
    return ids


# ---------------------------------------------------------------------------------------------------------
# Target facts from the model folder
# ---------------------------------------------------------------------------------------------------------


def _namespace(obj: Any) -> Any:
    if isinstance(obj, dict):
        return types.SimpleNamespace(**{k: _namespace(v) for k, v in obj.items()})
    return obj


def _load_config(folder: Path, trust_remote_code: bool) -> tuple[Any, dict[str, Any]]:
    """(config object, raw config.json). AutoConfig normalises fields the way the HF backend sees them;
    a model type that this transformers does not know falls back to the raw JSON."""
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        log.warning("%s/config.json: transformers cannot parse it (%s); reading the raw JSON", folder, e)
        cfg = _namespace(raw)
    return cfg, raw


def _text_architecture(text_cfg: Any, wrapped: bool, architecture: str) -> str:
    archs = getattr(text_cfg, "architectures", None)
    if archs:
        return archs[0]
    if not wrapped:
        return architecture
    model_type = getattr(text_cfg, "model_type", None)
    if model_type in _TEXT_ARCH_BY_MODEL_TYPE:
        return _TEXT_ARCH_BY_MODEL_TYPE[model_type]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, architecture)


def is_multimodal_config(raw: Mapping[str, Any]) -> bool:
    """A wrapper with a nested text decoder (Kimi-K2.5 and other VLMs)."""
    return "text_config" in raw or "vision_config" in raw


def read_target_info(
    path: str | Path, *, name: str | None = None, aux_layer_ids: Sequence[int] | None = None,
    trust_remote_code: bool = False,
) -> TargetInfo:
    """TargetInfo from a model folder without loading weights (SGLang loads them in its own processes).

    Field for field the same as the HF backend's, so datasets from either backend describe a target alike.
    """
    from extract.backends.hf import config_hash, resolve_weight_keys, rope_info, weight_file_keys

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not a local model folder (no config.json); redraft never downloads")
    cfg, raw = _load_config(folder, trust_remote_code)
    text_cfg = text_config(cfg)
    wrapped = text_cfg is not cfg
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{folder}/config.json: no 'architectures' entry; SGLang picks its model class from it")
    architecture = archs[0]

    def need(key: str) -> Any:
        value = getattr(text_cfg, key, None)
        if value is None:
            raise ValueError(f"{folder}/config.json: the text config has no {key!r}")
        return value

    num_layers = int(need("num_hidden_layers"))
    ids = layers.default_aux_layer_ids(num_layers, architecture) if aux_layer_ids is None else aux_layer_ids
    ids = layers.validate_aux_layer_ids(ids, num_layers)
    layers.check_servable(ids, str(architecture))
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    keys = weight_file_keys(folder)
    if not keys:
        raise ValueError(f"{folder}: no safetensors weights found (SGLang extraction needs safetensors files)")
    embed_key, lm_head_key = resolve_weight_keys(cfg, keys)
    return TargetInfo(
        name=name or str(path),
        path=str(folder.resolve()),
        architecture=architecture,
        text_architecture=_text_architecture(text_cfg, wrapped, architecture),
        model_type=str(getattr(text_cfg, "model_type", None) or raw.get("model_type")),
        config_hash=config_hash(folder / "config.json"),
        hidden_size=hidden,
        num_layers=num_layers,
        vocab_size=int(need("vocab_size")),
        aux_layer_ids=tuple(ids),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text_cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text_cfg, "head_dim", None) or hidden // heads),
        intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(getattr(text_cfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(need("max_position_embeddings")),
        rope=rope_info(text_cfg),
        embed_key=embed_key,
        lm_head_key=lm_head_key,
    )


# ---------------------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------------------


class SGLangTarget(TargetBackend):
    """A target served by an in-process ``sglang.Engine`` (its own scheduler processes, TP/EP on GPUs)."""

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        tp_size: int = 1,
        ep_size: int = 1,
        dtype: str = "bfloat16",
        mem_fraction_static: float = 0.8,
        max_length: int = 8192,
        trust_remote_code: bool = False,
        engine_kwargs: dict | None = None,
    ) -> None:
        try:
            import sglang
        except ImportError as e:
            raise RuntimeError(SGLANG_MISSING) from e
        from transformers import AutoTokenizer

        self.info = read_target_info(path, name=name, aux_layer_ids=aux_layer_ids, trust_remote_code=trust_remote_code)
        folder = Path(self.info.path)
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
        self.max_length = int(max_length)
        engine_ids = layers.to_engine_layer_ids(self.info.aux_layer_ids, "sglang", self.info.architecture)
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        lmo = _language_model_only_architectures()
        self.engine_kwargs = build_engine_kwargs(
            str(folder), engine_layer_ids=engine_ids, architecture=self.info.architecture,
            multimodal=is_multimodal_config(raw), tp_size=tp_size, ep_size=ep_size, dtype=dtype,
            mem_fraction_static=mem_fraction_static, max_length=max_length, trust_remote_code=trust_remote_code,
            language_model_only_architectures=lmo, engine_kwargs=engine_kwargs,
        )
        log.info("starting sglang %s engine for %s: aux layers %s (engine ids %s), tp=%d ep=%d",
                 getattr(sglang, "__version__", "?"), self.info.name, list(self.info.aux_layer_ids), engine_ids,
                 tp_size, ep_size)
        self.engine: Any = sglang.Engine(**self.engine_kwargs)

    def capture(self, batch: list[list[int]], teacher: TeacherSpec) -> list[Captured]:
        """One 1-token greedy request per sequence, sent together; aux states and top-k rows come back in
        meta_info and each response becomes tensors as soon as it arrives (see the module docstring)."""
        check_teacher(teacher)
        if not batch:
            return []
        too_long = [i for i, seq in enumerate(batch) if not 0 < len(seq) <= self.max_length]
        if too_long:
            i = too_long[0]
            raise ValueError(f"sequence #{i} has {len(batch[i])} tokens; expected 1..max_length={self.max_length}")
        engine = self._engine()
        width = len(self.info.aux_layer_ids) * self.info.hidden_size

        async def one(i: int, seq: list[int]) -> Captured:
            output = await engine.async_generate(**capture_request(seq, teacher.topk))
            check_response(i, seq, output)
            return parse_capture_output(output, teacher.topk, aux_width=width)  # the lists die with `output`

        async def every() -> list[Captured]:
            return list(await asyncio.gather(*(one(i, seq) for i, seq in enumerate(batch))))

        return engine.loop.run_until_complete(every())

    def generate(self, prompts: list[list[int]], gen: GenerationConfig, stop_ids: list[int],
                 seeds: list[int] | None = None) -> list[list[int]]:
        """Continue each prompt with the engine's sampler; SGLang batches the requests itself."""
        if not prompts:
            return []
        if min(len(p) for p in prompts) < 1:
            raise ValueError("cannot generate from an empty prompt")
        outputs = _as_list(self._engine().generate(**generation_request(prompts, gen, stop_ids, seeds)))
        if len(outputs) != len(prompts):
            raise ValueError(f"SGLang returned {len(outputs)} generations for {len(prompts)} prompts")
        return [parse_generate_output(o) for o in outputs]

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("the SGLang engine was shut down (close() was called)")
        return self.engine

    def close(self) -> None:
        """Shut the engine's scheduler/detokenizer processes down and free the GPUs."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()


def _language_model_only_architectures() -> tuple[str, ...]:
    """The installed SGLang's own list of architectures that accept language_model_only."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return LANGUAGE_MODEL_ONLY_ARCHITECTURES
    return tuple(getattr(ServerArgs, "LANGUAGE_MODEL_ONLY_ARCHITECTURES", LANGUAGE_MODEL_ONLY_ARCHITECTURES))
