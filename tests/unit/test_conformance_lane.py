"""The conformance lane's own logic, without its venvs: verdict parsing, broken exports caught by our pre-check, the SpecForge mask statements, the "engine not
installed" path of ``--verify-with``, and the lane standing on the repository alone (run.sh, the
venv builder and its locks). The engine-loading judge itself: tests/unit/test_conformance_loadcheck.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_paths import ROOT
from safetensors.torch import save_file

from conformance import check_engines as ce
from conformance import check_specforge as cs
from conformance.make_drafters import KIMI, kimi_state
from eval import verify_engine as ve
from eval.export import ExportConfig, export_checkpoint
from eval.export import main as export_main
from redraft.core.drafter.config import DrafterConfig
from redraft.core.drafter.folder import write_drafter_folder
from redraft.core.drafter.modeling import Eagle3Drafter
from redraft.core.drafter.serving_format import check_serving_state, serving_config
from redraft.core.drafter.vocab import build_vocab_mapping
from redraft.core.teacher_targets import teacher_from_topk
from train.ttt import ttt_forward

ENGINE_OUTPUT = """\
  IGNORED      midlayer.mlp.upp_proj.weight            (128, 64)  sglang's load_weights matched no parameter
VERDICT sglang FAIL (2 problems): parameter model.layers.0.mlp.gate_up_proj.weight not loaded; key x ignored
VERDICT vllm PASS: 12/12 parameters loaded (1 provided by the target by design), 15/15 checkpoint keys used
VERDICT both FAIL: sglang FAIL, vllm PASS
"""


def tiny_cfg(arch: str = "LlamaForCausalLM", layers: int = 8, ids=(1, 3, 4)) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=100, draft_vocab_size=40, target_hidden_size=32,
                         aux_layer_ids=list(ids), target_num_layers=layers, target_architecture=arch,
                         torch_dtype="float32")


def tiny_checkpoint(folder: Path, cfg: DrafterConfig) -> Path:
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.set_vocab_mapping(*build_vocab_mapping(torch.arange(cfg.vocab_size), cfg.draft_vocab_size))
    folder.mkdir(parents=True)
    write_drafter_folder(folder, cfg, d.serving_state_dict(), {"format": "test"})
    return folder


def export(ckpt: Path, out: Path, fmt: str) -> Path:
    export_checkpoint(ExportConfig(ckpt=str(ckpt), out=str(out), format=fmt))
    return out


# ----------------------------------------------------------------------------- verdicts


def test_parse_verdicts_reads_each_engine_line():
    v = ce.parse_verdicts(ENGINE_OUTPUT)
    assert set(v) == {"sglang", "vllm", "both"}
    assert v["sglang"].status == "FAIL" and "gate_up_proj" in v["sglang"].detail
    assert v["vllm"].status == "PASS" and v["vllm"].detail.startswith("12/12")
    assert ce.parse_verdicts("no verdict here\nVERDICTS are not lines") == {}


def test_parse_verdicts_reads_error_lines():
    v = ce.parse_verdicts("VERDICT vllm ERROR: engine setup failed: ImportError: x")
    assert v["vllm"].status == "ERROR"


def test_expect_verdicts_flags_wrong_status_missing_engine_and_exit_code():
    v = ce.parse_verdicts(ENGINE_OUTPUT)
    assert ce.expect_verdicts(v, 1, {"sglang": "FAIL"}) == []
    problems = ce.expect_verdicts(v, 1, {"sglang": "FAIL", "vllm": "FAIL"})
    assert len(problems) == 1 and problems[0].startswith("vllm: expected FAIL, got PASS")
    assert any("no VERDICT" in p for p in ce.expect_verdicts({}, 0, {"sglang": "PASS"}))
    # a negative control that could not run (exit 2) is not a refusal
    assert any("exit code 2" in p for p in ce.expect_verdicts(v, 2, {"sglang": "FAIL"}))


def test_the_checks_verdict_parses_like_the_lanes_check():
    from eval.loadcheck.probe import Report

    ok = Report(engine="sglang", folder="x", model_class="LlamaForCausalLMEagle3", params=11,
                by_design={"model.embed_tokens.weight": "target"})
    bad = Report(engine="vllm", folder="x", problems=["key d2t ignored"])
    v = ce.parse_verdicts(ok.verdict() + "\n" + bad.verdict())
    assert v["sglang"].status == "PASS" and "11/11" in v["sglang"].detail
    assert v["vllm"].status == "FAIL" and "d2t" in v["vllm"].detail
    long = Report(engine="vllm", folder="x", problems=[f"key k{i} rejected: " + "x" * 400 for i in range(9)])
    line = long.verdict()
    assert line.startswith("VERDICT vllm FAIL (9 problems)") and "... 5 more" in line and len(line) < 900
    assert ce.parse_verdicts(line)["vllm"].status == "FAIL"


# ----------------------------------------------------------------------------- broken exports


def test_good_export_passes_our_precheck(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_cfg())
    assert ce.precheck_problems(export(ckpt, tmp_path / "good", "sglang")) is None


@pytest.mark.parametrize("kind,needle", [("renamed", "upp_proj"), ("no-d2t", "missing key 'd2t'"),
                                         ("model-prefix", "'model.fc.weight'")])
def test_broken_exports_are_caught_by_our_precheck(tmp_path, kind, needle):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_cfg())
    good = export(ckpt, tmp_path / "good", "vllm")
    bad = ce.break_export(good, tmp_path / f"bad-{kind}", kind)
    assert (bad / "config.json").read_text() == (good / "config.json").read_text()
    problem = ce.precheck_problems(bad)
    assert problem is not None and needle in problem


def test_break_export_refuses_unknown_defect(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_cfg())
    with pytest.raises(ValueError, match="unknown defect"):
        ce.break_export(ckpt, tmp_path / "x", "swapped")


# ----------------------------------------------------------------------------- Kimi-shaped drafter


def test_kimi_config_matches_the_issue_and_engine_ids():
    cfg = DrafterConfig(**KIMI)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (7168, 64, 64, 128)
    assert (cfg.intermediate_size, cfg.draft_vocab_size, cfg.vocab_size) == (18432, 32000, 163840)
    for engine, want in (("sglang", [1, 29, 57]), ("vllm", [2, 30, 58])):
        ids = serving_config(cfg, engine=engine)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert ids == want  # what each engine captures for them: tests/engine/sglang/test_sglang_capture.py, test_vllm_capture.py


def test_kimi_state_builder_fills_the_serving_table_in_bf16():
    cfg = tiny_cfg("KimiK25ForConditionalGeneration", 61, (1, 29, 57))
    state = kimi_state(cfg)
    check_serving_state(state, cfg, "sglang", dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- SpecForge mask statements


def test_specforge_and_our_masks_on_a_hand_example():
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]])
    real = torch.ones_like(lm)
    t2d = torch.ones(10, dtype=torch.bool)
    tgt = torch.zeros(1, 8, dtype=torch.int64)
    sf = cs.specforge_position_mask(lm, real, tgt, t2d, 0)
    ours = cs.our_position_mask(lm, real, tgt, t2d, 0)
    assert sf.int().tolist() == [[0, 0, 1, 1, 1, 0, 1, 0]]  # loss_mask[t], last real token zeroed
    assert ours.int().tolist() == [[1, 1, 1, 0, 1, 1, 0, 0]]  # loss_mask[t+2]
    assert cs.specforge_position_mask(lm, real, tgt, t2d, 2).int().tolist() == [[1, 1, 1, 0, 1, 0, 0, 0]]
    t2d[0] = False  # teacher argmax outside the draft vocab: neither counts it in the loss
    assert not cs.specforge_position_mask(lm, real, tgt, t2d, 0).any()
    assert not cs.our_position_mask(lm, real, tgt, t2d, 0).any()


def test_our_mask_statement_counts_what_ttt_forward_counts():
    cfg = cs.small_config()
    d = cs.make_drafter(cfg, 3)
    x = cs.make_inputs(cfg, cs.Case("t", 2, 20, 13), d.embed_tokens.weight.detach(), d.t2d, 3)
    top = torch.sort(x["teacher_logprobs"], dim=-1, descending=True)
    teacher = teacher_from_topk(top.indices, top.values, d.t2d, d.d2t)
    with torch.no_grad():
        out = ttt_forward(d, input_ids=x["input_ids"], aux_hidden=x["aux_hidden_states"],
                          attention_mask=x["attention_mask"], loss_mask=x["loss_mask"], teacher=teacher, steps=3)
    for k in range(3):
        mask = cs.our_position_mask(x["loss_mask"], x["attention_mask"], teacher.target_ids, d.t2d, k)
        assert int(mask.sum()) == int(out.step_counts[k]) > 0
        sf = cs.specforge_position_mask(x["loss_mask"], x["attention_mask"], teacher.target_ids, d.t2d, k)
        assert not torch.equal(mask, sf)  # the case exercises the documented difference


# ----------------------------------------------------------------------------- eval.verify_engine


def _engine_importable(engine: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(engine) is not None


@pytest.mark.skipif(_engine_importable("sglang"), reason="sglang is installed here")
def test_verify_says_the_engine_is_missing(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_cfg())
    assert ve.main([str(ckpt), "--engine", "sglang"]) == 2
    assert "VERDICT sglang ERROR: sglang is not importable here" in capsys.readouterr().out


@pytest.mark.skipif(_engine_importable("vllm"), reason="vllm is installed here")
def test_export_verify_with_fails_clearly_without_the_engine(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_cfg())
    out = tmp_path / "out"
    rc = export_main([str(ckpt), str(out), "--format", "vllm", "--verify-with", "vllm", "-q"])
    assert rc != 0
    assert (out / "model.safetensors").is_file()  # the export itself is written before the check
    assert "vllm is not importable here" in capsys.readouterr().out


def test_verify_engine_refuses_unknown_engine():
    assert ve.main(["x", "--engine", "tgi"]) == 2


# ----------------------------------------------------------------------------- run.sh's skip / refusal paths

RUN_SH = ROOT / "conformance" / "run.sh"
MAKE_VENV = ROOT / "conformance" / "make_venv.sh"


def _run_lane(tmp_path: Path, fake_pip_rc: int, **extra_env: str) -> subprocess.CompletedProcess:
    """run.sh with empty venv folders and a python3 on PATH whose `pip index` exits ``fake_pip_rc``."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text(f"#!/bin/sh\nexit {fake_pip_rc}\n")
    (fake_bin / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "REDRAFT_SKIP_CONFORMANCE"}
    env.update(PATH=f"{fake_bin}:{os.environ['PATH']}", CONFORMANCE_VENVS=str(tmp_path / "venvs"),
               CONFORMANCE_WORK=str(tmp_path / "work"), PYTHON=sys.executable, **extra_env)
    return subprocess.run(["bash", str(RUN_SH)], env=env, capture_output=True, text=True, timeout=60)


