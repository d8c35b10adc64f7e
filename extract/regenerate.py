"""Let the target write its own assistant turns.

A drafter fitted to answers the target did not write learns the wrong distribution, so
the standard EAGLE-3 recipe replaces every assistant turn with the target's own reply,
turn by turn: the reply to user turn j is generated from the conversation with the
target's replies to turns < j, never the original ones.

Each reply is kept as the ids the target generated (`Message.generation`: the truth the capture
uses, see `extract.generated`) and as text for the next turn's prompt and for `regenerated.jsonl`:
decoded without dropping special tokens, and split at the template's think markers into
`reasoning_content` and `content`, so the reasoning stays where the target put it and the file is a
valid chat input again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from extract.backends.base import GenerationConfig, TargetBackend
from extract.chat import encode_prompt, generation_prompt, stop_token_ids
from extract.generated import prompt_sha256
from extract.records import Generation, Message, Record
from extract.regen_engines import BackendRegenerator, Regenerator

log = logging.getLogger(__name__)

# (open, close) reasoning markers of thinking templates (Kimi, Qwen3, DeepSeek-R1 use <think>).
THINK_MARKERS = (("<think>", "</think>"), ("◁think▷", "◁/think▷"))


def think_markers(tokenizer: Any) -> tuple[str, str] | None:
    """The reasoning markers the chat template knows (its text names the closing one), or None."""
    template = getattr(tokenizer, "chat_template", None) or ""
    text = template if isinstance(template, str) else " ".join(str(v) for v in dict(template).values())
    return next((pair for pair in THINK_MARKERS if pair[1] in text), None)


def split_reasoning(text: str, markers: tuple[str, str] | None, opened: bool) -> tuple[str, str | None]:
    """(content, reasoning_content) of a reply's text, nothing stripped or added.

    `opened`: the generation prompt already opened the reasoning, so the reply starts inside it;
    otherwise a reply that starts with the open marker holds reasoning. A reply cut before the
    close marker is all reasoning. Without markers, or without reasoning, reasoning_content is None.
    """
    if markers is None:
        return text, None
    start, end = markers
    if not opened:
        if not text.startswith(start):
            return text, None
        text = text[len(start):]
    close = text.find(end)
    if close < 0:
        return "", text
    return text[close + len(end):], text[:close]


def generated_message(
    tokenizer: Any, history: Sequence[Message], prompt: Sequence[int], output: Sequence[int], stops: Sequence[int],
    markers: tuple[str, str] | None,
) -> Message:
    """The assistant message for ids the target generated after `prompt` (the render of `history`)."""
    if not output:
        raise ValueError(f"the backend returned no tokens for a prompt of {len(prompt)} tokens")
    finish = "stop" if output and output[-1] in stops else "length"
    body = list(output[:-1]) if finish == "stop" else list(output)
    text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    opened = False
    if markers is not None:
        tail = generation_prompt(tokenizer, history)
        opened = tail.rfind(markers[0]) > tail.rfind(markers[1])
    content, reasoning = split_reasoning(text, markers, opened)
    generation = Generation(tuple(int(t) for t in output), finish, len(prompt), prompt_sha256(prompt))
    return Message(role="assistant", content=content, reasoning_content=reasoning, generation=generation)


def _turns(record: Record) -> tuple[list[Message], list[Message]]:
    """Split a record into its leading system messages and its user turns (assistant turns are dropped)."""
    system = [m for m in record.messages if m.role == "system"]
    users = [m for m in record.messages if m.role == "user"]
    return system, users


def regenerate_records(
    backend: TargetBackend, records: Sequence[Record], gen: GenerationConfig, *, max_length: int,
    max_user_turns: int = 0, regenerator: Regenerator | None = None,
) -> list[Record]:
    """Return the records with every assistant turn written by the target (ids in `Message.generation`).

    Batched across records at each turn index: every prompt of a turn goes to the regenerator at
    once (``extract.regen_engines``; default: the backend's own generate, ``gen.batch_size`` at a
    time), sorted by length so batches pad little, in a fixed order so reruns generate the same ids.
    Each reply may use up to ``gen.max_new_tokens`` and no more than max_length leaves after its prompt.
    A conversation whose prompt no longer fits in max_length keeps the turns it has, ending
    with the unanswered user turn (one left with no assistant turn is later skipped as having
    no loss tokens).
    """
    regenerator = regenerator or BackendRegenerator(backend)
    tokenizer = backend.tokenizer
    stops = stop_token_ids(tokenizer)
    markers = think_markers(tokenizer)
    histories: list[list[Message]] = []
    pending: list[list[Message]] = []
    for record in records:
        system, users = _turns(record)
        if max_user_turns > 0:
            users = users[:max_user_turns]
        histories.append(list(system))
        pending.append(users)
    active = [i for i in range(len(records)) if pending[i]]
    turn = 0
    while active:
        prompts: dict[int, list[int]] = {}
        for i in active:
            histories[i].append(pending[i].pop(0))
            ids = encode_prompt(tokenizer, histories[i])
            if len(ids) >= max_length:
                pending[i].clear()  # this user turn cannot be answered inside max_length: stop here
                continue
            prompts[i] = ids
        order = sorted(prompts, key=lambda i: (len(prompts[i]), i))
        budgets = [max(1, min(gen.max_new_tokens, max_length - len(prompts[i]))) for i in order]
        outputs = regenerator.generate([prompts[i] for i in order], budgets, gen, stops)
        cut = 0
        for i, new_ids in zip(order, outputs, strict=True):
            reply = generated_message(tokenizer, histories[i], prompts[i], new_ids, stops, markers)
            histories[i].append(reply)
            cut += reply.generation is not None and reply.generation.finish_reason == "length"
        log.info("regenerated turn %d for %d conversations (%d cut at the token limit)", turn + 1, len(prompts), cut)
        active = [i for i in prompts if pending[i]]
        turn += 1
    return [replace(record, messages=tuple(h)) for record, h in zip(records, histories, strict=True)]
