"""Prompts for ``serve.bench``: first user turns from a file (default MT-bench), rendered with the target's template.

The token-id APIs (SGLang ``/generate``, vLLM ``/v1/completions``) apply no chat template, so the
prompts are rendered here with the target's own tokenizer; raw text would measure acceptance on
traffic the drafter never sees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redraft.core.errors import UserError


class ServingError(UserError):
    """A condition that stops the benchmark (unreachable server, bad options, unusable prompts)."""


def _first_user_turn(rec: Any) -> str | None:
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    for key in ("prompt", "question", "instruction", "text"):
        if isinstance(rec.get(key), str):
            return rec[key]
    for key, role_key, text_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        msgs = rec.get(key)
        if isinstance(msgs, list):
            for m in msgs:
                if isinstance(m, dict) and m.get(role_key) in ("user", "human"):
                    text = m.get(text_key, m.get("content"))
                    if isinstance(text, str):
                        return text
    return None


def load_prompts(path: str | None, num: int) -> tuple[list[str], str]:
    """First user turns from a JSONL/JSON/text file (default: the embedded MT-bench questions).

    JSONL records may carry ``turns`` (MT-bench), ``prompt``/``question``/``instruction``/``text``,
    OpenAI ``messages`` or ShareGPT ``conversations``; a ``.txt`` file holds one prompt per line.
    """
    if path is None:
        from redraft.catalog.builtin import resolve_data

        src = Path(resolve_data("mtbench"))
    else:
        src = Path(path)
        if not src.is_file():
            raise ServingError(f"--prompts {path}: no such file")
    prompts: list[str] = []
    if src.suffix == ".txt":
        prompts = [line.strip() for line in src.read_text().splitlines() if line.strip()]
    elif src.suffix == ".json":
        try:
            data = json.loads(src.read_text())
        except json.JSONDecodeError as e:
            raise ServingError(f"{src}: not valid JSON ({e})") from e
        for i, rec in enumerate(data if isinstance(data, list) else []):
            text = _first_user_turn(rec)
            if text is None:
                raise ServingError(f"{src}: record {i} has no prompt (turns, prompt, messages, conversations)")
            prompts.append(text)
    else:
        with src.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ServingError(f"{src}:{lineno}: not valid JSON ({e})") from e
                text = _first_user_turn(rec)
                if text is None:
                    raise ServingError(
                        f"{src}:{lineno}: no prompt (expected turns, prompt, question, text, messages or conversations)")
                prompts.append(text)
                if num and len(prompts) >= num:
                    break
    if num:
        prompts = prompts[:num]
    if not prompts:
        raise ServingError(f"{src}: no prompts")
    return prompts, str(src)


def encode_chat_prompts(prompts: Sequence[str], tokenizer_path: str, trust_remote_code: bool,
                        chat_template_kwargs: dict[str, Any]) -> list[list[int]]:
    """Token ids of [user prompt] + generation prompt, rendered with the target's own template."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ServingError(f"--tokenizer {tokenizer_path}: cannot load ({type(e).__name__}: {e})") from e
    if not getattr(tok, "chat_template", None):
        raise ServingError(f"--tokenizer {tokenizer_path}: has no chat template")
    out = []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True, **chat_template_kwargs)
        # The template renders BOS itself; adding special tokens again would double it.
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out
