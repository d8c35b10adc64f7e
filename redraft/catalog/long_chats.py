"""Long single-turn chats made of chitchat conversations joined end to end, for the long-context lanes.

The embedded data sets are short (chitchat's conversations, MT-bench's questions): nothing in them reaches
past a few hundred tokens. A long chat here is one user turn of whole chitchat transcripts ("A: ..." / "B: ..."
lines) joined until it reaches its length, then a request to continue; the target writes the reply itself
when the chat is extracted with ``--regenerate``, so every assistant token is the target's own. Lengths are
spread evenly up to a maximum so that a set covers every position bucket up to it.

``chitchat-long`` (a built-in data name) is the set the engine-truth lane holds the engines to:
:data:`BUILTIN_COUNT` chats up to :data:`BUILTIN_MAX_PROMPT_TOKENS` prompt tokens, made of the second half of
chitchat (the demo drafter trains on its first conversations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHARS_PER_TOKEN = 4.0  # SmolLM2's tokenizer on chitchat's English, near enough to spread the prompt lengths
REQUEST = "\n\nContinue the last conversation above for several more turns, in the same style."
BUILTIN_COUNT = 2
BUILTIN_MAX_PROMPT_TOKENS = 6_000  # two chats of ~1.6K and ~4.7K prompt tokens: replies past position 4,096


def transcripts(records: Sequence[dict[str, Any]]) -> list[str]:
    """Each ShareGPT record as one transcript, speakers alternating as A and B."""
    out = []
    for record in records:
        turns = record.get("conversations") or []
        text = "\n".join(f"{'AB'[i % 2]}: {str(t.get('value', '')).strip()}" for i, t in enumerate(turns))
        if text:
            out.append(text)
    return out


def long_chats(count: int, first: int, texts: Sequence[str], max_prompt_tokens: int) -> list[dict[str, Any]]:
    """``count`` records, the i-th a user turn of about (i + 0.5) / count * ``max_prompt_tokens`` tokens of
    ``texts`` taken in order from index ``first`` (no transcript in two chats)."""
    rows, cursor = [], first
    for i in range(count):
        want = (i + 0.5) / count * max_prompt_tokens * CHARS_PER_TOKEN
        parts, size = [], 0
        while size < want:
            if cursor >= len(texts):
                raise ValueError(f"{len(texts)} transcripts are too few for {count} chats of up to "
                                 f"{max_prompt_tokens} tokens from index {first}")
            parts.append(texts[cursor])
            size += len(texts[cursor]) + 2
            cursor += 1
        prompt = "\n\n".join(parts)[: int(want)] + REQUEST
        rows.append({"id": f"long-{first}-{i}", "source": "chitchat-joined",
                     "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": "..."}]})
    return rows


def builtin_records(chitchat: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``chitchat-long`` set, longest first (a ``--max-samples N`` keeps the longest N)."""
    texts = transcripts(chitchat)
    return long_chats(BUILTIN_COUNT, len(texts) // 2, texts, BUILTIN_MAX_PROMPT_TOKENS)[::-1]
