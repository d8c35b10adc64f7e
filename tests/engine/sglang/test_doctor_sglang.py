"""serve.doctor against a live SGLang 0.5.23 server (SGLang's own engine on the CPU, redraft's stand-in for its
kernels) speculating with the SmolLM2 logit-lens drafter, started with no --max-running-requests: what a team gets
from SGLang's defaults. The doctor must read the engine, its version and the drafter folder from the server's own
/server_info, find the cap of 48 running requests (set by SGLang when it speculates, not asked for on the launch
line) and size the fix from the server's own KV budget; the drafter's layer ids are the ones this version reads
as trained, so no layer finding. A copy of the drafter's folder that says it drafts fewer positions than the server
serves is found with the length to write, and one whose ids are one layer off with the ids to write. Beside a base
server (the target alone) at 1 and 4 streams, the same server's steps past the crossover are found, with the fix in
SGLang's words.

Two healthy deployments: the drafter fitted to the probe's traffic (helpers_embedded.smollm2_fitted_drafter) served as
a chain (beside the base: it pays at 1 and 4 streams) and as a tree, each with an explicit --max-running-requests: no
finding at all, exit 0. Four server starts (the base shared), a few short requests each; every server sleeps when
idle (redraft.engines.sglang.cpu_engine_kwargs), or an idle one would hold a core of the two.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers_embedded import (
    sglang_venv_python,
    smollm2_dir,
    smollm2_fitted_drafter,
    smollm2_logit_lens_drafter,
)

from eval.export import ExportConfig, export_checkpoint
from redraft.engines.sglang import SGLangServer
from serve import doctor
from serve import doctor_findings as rules

STEPS = 2
FIT_PROMPTS, FIT_TOKENS = 4, 32  # the healthy deployments' traffic: the drafter is fitted to it, the probe sends it


@pytest.fixture(scope="module")
def base():
    """The same target served by SGLang without a drafter: what the doctor measures a speed-up against."""
    kwargs = {"model_path": str(smollm2_dir()), "dtype": "float32", "context_length": 1024, "max_running_requests": 8}
    with SGLangServer(kwargs, python=sglang_venv_python()) as srv:
        yield srv


def test_the_doctor_finds_the_cap_a_misread_folder_and_steps_past_the_crossover(base, tmp_path, capsys):
    py = sglang_venv_python()
    ckpt = smollm2_logit_lens_drafter(tmp_path / "ckpt")
    export = export_checkpoint(ExportConfig(ckpt=str(ckpt), out=str(tmp_path / "export"), format="sglang",
                                            target=str(smollm2_dir()), dtype="fp32")).out
    kwargs = {"model_path": str(smollm2_dir()), "dtype": "float32", "context_length": 1024,
              "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(export),
              "speculative_num_steps": STEPS, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": STEPS + 1}
    out = tmp_path / "doctor.json"
    short = tmp_path / "short-context"  # the served drafter's folder, saying it drafts 512 of the 1,024 positions
    shutil.copytree(export, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    off = tmp_path / "one-layer-off"  # the served drafter's folder, its ids one layer below those it was trained on
    shutil.copytree(export, off)
    config = json.loads((off / "config.json").read_text())
    written = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in written]
    (off / "config.json").write_text(json.dumps(config))
    with SGLangServer(kwargs, python=py) as srv:
        # beside the base at 1 and 4 streams: what runs, the cap, and the poor drafter's steps past the crossover
        rc = doctor.main(["--url", srv.url, "--base-url", base.url, "--tokenizer", str(smollm2_dir()),
                          "--concurrency", "1,4", "--num-prompts", "4", "--max-tokens", "24", "--max-seconds", "300",
                          "--json", str(out)])
        assert doctor.main(["--url", srv.url, "--drafter", str(short), "--concurrency", "1", "--num-prompts", "1",
                            "--max-tokens", "8", "--json", str(tmp_path / "short.json")]) == doctor.FINDINGS
        assert doctor.main(["--url", srv.url, "--drafter", str(off), "--concurrency", "1", "--num-prompts", "1",
                            "--max-tokens", "8", "--json", str(tmp_path / "off.json")]) == doctor.FINDINGS
    result = json.loads(out.read_text())
    ratio = {r["concurrency"]: r["aggregate_tok_s"]["ratio"] for r in result["probe"]["comparison"]}
    assert ratio[4] < 1.0, f"the fault was not planted: the drafter paid at 4 streams here ({ratio})"
    findings = {f["code"]: f for f in result["findings"]}
    assert "4" in findings["loses-at-concurrency"]["title"]
    plan = {p["concurrency"]: p for p in result["probe"]["draft_plan"]}
    assert set(plan) == {1, 4} and plan[4]["best_k"] < STEPS  # never keeps every step where it loses
    fix = findings["loses-at-concurrency"]["fix"]  # in SGLang's words: its adaptive steps, or the steps that pay
    assert ("--speculative-adaptive" in fix) == any(p["best_k"] for p in plan.values())
    assert "num_speculative_tokens_per_batch_size" not in fix
    off_findings = {f["code"]: f for f in json.loads((tmp_path / "off.json").read_text())["findings"]}
    assert str(sorted(written)) in off_findings["layer-ids-misread"]["fix"]  # the ids SGLang 0.5.23 reads as trained
    assert "0.5.23" in off_findings["layer-ids-misread"]["title"]
    short_findings = {f["code"]: f for f in json.loads((tmp_path / "short.json").read_text())["findings"]}
    assert "1,024" in short_findings["context-length"]["evidence"]
    assert "set max_position_embeddings to 1024" in short_findings["context-length"]["fix"]
    running = result["running"]
    assert result["engine"] == "sglang" and running["version"].startswith("0.5.23")
    assert running["speculative_num_steps"] == STEPS and running["max_running_requests"] == 48
    assert "--max-running-requests" not in running["launch_command"]
    assert result["drafter"]["folder"] == str(export)  # found from the server's own draft model path
    level = result["probe"]["levels"][0]
    assert level["ok"] == level["requests"] >= 2 and level["accept_length"] >= 1.0
    assert 0 < result["probe"]["seconds"] < 120  # the bound for a probe on a CPU (both servers, both levels)
    rates = level["accept_per_pos"]  # from SGLang's per-request histograms (empty when no round accepted a draft)
    assert isinstance(rates, list) and len(rates) <= STEPS
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # a chain accepts a prefix
    cap = findings["sglang-cap-48"]
    kv = running["max_total_num_tokens"]
    assert isinstance(kv, int) and f"{kv:,}" in cap["evidence"]
    assert "--max-running-requests" in cap["fix"]
    assert not {"layer-ids-misread", "layer-ids-unknown", "context-length", "requests-fail"} & set(findings)
    # the logit-lens drafter fits no chat traffic: found by the engine's own acceptance at one stream
    assert ("drafter-does-not-fit" in findings) == (level["accept_length"] < rules.LOW_ACCEPT_LENGTH)
    assert rc == doctor.FINDINGS
    assert "sglang-cap-48" in capsys.readouterr().out


@pytest.fixture(scope="module")
def fitted_export(tmp_path_factory):
    """The drafter fitted to the probe's traffic, exported for SGLang."""
    return smollm2_fitted_drafter(tmp_path_factory.mktemp("fitted"), FIT_PROMPTS, FIT_TOKENS, "sglang")


