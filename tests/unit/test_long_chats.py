"""redraft.catalog.long_chats: long single-turn chats made of whole transcripts, lengths spread up to a maximum."""

from __future__ import annotations

import pytest

from redraft.catalog import long_chats


def _records(n: int) -> list[dict]:
    return [{"conversations": [{"from": "human", "value": f"hello number {i}"},
                               {"from": "gpt", "value": "fine, and you?"}]} for i in range(n)]


def test_chats_spread_in_length_and_never_share_a_transcript():
    texts = long_chats.transcripts(_records(400))
    assert texts[0] == "A: hello number 0\nB: fine, and you?"
    rows = long_chats.long_chats(3, 10, texts, max_prompt_tokens=600)
    prompts = [r["conversations"][0]["value"].removesuffix(long_chats.REQUEST) for r in rows]
    want = [(i + 0.5) / 3 * 600 * long_chats.CHARS_PER_TOKEN for i in range(3)]
    assert [len(p) for p in prompts] == [int(w) for w in want]  # cut at the length each asks for
    assert prompts[0].startswith(texts[10])  # from the first index asked
    firsts = [texts.index(p.split("\n\n")[0]) for p in prompts]
    assert firsts == sorted(set(firsts))  # each chat starts after the last one's transcripts


def test_too_few_transcripts_is_said():
    with pytest.raises(ValueError, match="too few"):
        long_chats.long_chats(2, 0, long_chats.transcripts(_records(3)), max_prompt_tokens=10_000)


def test_the_builtin_set_is_longest_first():
    rows = long_chats.builtin_records(_records(8000))
    lengths = [len(r["conversations"][0]["value"]) for r in rows]
    assert len(rows) == long_chats.BUILTIN_COUNT and lengths == sorted(lengths, reverse=True)
