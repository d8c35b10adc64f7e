"""read_records: every input format, every skip reason, strict mode, the four file types, round trip."""

from __future__ import annotations

import json
import logging

import pytest

from extract.records import (
    SKIP_REASONS,
    BadRecordError,
    Generation,
    Message,
    Record,
    read_records,
    write_records_jsonl,
)

SHAREGPT = {
    "id": "sg1",
    "conversations": [
        {"from": "system", "value": "Be nice."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "user", "value": "More?"},
        {"from": "chatgpt", "value": "Sure."},
        {"from": "bard", "value": "And"},
        {"from": "model", "value": "more."},
    ],
}
OPENAI = {
    "conversation_id": 7,
    "category": "math",
    "messages": [
        {"role": "developer", "content": "Think."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},
    ],
}
MTBENCH = {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}
PROMPT = {"prompt": "Tell me a joke."}


def write_jsonl(path, rows) -> None:
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r, ensure_ascii=False) + "\n").encode())


def test_formats(tmp_path):
    p = tmp_path / "mix.jsonl"
    write_jsonl(p, [SHAREGPT, OPENAI, MTBENCH, PROMPT])
    res = read_records([p], require_assistant=False)
    assert not res.skipped
    sg, oa, mt, pr = res.records
    assert sg.id == "sg1" and sg.source == "mix" and sg.origin == f"{p}:1" and sg.category is None
    assert [m.role for m in sg.messages] == ["system", "user", "assistant", "user", "assistant", "assistant",
                                            "assistant"]
    assert sg.messages[2] == Message("assistant", "Hello!")
    assert oa.id == "7" and oa.category == "math"
    assert oa.messages == (Message("system", "Think."), Message("user", "2+2?"), Message("assistant", "4", "2+2=4"))
    assert mt.id == "81" and mt.category == "writing"
    assert mt.messages == (Message("user", "Write a poem."), Message("user", "Now shorter."))
    assert pr.id == "mix:4" and pr.messages == (Message("user", "Tell me a joke."),) and pr.origin == f"{p}:4"


def test_require_assistant_skips_prompt_only(tmp_path):
    p = tmp_path / "d.jsonl"
    write_jsonl(p, [SHAREGPT, MTBENCH, PROMPT, {"messages": [{"role": "user", "content": "q"}]}])
    res = read_records([p])
    assert [r.id for r in res.records] == ["sg1"]
    assert res.skipped == {"no_assistant_turn": 3}


BAD_LINES = {
    "invalid_json": b'{"messages": [\n',
    "not_utf8": b'{"prompt": "caf\xe9"}\n',
    "not_object": b"[1, 2]\n",
    "unknown_format": b'{"text": "hello"}\n',
    "unknown_role": b'{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}\n',
    "non_string_content": b'{"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]}\n',
    "no_assistant_turn": b'{"conversations": [{"from": "human", "value": "only me"}]}\n',
    "empty_conversation": b'{"conversations": []}\n',
    "bad_turn_order": b'{"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "yo"}]}\n',
    "bad_generation": b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", '
                      b'"generation": {"output_ids": [], "finish_reason": "stop"}}]}\n',
}


def test_every_skip_reason(tmp_path, caplog):
    assert set(BAD_LINES) == set(SKIP_REASONS)
    p = tmp_path / "bad.jsonl"
    good = (json.dumps(OPENAI) + "\n").encode()
    write_jsonl(p, [good, *BAD_LINES.values(), b"\n", good])
    with caplog.at_level(logging.WARNING, logger="extract.records"):
        res = read_records([p])
    assert res.skipped == {reason: 1 for reason in SKIP_REASONS}
    last = len(BAD_LINES) + 3
    assert [r.origin for r in res.records] == [f"{p}:1", f"{p}:{last}"]  # the blank line is not a record
    assert [r.id for r in res.records] == ["7", "7#2"]
    for lineno, reason in enumerate(BAD_LINES, start=2):
        assert any(f"{p}:{lineno}" in rec.message and reason in rec.message for rec in caplog.records)


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_strict_raises_at_first_bad_record(tmp_path, reason):
    p = tmp_path / "s.jsonl"
    write_jsonl(p, [SHAREGPT, BAD_LINES[reason], SHAREGPT])
    with pytest.raises(BadRecordError) as ei:
        read_records([p], strict=True)
    assert ei.value.origin == f"{p}:2"
    assert ei.value.reason == reason
    assert str(ei.value) == f"{p}:2: {reason}"


