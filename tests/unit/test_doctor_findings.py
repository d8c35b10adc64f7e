"""serve.doctor's rules, each on the facts it reads; the engines' own behaviour they encode is written out here by hand
from the engines' source (SGLang 0.5.23 ``models/deepseek_v2.py`` set_eagle3_layers_to_capture: ``+1`` to every id
only when the first is 1; 0.5.10: ``+1`` to every id; ``arg_groups/speculative_hook.py``: 48 running requests when
none is asked), not derived from redraft.core.layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redraft.core import layers
from serve import doctor_findings as rules

KIMI = "KimiK25ForConditionalGeneration"


def _captured_by_sglang(written: list[int], version: str) -> list[int]:
    """The decoder-layer outputs SGLang captures (the input of layer j is the output of layer j - 1)."""
    if version == "0.5.23":
        inputs = [w + 1 for w in written] if written[0] == 1 else list(written)
    else:  # 0.5.10
        inputs = [w + 1 for w in written]
    return sorted(j - 1 for j in inputs)


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
@pytest.mark.parametrize("written", [[2, 30, 58], [1, 29, 57], [3, 9, 20]])
def test_sglang_layer_reading_follows_each_versions_source(written, version):
    assert layers.sglang_read_layer_ids(written, KIMI, version) == _captured_by_sglang(written, version)
    assert layers.sglang_read_layer_ids(written, "LlamaForCausalLM", version) == sorted(written)


def test_a_version_between_the_two_rules_is_not_guessed():
    assert layers.sglang_read_layer_ids([2, 30, 58], KIMI, "0.5.15") is None
    assert layers.sglang_read_layer_ids([1, 29, 57], KIMI, "0.5.15") == [1, 29, 57]  # both rules agree
    assert layers.sglang_read_layer_ids([1, 29, 57], KIMI, "0.5.9") is None
    assert layers.parse_version("0.5.23.post1") == (0, 5, 23) and layers.parse_version("main") is None


def _drafter(tmp_path: Path, written: list[int], trained: list[int] | None, context: int = 4096) -> dict:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "max_position_embeddings": context,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": written}}))
    if trained is not None:
        (tmp_path / "redraft.json").write_text(json.dumps({"serving_format": "sglang", "drafter": {
            "aux_layer_ids": trained, "target_architecture": KIMI, "target_num_layers": 61}}))
    return rules.drafter_facts(tmp_path)


def test_the_kimi_export_read_one_layer_deep_by_0_5_10_is_found_with_the_ids_to_write(tmp_path):
    d = _drafter(tmp_path, [2, 30, 58], [1, 29, 57])
    assert rules.layer_finding("sglang", "0.5.23", d, None) is None
    f = rules.layer_finding("sglang", "0.5.10", d, None)
    assert f is not None and f.code == "layer-ids-misread"
    assert "[2, 30, 58]" in f.evidence and "[1, 29, 57]" in f.fix  # the ids both versions read as trained
    assert _captured_by_sglang([1, 29, 57], "0.5.10") == _captured_by_sglang([1, 29, 57], "0.5.23") == [1, 29, 57]


def test_vllm_reads_input_of_layer_ids(tmp_path):
    d = _drafter(tmp_path, [2, 30, 58], [1, 29, 57])
    assert rules.layer_finding("vllm", "0.32.0", d, None) is None
    d = _drafter(tmp_path, [1, 29, 57], [1, 29, 57])  # written in our convention: vLLM captures one layer short
    f = rules.layer_finding("vllm", "0.32.0", d, None)
    assert f is not None and "[0, 28, 56]" in f.evidence and "[2, 30, 58]" in f.fix


def _sglang_running(mrr: int, launch: str, kv: int = 200_000) -> dict:
    return {"info": {"speculative_algorithm": "EAGLE3", "max_running_requests": mrr, "version": "0.5.23",
                     "launch_command": launch, "max_total_num_tokens": kv}, "tokens_per_request": 1000}


def test_the_48_cap_is_found_only_when_nobody_asked_for_it_and_the_fix_fits_the_kv_budget():
    f = rules.cap_finding("sglang", _sglang_running(48, "python -m sglang.launch_server --model-path m"), 64)
    assert f is not None and f.code == "sglang-cap-48"
    assert "--max-running-requests 100 " in f.fix  # 200,000 tokens / 2 / 1,000 per request
    assert rules.cap_finding("sglang", _sglang_running(48, "... --max-running-requests 48"), 64) is None
    assert rules.cap_finding("sglang", _sglang_running(128, ""), 64) is None
    assert rules.cap_finding("vllm", _sglang_running(48, ""), 64) is None


def test_context_and_acceptance_and_speed(tmp_path):
    d = _drafter(tmp_path, [2, 30, 58], None, context=4096)
    f = rules.context_finding({"info": {"context_length": 262144}}, d)
    assert f is not None and "262144" in f.fix
    assert rules.context_finding({"info": {"context_length": 4096}}, d) is None
    low = [{"concurrency": 1, "accept_length": 1.3}]
    assert rules.acceptance_finding(low, 3, None).code == "drafter-does-not-fit"
    assert rules.acceptance_finding(low, 3, 2.4).code == "served-not-as-trained"
    assert rules.acceptance_finding([{"concurrency": 1, "accept_length": 2.5}], 3, None) is None

    def row(c, per, agg):
        return {"concurrency": c, "per_stream_tok_s": {"ratio": per}, "aggregate_tok_s": {"ratio": agg}}
    codes = [f.code for f in rules.speed_findings([row(1, 0.99, 0.99), row(8, 1.2, 1.1), row(64, 0.7, 0.6)])]
    assert codes == ["no-gain-one-stream", "loses-at-concurrency"]
    assert rules.speed_findings([row(1, 1.5, 1.5), row(8, 1.2, 1.1)]) == []


def test_the_draft_plan_per_concurrency_from_the_probes_own_costs():
    """Worked by hand: at one stream base 10 tok/s, K = 3 at 8 tok/s with per-round acceptance 0.3 / 0.15 / 0.05
    (tau 1.5): a base step 0.1 s, a 3-draft step 1.5 / 8 = 0.1875 s, so each draft costs 0.0292 s and a chain of
    one is predicted 1.3 x 0.1 / 0.1292 = 1.006x, two 0.916x, three 0.800x. At four streams base 30, K = 3 at 15
    tok/s: one draft 1.3 x 0.0333 / 0.0556 = 0.780x, so none."""
    def row(c, base, spec):
        return {"concurrency": c, "aggregate_tok_s": {"base": base, "eagle": spec, "ratio": spec / base},
                "accept_length": 1.5}
    levels = [{"concurrency": c, "accept_per_pos": [0.3, 0.15, 0.05]} for c in (1, 4)]
    plan = rules.draft_plan([row(1, 10.0, 8.0), row(4, 30.0, 15.0)], levels, 3)
    assert [p["best_k"] for p in plan] == [1, 0]
    assert [round(plan[0]["predicted"][k], 3) for k in (0, 1, 2, 3)] == [1.0, 1.006, 0.916, 0.8]
    assert round(plan[1]["predicted"][1], 3) == 0.78
    assert rules.vllm_schedule(plan) == [[1, 1, 1], [2, 4, 0]]
    findings = {f.code: f for f in rules.speed_findings([row(1, 10.0, 8.0), row(4, 30.0, 15.0)], "vllm", plan)}
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, 1], [2, 4, 0]]' in findings["loses-at-concurrency"].fix
    # SGLang reports no rate per position: only 0 or 3 drafts. 3 at 8 tok/s loses everywhere (1.5 x 0.1 / 0.1875 =
    # 0.8x): no drafting anywhere; 3 at 12 tok/s pays at one stream (1.5 x 0.1 / 0.125 = 1.2x) and not at four
    rows = [row(1, 10.0, 8.0), row(4, 30.0, 15.0)]
    nowhere = rules.speed_findings(rows, "sglang", rules.draft_plan(rows, [], 3))
    assert "no drafting pays at any concurrency measured" in nowhere[-1].fix
    rows = [row(1, 10.0, 12.0), row(4, 30.0, 15.0)]
    plan = rules.draft_plan(rows, [], 3)
    assert [(p["best_k"], round(p["predicted"][3], 3)) for p in plan] == [(3, 1.2), (0, 0.5)]
    fix = rules.speed_findings(rows, "sglang", plan)[-1].fix
    assert "--speculative-adaptive" in fix and "--speculative-num-steps 3 --speculative-num-draft-tokens 4 where the load " \
        "stays at 1 or below" in fix


def _walked(engine_tau: float, walk_tau: float, others: list[dict]) -> dict:
    from redraft.pipeline.doctor import judge

    result = {"running": {"speculative_num_steps": 3}, "findings": others, "healthy": not others,
              "probe": {"levels": [{"concurrency": 1, "accept_length": engine_tau},
                                   {"concurrency": 8, "accept_length": engine_tau}]}}
    walk = {"samples": 8, "data": "d", "checkpoints": {"drafter": {"tau": walk_tau, "evaluation": "exact"}}}
    return judge(result, walk)


def test_the_offline_walk_decides_between_served_wrongly_and_does_not_fit():
    """redraft.pipeline.doctor's verdict: the engine far below the walk is a deployment fault; both low is the drafter;
    both high is healthy. The probe's own acceptance finding is replaced, every other finding kept."""
    cap = {"code": "sglang-cap-48", "title": "t", "evidence": "e", "fix": "f"}
    low = {"code": "drafter-does-not-fit", "title": "t", "evidence": "e", "fix": "f"}

    wrong = _walked(1.1, 2.4, [cap, low])
    assert [f["code"] for f in wrong["findings"]] == ["sglang-cap-48", "served-not-as-trained"]
    assert "1.10 in the engine against 2.40 offline" in wrong["findings"][1]["evidence"]

    unfit = _walked(1.2, 1.25, [low])
    assert [f["code"] for f in unfit["findings"]] == ["drafter-does-not-fit"]
    assert "1.25 in the offline walk" in unfit["findings"][0]["evidence"]

    fine = _walked(2.3, 2.35, [])
    assert fine["healthy"] and fine["offline_walk"]["engine_tau_one_stream"] == 2.3


