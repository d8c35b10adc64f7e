"""benchmarks/regen_throughput.py end to end on a tiny model with two hf batch sizes (the engines that need
vLLM are measured by the script itself; tests/engine/vllm/test_regen_vllm.py covers them)."""

from __future__ import annotations

import json

from benchmarks import regen_throughput
from redraft.catalog.tiny_models import make_tiny_llama


def test_table_and_json(tmp_path, capsys):
    target = make_tiny_llama(tmp_path / "t", seed=4)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Tell me about {i} things."}) + "\n" for i in range(5)))
    out = tmp_path / "r.json"
    assert regen_throughput.main(["--target", str(target), "--data", str(data), "--prompts", "5", "--max-new-tokens",
                                  "4", "--engines", "hf:2,hf:5", "--repeats", "2", "--threads", "1", "--json", str(out),
                                  "--markdown", str(tmp_path / "r.md")]) == 0
    report = json.loads(out.read_text())
    assert report["baseline"] == "hf:2" and list(report["engines"]) == ["hf:2", "hf:5"]
    for r in report["engines"].values():
        assert len(r["runs"]) == 2 and all(run["tokens"] > 0 and run["tokens_per_s"] > 0 for run in r["runs"])
        assert r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
        assert 0 <= r["same_as_baseline"] <= 5 and r["repeats_agree"] in (True, False)
    assert report["engines"]["hf:2"]["ratio_to_baseline"] == 1.0 and report["engines"]["hf:2"]["same_as_baseline"] == 5
    table = capsys.readouterr().out
    assert "| hf:5 |" in table and (tmp_path / "r.md").read_text().strip() in table
