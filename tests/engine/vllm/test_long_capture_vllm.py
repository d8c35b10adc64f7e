"""One sample of more than 32,768 tokens captured by vLLM 0.32 (CPU) equals the HF backend's chunked capture (issue 45).

vLLM prefills the whole prompt in one pass on the CPU (chunked prefill is off there: docs/long-context.md), through
its own model code, CPU attention backend and hidden-state extraction (redraft's capture connector writes the
files); the reference is the HF backend capturing the same ids in chunks of 8,192 through its KV cache, as
extraction does. In fp32, per aux layer: median relative difference <= 1e-5 and the teacher's top-1 the same at
>= 99.9% of positions (the issue's goals). A 64-wide random Llama with a 64K context: the length is what is tested
(kimi-k25-mini, MLA, at 32,905 tokens: docs/results/long-capture, a benchmark: its CPU MLA prefill grows as T^2).
"""

from __future__ import annotations

from helpers_embedded import vllm_venv_python
from helpers_long import LENGTH, TEACHER, assert_equal_capture, long_sample

from extract.backends.vllm import VLLMTarget


def test_a_32k_sample_through_vllm_equals_the_chunked_hf_capture(tmp_path):
    py = vllm_venv_python()
    target, hf, ids, ours = long_sample(tmp_path)
    # max_length one above the sample: vLLM refuses a prompt of max_model_len tokens (the backend asks one more)
    engine = VLLMTarget(str(target), python=py, max_length=LENGTH + 1, kv_cache_bytes=1 << 29)
    try:
        theirs = engine.capture([ids], TEACHER)
    finally:
        engine.close()
    assert_equal_capture(hf, ours, theirs)
