"""One sample of more than 32,768 tokens captured by SGLang 0.5.23 equals the HF backend's chunked capture (issue 45).

SGLang's capture prefills a sample in one pass (chunked prefill drops the middle chunks' aux states:
docs/extract.md), so a long sample is one extend of its whole length through SGLang's scheduler and model code, and
redraft's stand-in for SGLang's CPU attention kernel (``redraft/engines/sglang_cpu/ops/attention.py``: scores a block
of query rows at a time, never [T, T]). The reference is the HF backend capturing the same ids in chunks of 8,192
through its KV cache, as extraction does. In fp32, per aux layer: median relative difference <= 1e-5 and the
teacher's top-1 the same at >= 99.9% of positions (the issue's goals).

The target is a 64-wide random Llama with a 64K context (the length is what is tested). kimi-k25-mini at 32,905
tokens: docs/results/long-capture/sglang-32k (a benchmark, not CI: ~5 min).
"""

from __future__ import annotations

from helpers_embedded import sglang_venv_python
from helpers_long import LENGTH, TEACHER, assert_equal_capture, long_sample

from extract.backends.sglang import SGLangTarget


def test_a_32k_sample_through_sglang_equals_the_chunked_hf_capture(tmp_path):
    py = sglang_venv_python()
    target, hf, ids, ours = long_sample(tmp_path)
    engine = SGLangTarget(str(target), dtype="float32", max_length=LENGTH + 1, python=py,
                          engine_kwargs={"max_total_tokens": LENGTH + 1024})  # the KV pool holds the whole sample
    try:
        theirs = engine.capture([ids], TEACHER)
    finally:
        engine.close()
    assert_equal_capture(hf, ours, theirs)
