"""benchmarks/extract_throughput.py end to end on a tiny random Llama: the stage's parts, the bare forward on the
same batches, regeneration with hf, the storage table; the JSON must agree with itself."""

from __future__ import annotations

import json
import logging

import pytest

from benchmarks import extract_throughput
from redraft.catalog.tiny_models import make_tiny_llama


def test_json_is_consistent(tmp_path, capsys):
    target = make_tiny_llama(tmp_path / "t", num_layers=6, seed=3)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": "tell me about the cat " * (1 + i % 4)},
        {"from": "gpt", "value": "the cat sat on a mat and ran far " * (1 + i % 3)}]}) + "\n" for i in range(8)))
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    levels = {name: logging.getLogger(name).level for name in ("extract", "redraft")}
    assert extract_throughput.main([
        "--target", str(target), "--data", str(data), "--samples", "6", "--repeats", "2", "--batch-tokens", "256",
        "--topk", "8", "--regenerate", "hf", "--regen-samples", "3", "--max-new-tokens", "4", "--sizes-samples", "3",
        "--threads", "1", "--json", str(out), "--markdown", str(md)]) == 0
    # The benchmark quiets the stage's loggers while it runs and gives them back (later tests log through them).
    assert {name: logging.getLogger(name).level for name in levels} == levels
    report = json.loads(out.read_text())
    plain, regen = report["runs"]
    assert plain["name"] == "no regeneration" and regen["name"] == "regenerate hf"
    assert "--regenerate" not in plain["extract_argv"] and "--regenerate" in regen["extract_argv"]
    assert len(plain["stage"]["runs"]) == 2 and len(plain["bare"]["seconds_runs"]) == 2
    assert plain["samples"] == 6 and plain["batches"] > 1  # 256 padded tokens per batch: several
    for r in report["runs"]:
        n = r["tokens"]
        assert n > 0 and r["padded_tokens"] >= n
        for run in r["stage"]["runs"]:
            assert run["tokens"] == n and sum(run["parts"].values()) == pytest.approx(run["seconds"], abs=0.01)
        assert sum(r["parts_of_median_run"].values()) == pytest.approx(r["stage"]["seconds"]["median"], abs=0.01)
        assert sum(r["shares_of_median_run"].values()) == pytest.approx(1.0)
        for side in ("stage", "bare"):
            rate = r[side]["tok_s"]
            assert rate["min"] <= rate["median"] <= rate["max"]
            assert rate["median"] == pytest.approx(n / r[side]["seconds"]["median"])
        ratio = r["ratio"]
        assert ratio["median"] == pytest.approx(r["stage"]["tok_s"]["median"] / r["bare"]["tok_s"]["median"])
        assert ratio["best"] == pytest.approx(r["stage"]["tok_s"]["max"] / r["bare"]["tok_s"]["max"])
        assert len(ratio["paired"]) == len(r["stage"]["runs"])
        assert (ratio["paired_min"], ratio["paired_max"]) == (min(ratio["paired"]), max(ratio["paired"]))
        assert r["ratio_without_load"]["median"] >= ratio["median"]
    assert {"load", "tokenize", "capture", "teacher", "write", "finalize"} <= set(plain["parts_of_median_run"])
    assert "regenerate" not in plain["parts_of_median_run"] and regen["parts_of_median_run"]["regenerate"] > 0
    sizes = report["bytes_per_token"]
    assert set(sizes) == {"bf16+topk", "bf16+last_hidden", "fp8+topk", "fp8+last_hidden"}
    for s in sizes.values():  # headers and offsets come on top of the layout's rows
        assert s["measured_bytes_per_token"] >= s["layout_bytes_per_token"]
    assert sizes["fp8+last_hidden"]["kimi_k25_bytes_per_token"] < sizes["bf16+last_hidden"]["kimi_k25_bytes_per_token"]
    printed = capsys.readouterr().out
    text = md.read_text()
    assert text.startswith("```bash\npython benchmarks/extract_throughput.py --target")
    assert "| **stage / bare**, median (paired min-max) |" in text and text.split("```\n\n", 1)[1].strip() in printed
