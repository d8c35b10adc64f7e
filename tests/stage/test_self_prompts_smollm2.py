"""`--data self` end to end on the real SmolLM2: it writes its own prompts, answers them, captures them, resumes."""

from __future__ import annotations

import json

from extract.__main__ import main as extract_main
from extract.config import parse_args
from extract.pipeline import run_extraction
from extract.prompt_filters import EvalSet, FilterSettings
from extract.records import read_records
from extract.self_prompts import SELF_DIR, SELF_NAME, eval_prompts
from redraft.core.dataset.format import MANIFEST_NAME
from redraft.core.dataset.reader import DatasetReader


def test_smollm2_writes_answers_and_captures_its_own_prompts(tmp_path, monkeypatch):
    """8 prompts written by the real SmolLM2 go through regeneration and capture; a rerun resumes."""
    from helpers_embedded import SMOLLM2, smollm2_dir

    folder = smollm2_dir()
    monkeypatch.setenv("REDRAFT_CACHE", str(folder.parent))
    out = tmp_path / "ds"
    argv = ["--target", SMOLLM2, "--data", "self", "--regenerate", "--self-prompts", "8",
            "--self-max-new-tokens", "64", "--max-new-tokens", "8", "--max-length", "160", "--topk", "4",
            "--out", str(out), "--rank", "0", "--world-size", "1"]
    assert extract_main(argv) == 0

    prompts = read_records([out / SELF_NAME], require_assistant=False, strict=True).records
    assert len(prompts) == 8 and all(r.source == "self" and len(r.messages) == 1 for r in prompts)
    texts = [r.messages[0].content for r in prompts]
    assert len(set(texts)) == 8
    evals = EvalSet(eval_prompts(["mtbench"]), FilterSettings())
    assert all(evals.match(t) is None for t in texts)

    manifest = json.loads((out / MANIFEST_NAME).read_text())
    sp = manifest["self_prompts"]
    counts = sp["counts"]
    assert counts["kept"] == 8
    assert counts["sampled"] == counts["survived"] + sum(counts["dropped"].values())
    assert counts["left_after"]["near_duplicate"] == counts["survived"] >= 8
    assert sp["recipe"]["target"] == SMOLLM2 and sp["recipe"]["temperature"] == 1.0
    assert "SmolLM" in sp["recipe"]["prefixes"][""]["text"]  # the template's default system prompt
    assert sp["recipe"]["decontaminate"]["prompts"] == 160
    reader = DatasetReader(out)
    assert len(reader) == 8
    regenerated = read_records([out / "regenerated.jsonl"], strict=True).records
    assert [r.messages[0].content for r in regenerated] == texts  # the prompts as written, answered

    # A rerun resumes: no prompt is sampled and no shard redone, so none of those files is rewritten
    # (checked on the files, not the log, whose capture depends on what earlier tests did to logging).
    kept = [out / SELF_NAME, *sorted((out / SELF_DIR).iterdir()), *sorted(out.rglob("shard-*.safetensors"))]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in kept}
    summary = run_extraction(parse_args(argv))
    assert (summary.shards_written, summary.shards_reused) == (0, 1)
    assert sorted((out / SELF_DIR).iterdir()) == sorted(p for p in kept if p.parent == out / SELF_DIR)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in kept} == before
    assert extract_main([*argv, "--self-top-p", "0.5"]) == 2  # another recipe in the same folder
