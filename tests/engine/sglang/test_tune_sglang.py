"""serve.tune --engine sglang end to end on a tiny case against real SGLang servers (SGLang 0.5.23's own engine,
on the CPU with redraft's stand-in for its kernels).

The same case and the same checks as tests/engine/vllm/test_tune_vllm.py (helpers_tune): the SmolLM2 logit-lens drafter on
three MT-bench prompts, probes of base and k = 2, a sweep of base and k = 2 at concurrency 1 and 2 on the same two
server starts, the
engine's counters (here each answer's own meta_info) held against the offline walk, the prediction, the answer.
And what SGLang says its request limit is: 48 on every speculating server (its cap when none is asked), and
the launch line for SGLang pointing at the SGLang export, the vLLM one at the vLLM export.

Needs the SGLang CPU venv (``make sglang-cpu-venv``): skipped without it, a failure in the SGLang lane
(REDRAFT_REQUIRE_SGLANG_CPU=1). About 3-5 min on 2 cores.
"""

from __future__ import annotations

from helpers_embedded import sglang_venv_python, smollm2_dir, smollm2_logit_lens_drafter
from helpers_tune import STEPS, check_report, tune_args

from redraft.pipeline import tune


def test_tune_sglang_end_to_end(tmp_path, capsys):
    ckpt = smollm2_logit_lens_drafter(tmp_path / "ckpt")
    out = tmp_path / "tune"
    assert tune.cli(tune_args(ckpt, smollm2_dir(), out, sglang_venv_python(), "sglang")) == 0
    report = check_report(out, capsys.readouterr().out)
    assert report["engine"] == "sglang"
    limits = report["max_running_requests"]
    assert all(limits[f"k{k}"] == 48 for k in STEPS)  # SGLang's cap for speculative serving
    assert limits["base"] is not None and limits["base"] != 48
    exports = report["settings"]["drafter_exports"]
    assert report["settings"]["drafter_export"] == exports["sglang"]
    if report["recommendation"]:
        assert exports["sglang"] in report["recommendation"]["sglang"]
        assert exports["vllm"] in report["recommendation"]["vllm"]
    assert "max_running_requests as each server reported it" in (out / "report.md").read_text()
