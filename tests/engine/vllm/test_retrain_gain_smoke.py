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
from helpers_embedded import vllm_venv_python
from helpers_paths import ROOT

from redraft.catalog.tiny_models import make_tiny_llama

SCRIPT = ROOT / "benchmarks" / "retrain_gain.py"


def _config(tmp: Path, target: Path) -> Path:
    cfg = {
        "target": str(target), "train_prompts": 6, "max_prompt_chars": 120, "eval_prompts": 2, "max_new_tokens": 6,
        "eval_max_new_tokens": 6, "indomain_eval_prompts": 2, "gen_batch_size": 8, "max_length": 384, "topk": 8, "samples_per_shard": 4,
        "steps_a": 2, "train_jobs": 2, "seeds": 2, "self_prompts": 2,
        "self_options": {"max_samples": 6, "max_new_tokens": 6, "language": "any", "categories": "mtbench"},
        "decontaminate": ["mtbench"], "online": {"steps": 2, "max_samples": 1},
        "train_overrides": {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                            "intermediate_size": 64, "draft_vocab_size": 128, "tokens_per_batch": 256,
                            "val_fraction": 0.0, "eval_every": 0, "save_every": 0, "keep_last": 1, "log_every": 1,
                            "ttt_steps": 3},
        "variants": ["fp8/topk", "bf16/last_hidden"], "storage_samples": 4, "eval_hidden_dtypes": ["bf16", "fp8"], "chain_steps": 3,
        "tree": {"steps": 2, "topk": 2, "num_draft_tokens": 4}, "tree_positions": 4,
    }
    path = tmp / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(config: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--config", str(config), "--out", str(out), "--threads", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_retrain_gain_smoke(tmp_path: Path) -> None:
    vllm_venv_python()  # the online stage runs B in vLLM CPU: skipped without its venv, failed in CI
    target = make_tiny_llama(tmp_path / "target", num_layers=8, heads=(2, 1))  # head_dim 32: vLLM CPU runs it
    config = _config(tmp_path, target)
    out = tmp_path / "bench"
    res = _run(config, out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "B/A tau(chain 3)" in res.stdout

    report = json.loads((out / "report.json").read_text())
    drafters = report["drafters"]
    storage_names = ["S-fp8-topk", "S-fp8-topk.s1", "S-bf16-last_hidden", "S-bf16-last_hidden.s1"]
    assert list(drafters) == ["A", "B", "B.s1", "C", *storage_names]
    # budgets: the planner predicts exactly what the trainer logged (each in its own seed's data order)
    for name, d in drafters.items():
        assert d["planned_tokens"] == d["tokens_seen_metrics"] == d["tokens_seen_rank0"], name
    assert [drafters[n]["seed"] for n in ("B", "B.s1", "S-fp8-topk", "S-fp8-topk.s1")] == [0, 1, 0, 1]
    assert drafters["A"]["data"] == "train-human" and drafters["C"]["data"] == "train-regen-bf16"
    assert drafters["S-fp8-topk"]["data"] == "train-storage-fp8"
    assert drafters["S-bf16-last_hidden.s1"]["data"] == "train-storage-bf16"
    # warm start: every B seed starts from A's checkpoint with the draft vocab rebuilt from its own data, C's
    for b in ("B", "B.s1"):
        assert drafters[b]["init_from"] == drafters["A"]["checkpoint"]
        assert drafters[b]["vocab_coverage_eval"] == drafters["C"]["vocab_coverage_eval"]
        warm = drafters[b]["warm_start"]
        assert warm["vocab"] == "rebuild" and warm["kept_rows"] + warm["new_rows"] == warm["draft_vocab_size"]
    assert drafters["A"]["warm_start"] is None and drafters["C"]["warm_start"] is None
    assert all(0.0 <= d["vocab_coverage_eval"] <= 1.0 for d in drafters.values())

    # the training sets: chitchat openings (A: the humans' replies) and, for B/C, the same openings plus the
    # prompts the target wrote, all answered by the target; every one checked against MT-bench by extract
    ds = report["datasets"]
    self_kept = ds["train-regen-bf16"]["self_prompts"]["counts"]["kept"]
    assert ds["train-human"]["num_samples"] == 6 and ds["train-human"]["self_prompts"] is None
    assert ds["train-regen-bf16"]["num_samples"] == 6 + self_kept
    for name in ("train-human", "train-regen-bf16", "train-storage-bf16", "train-storage-fp8"):
        decon = ds[name]["decontamination"]
        assert decon["sources"] == ["mtbench"] and decon["eval_prompts"] >= 80, name
    assert ds["eval-mtbench-bf16"]["decontamination"] is None
    assert ds["train-storage-bf16"]["num_samples"] == ds["train-storage-fp8"]["num_samples"] == 4
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
    assert set(report["eval"]["chain-fp8"]) == set(storage_names)
    # the in-domain held-out set: unseen chitchat prompts (after the training ones), answered by the target
    assert set(report["eval"]["indomain-chain"]) == {"A", "B", "B.s1", "C"}
    assert ds["eval-chitchat-bf16"]["num_samples"] == 2 and ds["eval-chitchat-bf16"]["generation"]["temperature"] == 0.0
    train_ids = {json.loads(x)["id"] for x in (out / "inputs" / "chitchat-first-6.jsonl").read_text().splitlines()}
    held_ids = {json.loads(x)["id"] for x in (out / "inputs" / "chitchat-heldout-2.jsonl").read_text().splitlines()}
    assert len(held_ids) == 2 and not train_ids & held_ids

    # goals: means over the seeds, each seed's figure kept
    g = report["goals"]["retrain_gain"]
    b_taus = [chain[n]["tau_per_chain_length"]["3"] for n in ("B", "B.s1")]
    assert g["tau3_B_seeds"]["values"] == b_taus and g["tau3_B"] == pytest.approx(sum(b_taus) / 2)
    assert g["ratio_B_over_A"] == pytest.approx(g["tau3_B"] / g["tau3_A"])
    assert report["goals"]["tau_B"]["met"] == (g["tau3_B"] >= 2.0)
    st = report["goals"]["storage"]
    fp8 = [chain[n]["tau_per_chain_length"]["3"] for n in ("S-fp8-topk", "S-fp8-topk.s1")]
    assert st["tau3_fp8_topk_seeds"]["values"] == fp8 and st["tau3_fp8_topk_seeds"]["n"] == 2
    assert st["relative_loss"] == pytest.approx(1 - st["tau3_fp8_topk"] / st["tau3_bf16_last_hidden"])
    gi = report["goals"]["retrain_gain_indomain"]
    assert gi["ratio_B_over_A"] == pytest.approx(gi["tau3_B"] / gi["tau3_A"])
    # B in the engine: vLLM's own counters on the same MT-bench prompt, next to the offline figure
    on = report["goals"]["online_B"]
    online = report["online"]["B"]
    assert on["steps"] == 2 and online["requests"] == 1 and online["all"]["num_drafts"] > 0
    assert on["tau_online"] == pytest.approx(1 + online["all"]["num_accepted_tokens"] / online["all"]["num_drafts"])
    assert on["tau_offline"] == chain["B"]["tau_per_chain_length"]["2"]

    storage = report["storage"]
    assert storage["fp8/topk"]["bytes_per_token"] < storage["bf16/last_hidden"]["bytes_per_token"]
    assert "aux_scale" in storage["fp8/topk"]["bytes_by_key"]

    md = (out / "report.md").read_text()
    for part in ("Storage variants", "| tau chain 3 |", "Stage wall times", "## Seeds", "vLLM CPU", "2 seeds"):
        assert part in md, part
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stages = set(report["stage_seconds"])
    assert {"extract-train-human", "extract-train-regen-bf16", "extract-train-storage-bf16",
            "extract-train-storage-fp8", "extract-eval-bf16", "extract-eval-fp8", "extract-eval-chitchat-bf16",
            *(f"train-{n}" for n in drafters), "eval-chain-bf16", "eval-tree-bf16", "eval-chain-fp8",
            "eval-indomain-chain", "online-B"} == stages

    # rerun: nothing is redone, the checkpoints are untouched, the report is the same
    ckpt = Path(drafters["C"]["checkpoint"]) / "model.safetensors"
    mtime = ckpt.stat().st_mtime_ns
    res2 = _run(config, out)
    assert res2.returncode == 0, res2.stdout[-3000:] + res2.stderr[-3000:]
    again = json.loads((out / "report.json").read_text())
    assert set(again["stages_reused"]) == stages
    assert ckpt.stat().st_mtime_ns == mtime
    assert again["eval"] == report["eval"]

    # a larger retraining budget added to the same folder: only B-x2 trains, only the chain eval reruns
    more = yaml.safe_load(config.read_text())
    more["budget_multiples"] = [2]
    config.write_text(yaml.safe_dump(more))
    res4 = _run(config, out)
    assert res4.returncode == 0, res4.stdout[-3000:] + res4.stderr[-3000:]
    grown = json.loads((out / "report.json").read_text())
    assert set(grown["stages_reused"]) == stages - {"eval-chain-bf16"}
    assert set(grown["stage_seconds"]) == stages | {"train-B-x2"}
    bx2, b = grown["drafters"]["B-x2"], grown["drafters"]["B"]
    assert bx2["init_from"] == drafters["A"]["checkpoint"] and bx2["data"] == "train-regen-bf16"
    assert bx2["planned_tokens"] == bx2["tokens_seen_metrics"] > b["tokens_seen_metrics"]
    assert bx2["steps"] > b["steps"]
    budget = grown["goals"]["tau_B_budget"]
    assert [r["name"] for r in budget["rows"]] == ["B", "B-x2"]
    assert budget["rows"][1]["tau3"] == grown["eval"]["chain-bf16"]["B-x2"]["tau_per_chain_length"]["3"]
    assert grown["goals"]["tau_B"] == report["goals"]["tau_B"]  # the goal stays B's (A's budget)
    assert "## Retraining budget" in (out / "report.md").read_text()

    # other sizes in the same folder are refused by name
    other = yaml.safe_load(config.read_text())
    other["steps_a"] = 3
    config.write_text(yaml.safe_dump(other))
    res3 = _run(config, out)
    assert res3.returncode == 2
    assert "steps_a" in res3.stderr and "use another --out" in res3.stderr
