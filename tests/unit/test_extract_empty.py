"""An extraction that would write no sample is refused up front, with the reason, and writes nothing."""

from __future__ import annotations

import json

from helpers_faults import extract_args

from extract.__main__ import main as extract_main
from redraft.catalog.tiny_models import make_tiny_llama


def test_prompt_only_records_without_regenerate_are_refused_by_reason(tmp_path, caplog):
    target = make_tiny_llama(tmp_path / "target", num_layers=4)
    out = tmp_path / "ds"
    assert extract_main(extract_args(target, "mtbench", out)) == 2  # MT-bench holds prompts only
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "data mtbench: no record to extract" in line and "no_assistant_turn: 80" in line
    assert "need --regenerate" in line
    assert not out.exists()  # nothing written half-way


def test_an_input_with_no_record_is_refused(tmp_path, caplog):
    target = make_tiny_llama(tmp_path / "target", num_layers=4)
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"conversations": []}) + "\n" + "not json\n")
    out = tmp_path / "ds"
    assert extract_main(extract_args(target, data, out)) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert f"data {data}: no record to extract" in line and "empty_conversation: 1" in line
    assert not out.exists()


def test_a_max_length_beyond_the_targets_context_is_refused(tmp_path, caplog):
    target = make_tiny_llama(tmp_path / "target", num_layers=4)
    limit = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}]}) + "\n")
    out = tmp_path / "ds"
    assert extract_main(extract_args(target, data, out, max_length=limit + 1)) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert f"max_length={limit + 1} is beyond the target's context" in line
    assert f"max_position_embeddings={limit}" in line
    assert not out.exists()
    assert extract_main(extract_args(target, data, out, max_length=limit)) == 0  # the limit itself is served