def test_before_launch_checks_a_drafter_folder_without_a_server(tmp_path, capsys):
    """serve.doctor --before-launch (what slurm/serve.sh and serve.tune run): the ids as the named version reads
    them, or as every SGLang version known here reads them; the context against the one to be served."""
    from serve import doctor

    _drafter(tmp_path, [2, 30, 58], [1, 29, 57], context=262144)

    def check(*extra: str) -> int:
        return doctor.main(["--before-launch", str(tmp_path), "--engine", "sglang", *extra])

    assert check("--engine-version", "0.5.23") == doctor.HEALTHY and "ready to launch" in capsys.readouterr().out
    assert check("--engine-version", "0.5.10") == doctor.FINDINGS
    assert check() == doctor.FINDINGS  # 0.5.10 is among the versions known here
    assert "SGLang 0.5.10 would capture other layers" in capsys.readouterr().out
    assert check("--context-length", "300000", "--engine-version", "0.5.23") == doctor.FINDINGS
    assert "context-length" in capsys.readouterr().out
    _drafter(tmp_path, [1, 29, 57], [1, 29, 57], context=262144)
    assert check() == doctor.HEALTHY  # read alike by 0.5.10 and 0.5.23


def test_serve_tune_refuses_to_sweep_an_export_its_engine_would_misread(tmp_path):
    from serve.tune import TuneError, check_before_launch

    _drafter(tmp_path, [1, 29, 57], [1, 29, 57], context=8192)  # our ids written as they are: vLLM reads them short
    with pytest.raises(TuneError, match=r"captures other layers.*\[2, 30, 58\]"):
        check_before_launch("vllm", "python", tmp_path, 4096)
    _drafter(tmp_path, [2, 30, 58], [1, 29, 57], context=2048)
    with pytest.raises(TuneError, match="context is shorter"):
        check_before_launch("vllm", "python", tmp_path, 4096)
    _drafter(tmp_path, [2, 30, 58], [1, 29, 57], context=8192)
    check_before_launch("vllm", "python", tmp_path, 4096)


