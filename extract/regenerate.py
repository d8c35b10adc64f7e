"""Let the target write its own assistant turns.

A drafter fitted to answers the target did not write learns the wrong distribution, so
the standard EAGLE-3 recipe replaces every assistant turn with the target's own reply,
turn by turn: the reply to user turn j is generated from the conversation with the
target's replies to turns < j, never the original ones.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from extract.backends.base import GenerationConfig, TargetBackend
from extract.chat import encode_prompt, stop_token_ids
from extract.records import Message, Record

log = logging.getLogger(__name__)


def _turns(record: Record) -> tuple[list[Message], list[Message]]:
    """Split a record into its leading system messages and its user turns (assistant turns are dropped)."""
    system = [m for m in record.messages if m.role == "system"]
    users = [m for m in record.messages if m.role == "user"]
    return system, users


def regenerate_records(
    backend: TargetBackend, records: Sequence[Record], gen: GenerationConfig, *, max_length: int,
    max_user_turns: int = 0,
) -> list[Record]:
    """Return the records with every assistant turn written by the target.

    Batched across records at each turn index; prompts are sorted by length inside a
    turn so batches pad little, and the order is fixed so reruns generate the same text.
    A conversation whose prompt no longer fits in max_length keeps the turns it has, ending
    with the unanswered user turn (one left with no assistant turn is later skipped as having
    no loss tokens).
    """
    tokenizer = backend.tokenizer
    stops = stop_token_ids(tokenizer)
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
        for start in range(0, len(order), gen.batch_size):
            chunk = order[start : start + gen.batch_size]
            budget = max(1, min(gen.max_new_tokens, max_length - max(len(prompts[i]) for i in chunk)))
            outputs = backend.generate([prompts[i] for i in chunk], replace(gen, max_new_tokens=budget), stops)
            for i, new_ids in zip(chunk, outputs, strict=True):
                if new_ids and new_ids[-1] in stops:
                    new_ids = new_ids[:-1]
                text = tokenizer.decode(new_ids, skip_special_tokens=True)
                histories[i].append(Message(role="assistant", content=text))
        log.info("regenerated turn %d for %d conversations", turn + 1, len(prompts))
        active = [i for i in prompts if pending[i]]
        turn += 1
    return [replace(record, messages=tuple(h)) for record, h in zip(records, histories, strict=True)]
