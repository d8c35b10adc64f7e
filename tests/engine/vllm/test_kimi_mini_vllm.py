"""vLLM CPU loads the built kimi-k25-mini and decodes greedily token for token as transformers does."""

from __future__ import annotations

import pytest
from helpers_kimi import EOT, TEST_PROMPTS, greedy

pytestmark = pytest.mark.uses_kimi_mini  # run after the tier's other files (tests/conftest.py)


def test_vllm_loads_it_and_decodes_as_transformers(kimi, model, saved_tokenizer):
    from helpers_embedded import vllm_venv_python

    from redraft.engines.request import TokenRequest
    from redraft.engines.vllm import EngineSettings, VLLMEngine

    python = vllm_venv_python()
    max_new = 48
    prompts, hf = [], []
    for p in TEST_PROMPTS:
        ids, reply = greedy(model, saved_tokenizer, p, max_new)
        prompts.append(ids)
        hf.append(reply)
    settings = EngineSettings(target=str(kimi), dtype="float32", max_model_len=512, kv_cache_bytes=1 << 28)
    with VLLMEngine(settings, python=python, timeout_s=900, what="vLLM (kimi-k25-mini)") as engine:
        rows = engine.generate([TokenRequest(id=str(i), prompt_token_ids=ids, max_tokens=max_new, stop_token_ids=[EOT])
                                for i, ids in enumerate(prompts)])
    got = [r["output_token_ids"] for r in sorted(rows, key=lambda r: int(r["id"]))]
    agree = [g == h for g, h in zip(got, hf, strict=True)]
    print(f"vLLM vs transformers greedy, token for token: {sum(agree)}/{len(agree)}")
    # the stop id is honoured: each reply ends at its first <|im_end|> or runs to the limit, and some end
    assert all(g.index(EOT) == len(g) - 1 if EOT in g else len(g) == max_new for g in got), got
    assert any(g[-1] == EOT for g in got), [saved_tokenizer.decode(g) for g in got]
    assert all(agree), [(saved_tokenizer.decode(g), saved_tokenizer.decode(h)) for g, h in zip(got, hf, strict=True)]
