"""Tokenize conversations with the target's own chat template and mask exactly the assistant tokens.

The drafter must learn what the target generates, so the loss mask covers what the target
would produce after its generation prompt: the assistant content (plus reasoning, when the
template renders it) and the end-of-turn token. Spans are found on the rendered text, not by
per-template regexes: for assistant message i, the render of messages[:i] with the
generation prompt marks where the turn starts, and the render of messages[:i+1] marks where
it ends. Templates that render history differently from the last turn (Kimi/DeepSeek
thinking templates drop historical reasoning) break the second prefix; for those the end is
found per turn by re-rendering the full conversation with that turn's content swapped for a
sentinel (see `_history_turn_end`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from extract.records import Message

logger = logging.getLogger(__name__)

# End-of-turn tokens of common template families; kept only when present in the vocab.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<｜end▁of▁sentence｜>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)
_warned_dropped_reasoning = False


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the target generates in assistant turns
    truncated: bool


def _to_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # template errors (raise_exception, bad roles) come in many types
        raise ValueError(f"chat template failed on {len(messages)} messages: {type(e).__name__}: {e}") from e
    if not isinstance(text, str):
        raise ValueError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    # The template already renders BOS and other specials: adding them again would double BOS.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of the conversation plus the generation prompt, for regenerating the next assistant turn."""
    return _encode(tokenizer, _render(tokenizer, _to_dicts(messages), add_generation_prompt=True))


def generation_prompt(tokenizer: Any, messages: Sequence[Message]) -> str:
    """The text the template appends to open the assistant's turn (e.g. ChatML's '<|im_start|>assistant\\n';
    thinking templates may end it with an open '<think>', so the reply starts inside the reasoning)."""
    msgs = _to_dicts(messages)
    with_prompt = _render(tokenizer, msgs, add_generation_prompt=True)
    without = _render(tokenizer, msgs, add_generation_prompt=False)
    return with_prompt[_common_prefix_len(with_prompt, without):]


USER_SENTINEL = "REDRAFTUSERTURNSENTINEL"


def user_turn_prefix(tokenizer: Any, system: str | None = None) -> list[int]:
    """Token ids of a conversation up to where the first user message's content starts.

    Rendered with a sentinel user message and cut before it, so whatever the template puts in front
    (BOS, a default system prompt such as SmolLM2's, the user header) is there exactly as the template
    writes it; ``system``: a system message of our own instead of the template's default. A target
    continuing these ids writes a user request (the Magpie recipe, Xu et al. 2024).
    """
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": USER_SENTINEL}]
    text = _render(tokenizer, msgs, add_generation_prompt=False)
    cut = text.find(USER_SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not render the user message's content verbatim; "
                         "cannot find where a user turn starts")
    ids = _encode(tokenizer, text[:cut])
    if not ids:
        raise ValueError("the chat template renders nothing before the user message's content")
    probe = _encode(tokenizer, _render(tokenizer, msgs[:-1] + [{"role": "user", "content": "Hello there"}],
                                       add_generation_prompt=False))
    if probe[: len(ids)] != ids:
        logger.warning("the user-turn prefix tokenizes differently inside a rendered conversation; "
                       "prompts are sampled from the prefix's own ids")
    return ids


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end an assistant turn: eos first, then known end-of-turn tokens present in the vocab."""
    vocab = tokenizer.get_vocab()
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for i in eos if isinstance(eos, list) else [eos]:
        if i is not None and i not in ids:
            ids.append(int(i))
    for tok in END_OF_TURN_TOKENS:
        i = vocab.get(tok)
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix_len(a: str, b: str, limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


def _sentinel(content: str) -> str:
    """A replacement whose first and last chars differ from content's, so the diff stops exactly at it."""
    first = "\x01" if not content.startswith("\x01") else "\x02"
    last = "\x03" if not content.endswith("\x03") else "\x04"
    return first + "SENTINEL" + last


def _content_span(tokenizer: Any, msgs: list[dict[str, Any]], i: int, rendered: str) -> tuple[int, int]:
    """Character span of message i's content inside `rendered` (the render of `msgs`)."""
    alt = [dict(m) for m in msgs]
    alt[i]["content"] = _sentinel(msgs[i]["content"])
    other = _render(tokenizer, alt, add_generation_prompt=False)
    start = _common_prefix_len(rendered, other)
    end = len(rendered) - _common_suffix_len(rendered, other, min(len(rendered), len(other)) - start)
    return start, end


def _history_turn_end(tokenizer: Any, msgs: list[dict[str, Any]], i: int, full: str, start: int) -> int:
    """End of assistant turn i in `full` when the template renders the turn differently as history.

    The last-turn render (messages[:i+1]) gives the end-of-turn text that follows the content;
    the full render with turn i's content replaced gives where the content sits in the history
    form. The turn ends after the content plus that same end-of-turn text.
    """
    last = _render(tokenizer, msgs[: i + 1], add_generation_prompt=False)
    _, last_content_end = _content_span(tokenizer, msgs[: i + 1], i, last)
    eot_text = last[last_content_end:]
    _, content_end = _content_span(tokenizer, msgs, i, full)
    if content_end < start or not full.startswith(eot_text, content_end):
        raise ValueError(
            f"cannot mask assistant message {i}: the template renders it differently as history and "
            f"its end-of-turn text {eot_text!r} does not follow its content in the full conversation"
        )
    return content_end + len(eot_text)


