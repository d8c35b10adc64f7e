"""Token-exact regeneration on the embedded SmolLM2: a reply that ends its turn and one cut at the limit, both
stored as the target generated them."""

from __future__ import annotations

import json

from helpers_regen import assert_stored_as_generated, extract_cfg, recording_backend, stored_samples
from transformers import AutoTokenizer

import extract.pipeline as pipeline
from extract.chat import stop_token_ids


def test_smollm2_replies_are_stored_as_generated(tmp_path, monkeypatch):
    """The embedded target: one reply that ends with <|im_end|>, one cut at the limit, both as generated."""
    from helpers_embedded import smollm2_dir

    target = smollm2_dir()
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "short", "prompt": "What is the capital of France? Answer with one word."})
                    + "\n" + json.dumps({"id": "long", "prompt": "Write a long story about the sea."}) + "\n")
    calls = recording_backend(monkeypatch)
    summary = pipeline.run_extraction(extract_cfg(target, data, tmp_path / "ds", regenerate=True, max_new_tokens=24,
                                           max_length=256, topk=4))
    tok = AutoTokenizer.from_pretrained(target)
    stops = set(stop_token_ids(tok))
    ended = {"France" in tok.decode(p): o[-1] in stops for p, o in calls}
    assert ended == {True: True, False: False}  # the one-word answer ends with <|im_end|>, the story is cut
    assert_stored_as_generated(stored_samples(tmp_path / "ds"), calls, stops)
    assert summary.manifest["regeneration"] == {"samples": 2, "turns": 2, "mismatched_samples": 0, "cut_samples": 1,
                                                "first_mismatches": []}