def test_more_bad_shapes(tmp_path):
    p = tmp_path / "m.jsonl"
    write_jsonl(p, [
        {"messages": "hi"},  # not a list
        {"messages": ["hi"]},  # a turn that is not an object
        {"conversations": [{"from": "alien", "value": "x"}]},
        {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "x"}]},
        {"prompt": 3},
        {"turns": ["a", 5]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b",
                                                          "reasoning_content": 5}]},
        {"messages": [{"role": "system", "content": "only system"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]},
    ])
    res = read_records([p], require_assistant=False)
    assert res.records == []
    assert res.skipped == {"unknown_format": 1, "not_object": 1, "unknown_role": 1, "non_string_content": 4,
                           "empty_conversation": 1, "bad_turn_order": 1}


def test_skip_log_is_rate_limited(tmp_path, caplog):
    p = tmp_path / "many.jsonl"
    write_jsonl(p, [b"nope\n"] * 50)
    with caplog.at_level(logging.WARNING, logger="extract.records"):
        res = read_records([p])
    assert res.skipped == {"invalid_json": 50}
    assert len(caplog.records) < 25
    assert any("50" in r.getMessage() for r in caplog.records)


def test_ids_dedupe_and_fallback_across_files(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(a, [SHAREGPT, SHAREGPT, {**SHAREGPT, "id": "sg1#2"}])
    no_id = {k: v for k, v in SHAREGPT.items() if k != "id"}
    write_jsonl(b, [no_id, SHAREGPT])
    res = read_records([a, b])
    assert [r.id for r in res.records] == ["sg1", "sg1#2", "sg1#2#2", "b:1", "sg1#3"]
    assert [r.source for r in res.records] == ["a", "a", "a", "b", "b"]
    assert len(read_records([a, b], max_records=2).records) == 2
    assert [r.id for r in read_records([b, a], max_records=3).records] == ["b:1", "sg1", "sg1#2"]


def test_file_types(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [SHAREGPT, {**SHAREGPT, "id": "sg2"}]
    expected = read_records([_jsonl(tmp_path, rows)]).records

    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(rows))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"version": 1, "data": rows}))
    single = tmp_path / "single.json"
    single.write_text(json.dumps(rows[0]))
    pq = tmp_path / "table.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(dd))

    for path, source in [(arr, "arr"), (wrapped, "wrapped"), (pq, "table"), (folder, "saved"), (dd, "dd")]:
        res = read_records([path])
        assert [r.messages for r in res.records] == [r.messages for r in expected], path
        assert [r.id for r in res.records] == ["sg1", "sg2"]
        assert [r.origin for r in res.records] == [f"{path}:#0", f"{path}:#1"]
        assert {r.source for r in res.records} == {source}
    assert [r.id for r in read_records([single]).records] == ["sg1"]

    two = tmp_path / "two"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows)}).save_to_disk(str(two))
    with pytest.raises(ValueError, match="train.*test|test.*train"):
        read_records([two])


def _jsonl(tmp_path, rows):
    p = tmp_path / "ref.jsonl"
    write_jsonl(p, rows)
    return p


def test_bad_paths_always_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_records([tmp_path / "missing.jsonl"])
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(ValueError, match="data.csv"):
        read_records([odd])
    plain = tmp_path / "plain_dir"
    plain.mkdir()
    with pytest.raises(ValueError, match="plain_dir"):
        read_records([plain])
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(ValueError, match="broken.json"):
        read_records([broken])
    ambiguous = tmp_path / "amb.json"
    ambiguous.write_text(json.dumps({"a": [], "b": []}))
    with pytest.raises(ValueError, match="amb.json"):
        read_records([ambiguous], strict=False)


def test_write_read_round_trip(tmp_path):
    records = [
        Record("x1", (Message("system", "S"), Message("user", "Ünïcode ☕"), Message("assistant", "A", "why")),
               "chat", "misc", "orig:1"),
        Record("x2", (Message("user", "Q"),), "mtbench", None, "orig:2"),
        Record("x3", (Message("user", "Q"), Message("assistant", "A", "r", Generation((5, 0, 7), "length", 12, "ab" * 32))),
               "regen", None, "orig:3"),
    ]
    out = tmp_path / "sub" / "out.jsonl"
    write_records_jsonl(out, records)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]  # no temp file left
    assert "☕" in out.read_text(encoding="utf-8")
    back = read_records([out], require_assistant=False).records
    assert [(r.id, r.messages, r.source, r.category) for r in back] == [
        (r.id, r.messages, r.source, r.category) for r in records
    ]
    assert [r.origin for r in back] == [f"{out}:1", f"{out}:2", f"{out}:3"]
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert first["messages"][2] == {"role": "assistant", "content": "A", "reasoning_content": "why"}


def test_write_failure_keeps_old_file(tmp_path):
    out = tmp_path / "keep.jsonl"
    out.write_text("old\n")

    def boom():
        yield Record("a", (Message("user", "q"),), "s", None, "o")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_records_jsonl(out, boom())
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]
