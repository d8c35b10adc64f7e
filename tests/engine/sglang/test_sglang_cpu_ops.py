"""redraft's stand-in for SGLang's compiled CPU kernels computes what SGLang's own kernels compute (issue 33).

On a CPU, SGLang 0.5.23 runs with ``redraft/engines/sglang_cpu/site/sgl_kernel`` in place of its compiled
``sgl_kernel``; everything the SGLang lane then measures (captures, acceptance counters) goes through these
ops, ``verify_tree_greedy`` being the acceptance rule itself. ``tests/sglang_cpu_opcheck.py`` runs in the
SGLang CPU venv and holds every op, reached through SGLang's own CPU call sites, equal to SGLang's Triton
kernel of the same job (Triton interpreter) on random valid inputs and on hand-written cases; the attention
ops also to a plain float64 reference. This test runs it and reads its verdicts.

Needs the SGLang CPU venv (``make sglang-cpu-venv``): skipped with the reason without it, a failure in the
SGLang lane (REDRAFT_REQUIRE_SGLANG_CPU=1). About a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
from helpers_embedded import sglang_venv_python
from helpers_paths import ROOT

from redraft.engines.sglang_cpu import SITE

SCRIPT = ROOT / "tests" / "sglang_cpu_opcheck.py"
TOL = 1e-5  # fp32 attention: max |stand-in - other| / max |other|

# cases the script must have run per op: at least these many, so a silently shrunk run does not pass
BOOKKEEPING = {"assign_req_to_token_pool": 18, "assign_extend_cache_locs": 100,
               "assign_draft_cache_locs_contiguous": 18, "build_draft_decode_metadata": 18,
               "fill_bonus_tokens": 100, "fill_accept_out_cache_loc": 100, "copy_all_layer_kv_cache": 100}
EXTEND_KINDS = {"mha causal", "gqa causal", "mla causal", "gqa logit cap", "mha k/v scales", "gqa non-causal",
                "gqa k=v=None", "gqa tree QLEN_ONLY", "mla tree QLEN_ONLY", "mha tree FULL_MASK",
                "mla prefill"}
DECODE_KINDS = {"mha", "gqa", "mla", "gqa logit cap", "mha k/v scales", "gqa k=v=None", "mla k=v=None"}


@pytest.fixture(scope="module")
def opcheck() -> dict[str, Any]:
    """The script's verdicts: it runs once, in the SGLang CPU venv, with the stand-in on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)]), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sglang_venv_python(), str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"opcheck printed no verdicts (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    print(json.dumps(result, indent=1))
    assert "ops" in result, f"SGLang does not reach the stand-in: {result['wiring']}"
    result["exit"], result["stderr_tail"] = proc.returncode, proc.stderr[-4000:]
    return result


def _clean(op: dict[str, Any], name: str, min_cases: int) -> None:
    assert not op["errors"], (name, op["errors"])  # the op (or its check) raised: stderr has the traceback
    assert op["cases"] >= min_cases, (name, op["cases"])
    assert op["mismatches"] == 0, (name, op["first_mismatch"])


def test_sglang_reaches_the_stand_in(opcheck):
    """SGLang's CPU branch bound the stand-in's functions and the two attention ops are registered: otherwise
    the comparisons below would not be about the code SGLang runs."""
    assert opcheck["wiring"] and all(opcheck["wiring"].values()), opcheck["wiring"]
    assert opcheck["exit"] == 0, opcheck["stderr_tail"]


@pytest.mark.parametrize("name", sorted(BOOKKEEPING))
def test_bookkeeping_op_equals_sglang(opcheck, name):
    """Slot bookkeeping and KV moves, element for element (int32/int64 indices, overlapping moves)."""
    _clean(opcheck["ops"][name], name, BOOKKEEPING[name])


def test_tree_build_equals_sglang(opcheck):
    """The draft tree (mask in both layouts, positions, retrieve links) from parent lists made by SGLang's own
    EAGLE draft code, and the hand-written trees."""
    op = opcheck["ops"]["build_tree_kernel_efficient"]
    _clean(op, "build_tree_kernel_efficient", 50)
    assert op["hand_cases"] == 10
    assert op["trees_with_siblings"] >= 8, op  # real branching, not only chains
    shapes = [tuple(s) for s in op["shapes_topk_steps_draft_tokens"]]
    assert {s[0] for s in shapes} == {1, 2, 3} and {s[1] for s in shapes} == {2, 3, 4}, shapes
    assert {2, 8} <= {s[2] for s in shapes}, shapes


def test_greedy_verification_equals_sglang(opcheck):
    """The acceptance rule: equal to SGLang's Triton kernel and to a plain walk of the tree, on hand-written
    cases with known answers and on random trees whose verdicts span nothing accepted to everything."""
    op = opcheck["ops"]["verify_tree_greedy"]
    _clean(op, "verify_tree_greedy", 100)
    assert op["hand_cases"] == 10
    accepted = {int(k): v for k, v in op["accepted_histogram"].items()}
    assert op["requests"] >= 200 and accepted.get(0, 0) >= 10, accepted
    assert sum(v for k, v in accepted.items() if k >= 2) >= 50, accepted
    assert max(accepted) == 4 and op["full_depth_accepts"] >= 20, op
    assert op["paths_through_later_siblings"] >= 20, op  # the sibling search decided, not only first children


@pytest.mark.parametrize("name,kinds", [("extend_attention_cpu", EXTEND_KINDS),
                                        ("decode_attention_cpu", DECODE_KINDS)])
def test_attention_equals_sglang_and_the_math(opcheck, name, kinds):
    """MHA, GQA, absorbed MLA (v a view of k), logit cap, k/v scales, draft-tree masks in both layouts:
    within fp32 rounding of SGLang's Triton kernel and of the float64 reference."""
    op = opcheck["ops"][name]
    _clean(op, name, 14)
    assert set(op["kinds"]) == kinds, op["kinds"]
    assert op["triton_cases"] >= 14, op
    assert op["max_rel_diff_triton"] <= TOL and op["max_rel_diff_reference"] <= TOL, op
    if name == "decode_attention_cpu":
        assert op["pool_write_mismatches"] == 0  # the new k/v are in the pool at loc, nothing else moved


def test_the_mla_drafters_cuda_synchronize_is_a_no_op_only_on_a_torch_without_cuda():
    """SGLang's Eagle3DeepseekV2ForCausalLM.set_embed ends in torch.cuda.synchronize(), which raises on a CPU torch;
    the site hook makes it a no-op once that module is imported there, and only then (sitecustomize.py)."""
    code = ("import torch\n"
            "try:\n    torch.cuda.synchronize(); before = 'ran'\nexcept Exception as e:\n    before = type(e).__name__\n"
            "import sglang.srt.models.kimi_k25_eagle3\n"
            "torch.cuda.synchronize()\n"
            "print('VERDICT', before, torch.backends.cuda.is_built())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)])}
    proc = subprocess.run([sglang_venv_python(), "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("VERDICT")]
    assert verdict == ["VERDICT AssertionError False"], (proc.stdout[-2000:], proc.stderr[-2000:])
