"""kimi-k25-mini's tokenizer: SmolLM2's BPE with Kimi-K2.5's special tokens at their ids, and the thinking template."""

from __future__ import annotations

import json
from typing import Any

from redraft.catalog.packaged import SMOLLM2_GGUF, distribution_file

# Kimi-K2.5's special tokens at Kimi-K2.5's ids (its BPE occupies 0..163583; the rest of 163584..163839 are
# reserved tokens, left out here).
SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}
END_OF_TURN = "<|im_end|>"
TOKENIZER_ROLES = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# Kimi-K2.5 thinking: `<|im_*|>role<|im_middle|>`, `<think>reasoning</think>` on the last assistant turn, an
# empty `<think></think>` on historical ones, a default system prompt, the generation prompt opens `<think>`
# (`thinking=false` renders `<think></think>` instead).
CHAT_TEMPLATE = """{%- set ns = namespace(last_assistant=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'assistant' -%}{%- set ns.last_assistant = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}
    <|im_user|>user<|im_middle|>
  {%- elif m['role'] == 'assistant' -%}
    <|im_assistant|>assistant<|im_middle|>
  {%- else -%}
    <|im_system|>system<|im_middle|>
  {%- endif -%}
  {%- if m['role'] == 'assistant' -%}
    {%- if loop.index0 == ns.last_assistant and not (thinking is defined and thinking is false) -%}
      <think>{{ m.get('reasoning_content') or '' }}</think>
    {%- else -%}
      <think></think>
    {%- endif -%}
  {%- endif -%}
  {{ m['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
"""


def build_tokenizer() -> Any:
    """SmolLM2's byte-level BPE (text ids 0..49151) with Kimi-K2.5's special tokens at Kimi-K2.5's ids.

    SmolLM2's own 17 special tokens (ids 0..16, ``<|im_end|>`` among them) are renamed
    ``<|reserved_smollm2_N|>`` so that no text maps to them and no name is shared with a Kimi token.
    """
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    gguf = distribution_file(SMOLLM2_GGUF.distribution, SMOLLM2_GGUF.gguf_path)
    smol = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    spec = json.loads(smol.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = spec["added_tokens"]
    for tok in added:
        renamed = f"<|reserved_smollm2_{tok['id']}|>"
        if vocab.pop(tok["content"], None) != tok["id"]:
            raise RuntimeError(f"SmolLM2 special token {tok['content']!r} is not id {tok['id']} of its BPE vocabulary")
        vocab[renamed] = tok["id"]
        tok["content"] = renamed
    for content, i in SPECIAL_TOKENS.items():
        if content in vocab:
            raise RuntimeError(f"{content!r} is already in SmolLM2's vocabulary")
        vocab[content] = i  # a sparse id in the model vocabulary: the added token then keeps it
        added.append({"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **TOKENIZER_ROLES)
    tok.chat_template = CHAT_TEMPLATE
    for content, i in SPECIAL_TOKENS.items():
        if tok.convert_tokens_to_ids(content) != i:
            raise RuntimeError(f"{content!r} got id {tok.convert_tokens_to_ids(content)}, expected {i}")
    return tok


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The template's token ids for ``messages`` (a plain list, whatever apply_chat_template returns)."""
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return [int(i) for i in enc["input_ids"]]
