"""benchmarks/retrain_gain.py end to end at a tiny scale, then rerun to prove finished stages are reused.

The real chitchat/MT-bench data and the real CLIs (extract, train/main.py, eval.acceptance) run as
subprocesses; the target is a tiny random Llama (the script takes any local HF folder) so that the
~13 subprocesses fit in a few minutes on a shared 2-core machine. The figures themselves mean
nothing at this size; what is checked is the plumbing: budgets, warm start, storage accounting,
report files and resumability.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "retrain_gain.py"


def _config(tmp: Path, target: Path) -> Path:
    cfg = {
        "target": str(target), "train_prompts": 6, "max_prompt_chars": 120, "eval_prompts": 2, "max_new_tokens": 6,
        "eval_max_new_tokens": 6, "indomain_eval_prompts": 2, "gen_batch_size": 8, "max_length": 384, "topk": 8, "samples_per_shard": 4,
        "steps_a": 2, "train_jobs": 2,
        "train_overrides": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "intermediate_size": 64, "draft_vocab_size": 128, "tokens_per_batch": 256,
                            "val_fraction": 0.0, "eval_every": 0, "save_every": 0, "keep_last": 1, "log_every": 1,
                            "ttt_steps": 3},
        "variants": ["bf16/topk", "fp8/last_hidden"], "eval_hidden_dtypes": ["bf16", "fp8"], "chain_steps": 3,
        "tree": {"steps": 2, "topk": 2, "num_draft_tokens": 4}, "tree_positions": 4,
    }
    path = tmp / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(config: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--config", str(config), "--out", str(out), "--threads", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_retrain_gain_smoke(tmp_path: Path) -> None:
    target = make_tiny_llama(tmp_path / "target", num_layers=8)
    config = _config(tmp_path, target)
    out = tmp_path / "bench"
    res = _run(config, out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "B/A tau(chain 3)" in res.stdout

    report = json.loads((out / "report.json").read_text())
    drafters = report["drafters"]
    assert list(drafters) == ["A", "B", "C", "S-fp8-last_hidden"]
    # budgets: the planner predicts exactly what the trainer logged, and B/C/S share one step count
    for name, d in drafters.items():
        assert d["planned_tokens"] == d["tokens_seen_metrics"] == d["tokens_seen_rank0"], name
    assert drafters["B"]["steps"] == drafters["C"]["steps"] == drafters["S-fp8-last_hidden"]["steps"]
    assert drafters["A"]["data"] == "train-human" and drafters["C"]["data"] == "train-regen-bf16"
    assert drafters["S-fp8-last_hidden"]["data"] == "train-regen-fp8"
    # warm start: B starts from A's checkpoint with the draft vocab rebuilt from its own data, which is C's
    assert drafters["B"]["init_from"] == drafters["A"]["checkpoint"]
    assert drafters["B"]["vocab_coverage_eval"] == drafters["C"]["vocab_coverage_eval"]
    warm = drafters["B"]["warm_start"]
    assert warm["vocab"] == "rebuild" and warm["kept_rows"] + warm["new_rows"] == warm["draft_vocab_size"]
    assert drafters["A"]["warm_start"] is None and drafters["C"]["warm_start"] is None
    assert all(0.0 <= d["vocab_coverage_eval"] <= 1.0 for d in drafters.values())

    # same prompts, the target's replies vs the humans'
    ds = report["datasets"]
    assert ds["train-human"]["num_samples"] == ds["train-regen-bf16"]["num_samples"] == 6
    assert ds["train-regen-bf16"]["generation"]["temperature"] == 0.0
    assert ds["train-human"]["generation"] is None
    assert ds["eval-mtbench-bf16"]["num_samples"] == 2
    assert ds["eval-mtbench-fp8"]["hidden_dtype"] == "fp8"

    chain = report["eval"]["chain-bf16"]
    assert set(chain) == set(drafters)
    for r in chain.values():
        assert r["evaluation"] == "exact"
        assert sorted(r["tau_per_chain_length"]) == ["1", "2", "3"]
        assert all(0.0 <= p <= 1.0 for p in r["accept_rate"])
        assert r["tau_per_chain_length"]["3"] >= r["tau_per_chain_length"]["1"] >= 1.0
    assert set(report["eval"]["tree-bf16"]) == {"A", "B", "C"}
    assert report["eval"]["tree-bf16"]["A"]["settings"]["topk"] == 2
    assert set(report["eval"]["chain-fp8"]) == {"C", "S-fp8-last_hidden"}
    # the in-domain held-out set: unseen chitchat prompts (after the training ones), answered by the target
    assert set(report["eval"]["indomain-chain"]) == {"A", "B", "C"}
    assert ds["eval-chitchat-bf16"]["num_samples"] == 2 and ds["eval-chitchat-bf16"]["generation"]["temperature"] == 0.0
    train_ids = {json.loads(x)["id"] for x in (out / "inputs" / "chitchat-first-6.jsonl").read_text().splitlines()}
    held_ids = {json.loads(x)["id"] for x in (out / "inputs" / "chitchat-heldout-2.jsonl").read_text().splitlines()}
    assert len(held_ids) == 2 and not train_ids & held_ids
    gi = report["goals"]["retrain_gain_indomain"]
    assert gi["ratio_B_over_A"] == pytest.approx(gi["tau3_B"] / gi["tau3_A"])

    storage = report["storage"]
    assert storage["fp8/last_hidden"]["bytes_per_token"] < storage["bf16/topk"]["bytes_per_token"]
    assert "aux_scale" in storage["fp8/last_hidden"]["bytes_by_key"]
    g = report["goals"]["retrain_gain"]
    assert g["ratio_B_over_A"] == pytest.approx(g["tau3_B"] / g["tau3_A"])
    assert "storage" not in report["goals"]  # needs fp8/topk and bf16/last_hidden, not in this run

    md = (out / "report.md").read_text()
    assert "Storage variants" in md and "| tau chain 3 |" in md and "Stage wall times" in md
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stages = set(report["stage_seconds"])
    assert {"extract-train-human", "extract-train-regen-bf16", "extract-train-regen-fp8", "extract-eval-bf16",
            "extract-eval-fp8", "extract-eval-chitchat-bf16", "train-A", "train-B", "train-C", "train-S-fp8-last_hidden", "eval-chain-bf16",
            "eval-tree-bf16", "eval-chain-fp8", "eval-indomain-chain"} == stages

    # rerun: nothing is redone, the checkpoints are untouched, the report is the same
    ckpt = Path(drafters["C"]["checkpoint"]) / "model.safetensors"
    mtime = ckpt.stat().st_mtime_ns
    res2 = _run(config, out)
    assert res2.returncode == 0, res2.stdout[-3000:] + res2.stderr[-3000:]
    again = json.loads((out / "report.json").read_text())
    assert set(again["stages_reused"]) == stages
    assert ckpt.stat().st_mtime_ns == mtime
    assert again["eval"] == report["eval"]

    # other sizes in the same folder are refused by name
    other = yaml.safe_load(config.read_text())
    other["steps_a"] = 3
    config.write_text(yaml.safe_dump(other))
    res3 = _run(config, out)
    assert res3.returncode == 2
    assert "steps_a" in res3.stderr and "use another --out" in res3.stderr
