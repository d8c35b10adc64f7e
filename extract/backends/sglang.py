"""SGLang target: capture through SGLang's EAGLE-3 aux-hidden-state capture, ``sglang.Engine`` in a driver.

Why SGLang at all: it serves the target with the same kernels, TP/EP sharding and capture point as
production, so the features a drafter is trained on are the ones it will see when served.

The engine runs through :mod:`redraft.engines.sglang` (a driver subprocess: this interpreter's SGLang on a GPU
machine, else the SGLang CPU venv of ``make sglang-cpu-venv`` with redraft's stand-in for SGLang's CPU
kernels); the driver writes each prompt's aux states and top-k prompt log-probabilities to a file
(:mod:`redraft.engines.sglang_driver`: the request and the response parsing), which is read here, checked
against the prompt's ids and removed. Every engine argument was checked against the sglang 0.5.23 wheel (the
pin of ``redraft[sglang]``); paths are relative to ``python/`` in sgl-project/sglang:

- Engine kwargs are ``ServerArgs`` fields (``sglang/srt/entrypoints/engine.py::Engine.__init__``), declared in
  ``sglang/srt/arg_groups/fields/``: ``exec_.py`` (enable_return_aux_hidden_states,
  return_aux_hidden_state_layer_ids, enable_two_batch_overlap), ``spec.py`` (speculative_algorithm),
  ``memory.py`` (disable_radix_cache, max_total_tokens), ``schedule.py`` (chunked_prefill_size,
  mem_fraction_static), ``parallel.py`` (tp_size, ep_size), ``model.py`` (model_path, dtype, trust_remote_code),
  ``serving.py`` (skip_tokenizer_init), ``disagg.py`` (language_model_only); ``sglang/srt/server_args.py``
  (ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES).
- Aux capture without a draft: ``sglang/srt/arg_groups/validation_hook.py::handle_aux_hidden_state_capture``
  (speculative_algorithm only names the convention and is reset to None; needs pp_size == 1), the layer-id
  range check ``model_runner_components/spec_aux_hidden_state.py::_check_capture_layer_ids_in_range`` and the
  capture point ``models/llama.py`` / ``models/deepseek_v2.py::set_eagle3_layers_to_capture`` (``redraft.core.layers``).
- ``models/deepseek_v2.py`` reads ``moe_layer_freq`` from the target's config.json, which transformers 5 does not
  write: :func:`read_target_info` names it before the engine starts.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from extract.backends.base import Captured, GenerationConfig, TargetBackend, TargetInfo, TeacherSpec
from extract.timing import span
from redraft.core import layers
from redraft.core.target_weights import text_config

log = logging.getLogger(__name__)

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

    ``engine_layer_ids`` are already in SGLang's convention (``redraft.core.layers.to_engine_layer_ids``).
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
    layers.check_servable(ids, str(architecture), num_layers)
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


def check_sglang_config(folder: Path, raw: Mapping[str, Any], architecture: str) -> None:
    """Refuse, by key, a config.json that SGLang's model code would fail on after minutes of start-up.

    ``models/deepseek_v2.py`` reads ``moe_layer_freq``, which transformers 5's ``save_pretrained`` of a
    ``DeepseekV3ForCausalLM`` does not write (``'DeepseekV3Config' object has no attribute 'moe_layer_freq'``);
    DeepSeek-V3's and Kimi-K2.5's published configs carry 1.
    """
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw
    if layers.serving_family(architecture) == "deepseek" and "moe_layer_freq" not in text:
        where = "text_config." if text is not raw else ""
        raise ValueError(f"{folder}/config.json: no {where}moe_layer_freq; SGLang's deepseek_v2.py reads it "
                         "(DeepSeek-V3 and Kimi-K2.5 configs have \"moe_layer_freq\": 1; transformers 5 does not "
                         "write it)")


def preflight(path: str | Path, *, aux_layer_ids: Sequence[int] | None = None, trust_remote_code: bool = False,
              engine_kwargs: Mapping[str, Any] | None = None, python: str | None = None) -> None:
    """Everything refusable without starting the engine, before anything is written: the target's config (aux
    layers SGLang can capture, keys its model code reads), the engine's interpreter and SGLang version, and on
    the CPU stand-in the engine settings that would break capture (ValueError or EngineError naming them)."""
    from redraft.engines.sglang import cpu_engine_kwargs, engine_runtime

    info = read_target_info(path, aux_layer_ids=aux_layer_ids, trust_remote_code=trust_remote_code)
    folder = Path(info.path)
    check_sglang_config(folder, json.loads((folder / "config.json").read_text(encoding="utf-8")), info.architecture)
    if engine_runtime(python).stand_in:
        cpu_engine_kwargs(dict(engine_kwargs or {}))


class SGLangTarget(TargetBackend):
    """A target served by ``sglang.Engine`` in a driver subprocess (its own scheduler processes, TP/EP on GPUs).

    max_total_tokens (engine_kwargs) bounds the KV pool; on the CPU stand-in it defaults to
    :data:`redraft.engines.sglang.CPU_KV_TOKENS` (SGLang's own default takes most of the host's memory).
    """

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
        python: str | None = None,
        capture_dir: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from redraft.engines.sglang import SGLangEngine

        self.info = read_target_info(path, name=name, aux_layer_ids=aux_layer_ids, trust_remote_code=trust_remote_code)
        folder = Path(self.info.path)
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        check_sglang_config(folder, raw, self.info.architecture)
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
        self.max_length = int(max_length)
        engine_ids = layers.to_engine_layer_ids(self.info.aux_layer_ids, "sglang", self.info.architecture,
                                                self.info.num_layers)
        self.engine_kwargs = build_engine_kwargs(
            str(folder), engine_layer_ids=engine_ids, architecture=self.info.architecture,
            multimodal=is_multimodal_config(raw), tp_size=tp_size, ep_size=ep_size, dtype=dtype,
            mem_fraction_static=mem_fraction_static, max_length=max_length, trust_remote_code=trust_remote_code,
            language_model_only_architectures=_language_model_only_architectures(), engine_kwargs=engine_kwargs,
        )
        self._own_dir = capture_dir is None
        self.capture_dir = Path(capture_dir or tempfile.mkdtemp(prefix="redraft-sglang-capture-"))
        self.capture_dir.mkdir(parents=True, exist_ok=True)
        log.info("SGLang capture of %s: aux layers %s as engine ids %s, tp=%d ep=%d, files under %s",
                 self.info.name, list(self.info.aux_layer_ids), engine_ids, tp_size, ep_size, self.capture_dir)
        with span("load"):
            self.engine: Any = SGLangEngine(
                self.engine_kwargs, python=python, capture_dir=str(self.capture_dir), timeout_s=None,
                aux_width=len(self.info.aux_layer_ids) * self.info.hidden_size, what="capture (SGLang)")

    def capture(self, batch: list[list[int]], teacher: TeacherSpec) -> list[Captured]:
        """The batch's prompts sent together (the engine batches them); each file read, checked, removed."""
        check_teacher(teacher)
        if not batch:
            return []
        too_long = [i for i, seq in enumerate(batch) if not 0 < len(seq) <= self.max_length]
        if too_long:
            i = too_long[0]
            raise ValueError(f"sequence #{i} has {len(batch[i])} tokens; expected 1..max_length={self.max_length}")
        rows = self._engine().capture(batch, teacher.topk)
        if len(rows) != len(batch):
            raise ValueError(f"SGLang returned {len(rows)} captures for {len(batch)} prompts")
        return [read_capture_file(row["path"], seq) for row, seq in zip(rows, batch, strict=True)]

    def generate(self, prompts: list[list[int]], gen: GenerationConfig, stop_ids: list[int],
                 seeds: list[int] | None = None) -> list[list[int]]:
        """Continue each prompt with the engine's sampler; SGLang batches the requests itself. SGLang honours
        a sampling seed only with ``enable_deterministic_inference`` (pass it through engine_args)."""
        from extract.regen_engines import token_requests

        if not prompts:
            return []
        if min(len(p) for p in prompts) < 1:
            raise ValueError("cannot generate from an empty prompt")
        reqs = token_requests(prompts, [gen.max_new_tokens] * len(prompts), gen, stop_ids, seeds)
        rows = self._engine().generate(reqs)
        if len(rows) != len(prompts):
            raise ValueError(f"SGLang returned {len(rows)} generations for {len(prompts)} prompts")
        return [list(r["output_token_ids"]) for r in rows]

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("the SGLang engine was shut down (close() was called)")
        return self.engine

    def close(self) -> None:
        """Shut the engine's scheduler/detokenizer processes down and free the GPUs."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()
        if getattr(self, "_own_dir", False) and self.capture_dir.exists():
            shutil.rmtree(self.capture_dir, ignore_errors=True)


def read_capture_file(path: str | Path, expected_ids: Sequence[int]) -> Captured:
    """One prompt's capture file (written by the driver) as Captured; refused unless it holds the prompt's ids.
    Removes the file."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        data = load_file(str(path))
    finally:
        path.unlink(missing_ok=True)
    got = data["input_ids"].tolist()
    if got != [int(t) for t in expected_ids]:
        raise ValueError(f"{path.name}: the engine's file holds {len(got)} token ids that are not the prompt's "
                         f"{len(expected_ids)}")
    return Captured(aux_hidden=data["aux_hidden"], topk_ids=data["topk_ids"], topk_logprobs=data["topk_logprobs"])


def _language_model_only_architectures() -> tuple[str, ...]:
    """The installed SGLang's own list of architectures that accept language_model_only."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return LANGUAGE_MODEL_ONLY_ARCHITECTURES
    return tuple(getattr(ServerArgs, "LANGUAGE_MODEL_ONLY_ARCHITECTURES", LANGUAGE_MODEL_ONLY_ARCHITECTURES))