def _trim_after_stop(text: str, start: int, end: int, stop_strings: Sequence[str]) -> int:
    """Drop template whitespace after the final end-of-turn token (ChatML's '\\n'): the model never emits it."""
    span = text[start:end]
    stripped = span.rstrip()
    if len(stripped) < len(span) and any(stripped.endswith(s) for s in stop_strings):
        return start + len(stripped)
    return end


def assistant_char_spans(tokenizer: Any, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn in it."""
    global _warned_dropped_reasoning
    msgs = _to_dicts(messages)
    full = _render(tokenizer, msgs, add_generation_prompt=False)
    stop_strings = [s for s in (tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids(tokenizer)) if s]
    # `history` mirrors how the full render shows earlier turns: once a turn is found rendered in
    # history form, later prompts render it without reasoning, as the template does in the full text.
    history = [dict(m) for m in msgs]
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = _render(tokenizer, history[:i], add_generation_prompt=True)
        start = _common_prefix_len(prompt, full)
        if start < len(prompt):
            # The generation prompt diverges from the history form (e.g. it opens <think> while
            # history renders <think></think>): what follows the shared part is generated text.
            logger.debug("generation prompt for message %d is not a prefix; using the shared part", i)
        prev_end = spans[-1][1] if spans else 0
        if start < prev_end or start < len(_render(tokenizer, history[:i], add_generation_prompt=False)):
            raise ValueError(
                f"cannot mask assistant message {i}: the prompt rendered for it is not a prefix of the "
                f"full conversation (the template renders earlier turns differently in history)"
            )
        upto = _render(tokenizer, history[: i + 1], add_generation_prompt=False)
        if full.startswith(upto) and len(upto) >= start:
            end = len(upto)
        else:
            end = _history_turn_end(tokenizer, msgs, i, full, start)
            history[i].pop("reasoning_content", None)
        end = _trim_after_stop(full, start, end, stop_strings)
        if end <= start:
            raise ValueError(f"cannot mask assistant message {i}: empty span in the rendered conversation")
        reasoning = m.get("reasoning_content")
        if reasoning and reasoning not in full[start:end] and not _warned_dropped_reasoning:
            _warned_dropped_reasoning = True
            logger.warning(
                "the chat template dropped reasoning_content of assistant message %d; it is not trained on "
                "(templates that strip historical reasoning do this; logged once)", i
            )
        spans.append((start, end))
    return full, spans


def _mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    j = 0
    for t, (a, b) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        if j < len(spans) and b > a and spans[j][0] <= a and b <= spans[j][1]:
            mask[t] = 1
    return mask


def _tokenize_by_segments(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Slow tokenizers have no offsets: encode the text piecewise at span boundaries."""
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for a, b in spans:
        for seg, flag in ((text[pos:a], 0), (text[a:b], 1)):
            if seg:
                part = _encode(tokenizer, seg)
                ids += part
                mask += [flag] * len(part)
        pos = b
    if pos < len(text):
        part = _encode(tokenizer, text[pos:])
        ids += part
        mask += [0] * len(part)
    return ids, mask


def tokenize_conversation(tokenizer: Any, messages: Sequence[Message], max_length: int) -> TokenizedSample:
    """Render with the chat template, tokenize once, and mask the assistant turns; truncate to max_length."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    text, spans = assistant_char_spans(tokenizer, messages)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = _mask_from_offsets(enc["offset_mapping"], spans)
    else:
        ids, mask = _tokenize_by_segments(tokenizer, text, spans)
    truncated = len(ids) > max_length
    return TokenizedSample(ids[:max_length], mask[:max_length], truncated)


def sha256_json(obj: Any) -> str:
    """SHA-256 of ``obj`` as canonical JSON (sorted keys): the fingerprint every recipe and plan records."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """Hash of what maps text to ids (model vocab/merges, added tokens, normalizer, pre-tokenizer).

    Truncation/padding/post-processor state is left out: transformers changes it at run time
    and on load, and it does not change the ids of our encodes (add_special_tokens=False).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        keep = {k: state.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer")}
        return sha256_json(keep)
    added = {str(k): v for k, v in (getattr(tokenizer, "added_tokens_encoder", None) or {}).items()}
    return sha256_json({"vocab": sorted(tokenizer.get_vocab().items()), "added": sorted(added.items())})


def chat_template_hash(tokenizer: Any) -> str:
    """Hash of the chat template text (all named templates, when there are several)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    if isinstance(template, str):
        return hashlib.sha256(template.encode("utf-8")).hexdigest()
    return sha256_json(template)