def test_lane_fails_loudly_when_it_cannot_run(tmp_path):
    """Registries unreachable and no venvs: the lane cannot check anything, so CI must go red."""
    proc = _run_lane(tmp_path, fake_pip_rc=1)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "CONFORMANCE LANE FAILED: it cannot run" in proc.stdout
    assert "REDRAFT_SKIP_CONFORMANCE=1" in proc.stdout
    assert not (tmp_path / "venvs").exists()  # nothing was built


def test_lane_skips_only_when_asked_to(tmp_path):
    proc = _run_lane(tmp_path, fake_pip_rc=1, REDRAFT_SKIP_CONFORMANCE="1")
    assert proc.returncode == 0, proc.stderr
    assert "CONFORMANCE LANE SKIPPED on purpose" in proc.stdout
    assert not (tmp_path / "venvs").exists()


def test_lane_needs_nothing_outside_the_repository():
    """CI runs a clean clone: the lane names none of the old helpers that lived outside it (paths out of the
    repository are refused tree-wide by tests/unit/test_repository_paths.py), and every conformance module or
    file run.sh names must be in the repository."""
    texts = {p: p.read_text() for p in [RUN_SH, MAKE_VENV, ROOT / "Makefile", *(ROOT / "conformance").rglob("*.py")]}
    for path, text in texts.items():
        for needle in ("REDRAFT_SHARED_TOOLS", "engine_load_check", "specforge_reference", "make_fake_drafter"):
            assert needle not in text, f"{path} still mentions {needle!r}"
    run = texts[RUN_SH]
    for module in sorted(set(re.findall(r"-m (conformance\.\w+)", run))):
        assert (ROOT / f"{module.replace('.', '/')}.py").is_file(), module
    for script in sorted(set(re.findall(r"conformance/[\w/]+\.(?:sh|py)", run))):
        assert (ROOT / script).is_file(), script
    for mode in ("engine", "specforge"):
        assert (ROOT / "conformance" / "venvs" / f"{mode}.txt").is_file()