def test_the_write_ups_deployment_as_the_doctor_reads_it(tmp_path):
    """serve.doctor --evidence on the write-up's own figures (docs/results/doctor-writeup/evidence.json): every cause
    its team found by hand (the cap of 48, the drafter trained for another target, the context that needed an
    environment variable, no gain at one stream and a loss under load), each with its fix, and nothing else."""
    from helpers_paths import ROOT

    from serve import doctor

    out = tmp_path / "report.json"
    rc = doctor.main(["--evidence", str(ROOT / "docs/results/doctor-writeup/evidence.json"), "--json", str(out)])
    result = json.loads(out.read_text())
    findings = {f["code"]: f for f in result["findings"]}
    assert rc == doctor.FINDINGS
    assert list(findings) == ["sglang-cap-48", "context-length", "drafter-does-not-fit", "no-gain-one-stream",
                              "loses-at-concurrency"]
    assert "262144" in findings["context-length"]["fix"] and "0.36 at 64" in findings["loses-at-concurrency"]["evidence"]
    assert [p["best_k"] for p in result["probe"]["draft_plan"]] == [0, 0]  # 62.9 against 63.6: no chain pays
    committed = json.loads((ROOT / "docs/results/doctor-writeup/report.json").read_text())
    assert committed["findings"] == result["findings"]  # the committed report is this code's