@pytest.mark.parametrize("steps,topk,draft_tokens", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_the_doctor_finds_nothing_wrong_with_a_healthy_deployment(fitted_export, base, steps, topk, draft_tokens,
                                                                   tmp_path):
    """The fitted drafter at its own ids, a context at least the server's, an explicit --max-running-requests (sized
    for this KV budget, not SGLang's 48), as a chain (judged beside the base at 1 and 4 streams: speculation pays
    at both) and as a tree (speed not judged): no finding, exit 0."""
    kwargs = {"model_path": str(smollm2_dir()), "dtype": "float32", "context_length": 1024,
              "max_running_requests": 8, "speculative_algorithm": "EAGLE3",
              "speculative_draft_model_path": str(fitted_export), "speculative_num_steps": steps,
              "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft_tokens}
    out = tmp_path / "healthy.json"
    with SGLangServer(kwargs, python=sglang_venv_python()) as srv:
        beside = ["--base-url", base.url, "--concurrency", "1,4"] if topk == 1 else ["--concurrency", "1"]
        rc = doctor.main(["--url", srv.url, "--tokenizer", str(smollm2_dir()), *beside,
                          "--num-prompts", str(FIT_PROMPTS), "--max-tokens", str(FIT_TOKENS), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["findings"] == [], [f["code"] for f in result["findings"]]
    assert rc == doctor.HEALTHY and result["healthy"]
    running = result["running"]
    assert running["max_running_requests"] == 8 and running["speculative_eagle_topk"] == topk
    assert result["drafter"]["folder"] == str(fitted_export)  # found from the server's own draft model path
    assert result["probe"]["levels"][0]["accept_length"] >= rules.LOW_ACCEPT_LENGTH  # the drafter fits
    assert 0 < result["probe"]["seconds"] < 120
    assert all(r["aggregate_tok_s"]["ratio"] > 1.0 for r in result["probe"]["comparison"])
    assert len(result["probe"]["comparison"]) == (2 if topk == 1 else 0)