@pytest.mark.parametrize("mode,pins", [
    ("engine", {"torch": "2.14.1", "sglang": "0.5.23", "vllm": "0.33.0", "transformers": "5.19.0",
                "openai": "2.54.0", "compressed-tensors": "0.18.0", "xgrammar": "0.2.8"}),
    ("specforge", {"specforge": "0.2.0", "transformers": "5.8.1", "safetensors": "0.8.0"}),
])
def test_venv_locks_pin_every_distribution_exactly(mode, pins):
    lines = [ln.strip() for ln in (ROOT / "conformance" / "venvs" / f"{mode}.txt").read_text().splitlines()]
    reqs = [ln for ln in lines if ln and not ln.startswith("#")]
    assert reqs and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", r) for r in reqs), reqs
    got = {r.split("==")[0].lower(): r.split("==")[1] for r in reqs}
    assert len(got) == len(reqs)  # no distribution twice
    for name, version in pins.items():
        assert got.get(name) == version, (name, got.get(name))
    if mode == "specforge":
        assert "torch" not in got  # only from the local CPU wheel, never from an index


@pytest.mark.parametrize("args,env,needle", [
    (["bogus", "x"], {}, "usage: bash conformance/make_venv.sh engine|specforge DIR"),
    (["engine"], {}, "no DIR given"),
    (["specforge", "{tmp}/v"], {"TORCH_WHEEL": "{tmp}/no-such.whl"}, "no-such.whl: no such file"),
])
def test_make_venv_refuses_loudly_before_building_anything(tmp_path, args, env, needle):
    env = {**os.environ, **{k: v.format(tmp=tmp_path) for k, v in env.items()}}
    proc = subprocess.run(["bash", str(MAKE_VENV), *[a.format(tmp=tmp_path) for a in args]], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr and "ERROR" in proc.stderr
    assert not (tmp_path / "v").exists()


def test_specforge_reference_says_why_it_cannot_run_here(tmp_path, capsys):
    """.venv has no SpecForge: the reference exits 2 naming it, and refuses inputs naming the file and key."""
    from conformance import specforge_ref as sr

    if importlib.util.find_spec("specforge") is None:
        assert sr.main(["--check-import"]) == 2
        assert "SpecForge is not importable here" in capsys.readouterr().err
    save_file({"input_ids": torch.zeros(1, 4, dtype=torch.int64)}, str(tmp_path / "in.safetensors"))
    with pytest.raises(sr.InputError, match="key 'aux_hidden_states' missing"):
        sr.read_inputs(tmp_path / "in.safetensors")
    stub = sr._triton_stand_in()
    assert stub["triton"].next_power_of_2(300) == 512 and stub["triton"].jit(len) is len


