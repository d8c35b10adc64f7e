"""kimi-k25-mini's facts the tests share: Kimi-K2.5's published text config, its special ids, greedy decoding, and
the built folder, its model and tokenizer as module fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_paths import FIXTURES

from redraft.catalog.kimi_mini import tokenizer as kimi_tok

# Kimi-K2.5's published text_config, as data (tests/fixtures): every value the miniature keeps must be exactly this.
KIMI_K25 = {k: v for k, v in json.loads((FIXTURES / "kimi_k25_text_config.json").read_text()).items()
            if not k.startswith("_")}
DEVIATED = {"model_type"}  # kimi_arch.KIMI_K25_DEVIATIONS["architectures / model_type"]: a text-only deepseek_v3
KIMI_SPECIALS = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
                 "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|im_middle|>": 163601, "<think>": 163606,
                 "</think>": 163607, "[UNK]": 163838, "[PAD]": 163839}
EOT = KIMI_SPECIALS["<|im_end|>"]
TEST_PROMPTS = ("Hello, what's your name?", "What did you have for dinner last night?",
                "Do you like music? What kind?", "Where would you like to travel next year?")


def greedy(model, tok, prompt: str, max_new: int = 48) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy reply ids) for one user turn in the miniature's chat template."""
    ids = kimi_tok.chat_ids(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=[EOT], pad_token_id=163839)
    return ids, [int(t) for t in out[0, len(ids):]]


# The built miniature as module fixtures (tests/conftest.py registers this module as a plugin): built once per
# cache, loaded once per module that asks.


@pytest.fixture(scope="module")
def kimi() -> Path:
    from helpers_embedded import kimi_mini_dir

    return kimi_mini_dir()


@pytest.fixture(scope="module")
def model(kimi):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(kimi, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def saved_tokenizer(kimi):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kimi)
