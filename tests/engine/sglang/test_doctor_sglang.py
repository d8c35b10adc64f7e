"""serve.doctor against a live SGLang 0.5.23 server (SGLang's own engine on the CPU, redraft's stand-in for its
kernels) speculating with the SmolLM2 logit-lens drafter, started with no --max-running-requests: what a team gets
from SGLang's defaults. The doctor must read the engine, its version and the drafter folder from the server's own
/server_info, find the cap of 48 running requests (set by SGLang when it speculates, not asked for on the launch
line) and size the fix from the server's own KV budget; the drafter's layer ids are the ones this version reads
as trained, so no layer finding. One server start, a few short requests.
"""

from __future__ import annotations

import json

from helpers_embedded import sglang_venv_python, smollm2_dir, smollm2_logit_lens_drafter

from core.engines.sglang import SGLangServer
from eval.export import ExportConfig, export_checkpoint
from serve import doctor

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
    with SGLangServer(kwargs, python=py) as srv:
        rc = doctor.main(["--url", srv.url, "--tokenizer", str(smollm2_dir()), "--concurrency", "1",
                          "--num-prompts", "2", "--max-tokens", "16", "--max-seconds", "300", "--json", str(out)])
    result = json.loads(out.read_text())
    running = result["running"]
    assert result["engine"] == "sglang" and running["version"].startswith("0.5.23")
    assert running["speculative_num_steps"] == STEPS and running["max_running_requests"] == 48
    assert "--max-running-requests" not in running["launch_command"]
    assert result["drafter"]["folder"] == str(export)  # found from the server's own draft model path
    level = result["probe"]["levels"][0]
    assert level["ok"] == level["requests"] >= 2 and level["accept_length"] >= 1.0
    findings = {f["code"]: f for f in result["findings"]}
    cap = findings["sglang-cap-48"]
    kv = running["max_total_num_tokens"]
    assert isinstance(kv, int) and f"{kv:,}" in cap["evidence"]
    assert "--max-running-requests" in cap["fix"]
    assert not {"layer-ids-misread", "layer-ids-unknown", "context-length", "requests-fail"} & set(findings)
    assert rc == doctor.FINDINGS
    assert "sglang-cap-48" in capsys.readouterr().out
