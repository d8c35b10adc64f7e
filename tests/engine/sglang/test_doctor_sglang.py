"""serve.doctor against a live SGLang 0.5.23 server (SGLang's own engine on the CPU, redraft's stand-in for its
kernels) speculating with the SmolLM2 logit-lens drafter, started with no --max-running-requests: what a team gets
from SGLang's defaults. The doctor must read the engine, its version and the drafter folder from the server's own
/server_info, find the cap of 48 running requests (set by SGLang when it speculates, not asked for on the launch
line) and size the fix from the server's own KV budget; the drafter's layer ids are the ones this version reads
as trained, so no layer finding. A copy of the drafter's folder that says it drafts fewer positions than the server
serves is found with the length to write, and one whose ids are one layer off with the ids to write. One server
start, a few short requests.
"""

from __future__ import annotations

import json
import shutil

from helpers_embedded import sglang_venv_python, smollm2_dir, smollm2_logit_lens_drafter

from core.engines.sglang import SGLangServer
from eval.export import ExportConfig, export_checkpoint
from serve import doctor
from serve import doctor_findings as rules

STEPS = 2


def test_the_doctor_finds_sglangs_cap_of_48_on_a_live_server(tmp_path, capsys):
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
        rc = doctor.main(["--url", srv.url, "--tokenizer", str(smollm2_dir()), "--concurrency", "1",
                          "--num-prompts", "2", "--max-tokens", "16", "--max-seconds", "300", "--json", str(out)])
        assert doctor.main(["--url", srv.url, "--drafter", str(short), "--concurrency", "1", "--num-prompts", "1",
                            "--max-tokens", "8", "--json", str(tmp_path / "short.json")]) == doctor.FINDINGS
        assert doctor.main(["--url", srv.url, "--drafter", str(off), "--concurrency", "1", "--num-prompts", "1",
                            "--max-tokens", "8", "--json", str(tmp_path / "off.json")]) == doctor.FINDINGS
    off_findings = {f["code"]: f for f in json.loads((tmp_path / "off.json").read_text())["findings"]}
    assert str(sorted(written)) in off_findings["layer-ids-misread"]["fix"]  # the ids SGLang 0.5.23 reads as trained
    assert "0.5.23" in off_findings["layer-ids-misread"]["title"]
    short_findings = {f["code"]: f for f in json.loads((tmp_path / "short.json").read_text())["findings"]}
    assert "1,024" in short_findings["context-length"]["evidence"]
    assert "set max_position_embeddings to 1024" in short_findings["context-length"]["fix"]
    result = json.loads(out.read_text())
    running = result["running"]
    assert result["engine"] == "sglang" and running["version"].startswith("0.5.23")
    assert running["speculative_num_steps"] == STEPS and running["max_running_requests"] == 48
    assert "--max-running-requests" not in running["launch_command"]
    assert result["drafter"]["folder"] == str(export)  # found from the server's own draft model path
    level = result["probe"]["levels"][0]
    assert level["ok"] == level["requests"] >= 2 and level["accept_length"] >= 1.0
    assert 0 < result["probe"]["seconds"] < 120  # the bound for a probe on a CPU
    rates = level["accept_per_pos"]  # from SGLang's per-request histograms (empty when no round accepted a draft)
    assert isinstance(rates, list) and len(rates) <= STEPS
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # a chain accepts a prefix
    findings = {f["code"]: f for f in result["findings"]}
    cap = findings["sglang-cap-48"]
    kv = running["max_total_num_tokens"]
    assert isinstance(kv, int) and f"{kv:,}" in cap["evidence"]
    assert "--max-running-requests" in cap["fix"]
    assert not {"layer-ids-misread", "layer-ids-unknown", "context-length", "requests-fail"} & set(findings)
    # the logit-lens drafter fits no chat traffic: found by the engine's own acceptance at one stream
    assert ("drafter-does-not-fit" in findings) == (level["accept_length"] < rules.LOW_ACCEPT_LENGTH)
    assert rc == doctor.FINDINGS
    assert "sglang-cap-48" in capsys.readouterr().out
