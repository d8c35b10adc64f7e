"""Tiny local chat tokenizers for tests: no downloads, byte-level BPE, < 1000 tokens.

`build_chat_tokenizer(kind)` returns a `PreTrainedTokenizerFast` whose chat template follows
the structure of a real target family, so tests exercise the same template shapes the
pipeline meets in production:

- "chatml": SmolLM2-Instruct (`<|im_start|>role\\n...<|im_end|>\\n`, default system prompt).
- "llama3": Llama-3.1-Instruct (`<|begin_of_text|>`, header ids, `<|eot_id|>`, trimmed content).
- "deepseek_v3": DeepSeek-V3 (system prompts hoisted to the top, `<｜User｜>`/`<｜Assistant｜>`).
- "kimi_k25": Kimi-K2.5 thinking (`<|im_*|>role<|im_middle|>`, `<think>reasoning</think>` on the
  last assistant turn, empty `<think></think>` on historical ones, generation prompt opens `<think>`).
- "qwen3": Qwen3 thinking (ChatML; `<think>`/`</think>` are added, not special, tokens; the generation
  prompt opens `<think>\\n`; reasoning is rendered, newline-wrapped, only after the last user turn).
- "deepseek_r1": DeepSeek-R1 (the DeepSeek-V3 layout; the generation prompt opens `<think>\\n`; the template
  knows no reasoning_content and keeps only what follows `</think>` of any assistant turn).

CHAT_KINDS are the families the loss-mask tests cover; THINKING_KINDS the three reasoning conventions
the token-exact regeneration tests cover.

Every tokenizer round-trips through `save_pretrained`/`from_pretrained` with its template.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from redraft.catalog.kimi_mini.tokenizer import CHAT_TEMPLATE as KIMI_CHAT_TEMPLATE

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: 26 Jul 2024\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

DEEPSEEK_V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# The product's Kimi-K2.5 thinking template (kimi-k25-mini's): one definition, proven here by the mask tests.
KIMI_K25_TEMPLATE = KIMI_CHAT_TEMPLATE

QWEN3_TEMPLATE = """{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- if m['role'] == 'assistant' -%}
    {%- set reasoning = m.get('reasoning_content') or '' -%}
    {%- set content = m['content'] -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[-1] -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_user -%}
      {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- content.lstrip('\n') + '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}
"""

DEEPSEEK_R1_TEMPLATE = DEEPSEEK_V3_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}",
)
assert DEEPSEEK_R1_TEMPLATE != DEEPSEEK_V3_TEMPLATE

_KINDS: dict[str, dict] = {
    "chatml": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "roles": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                  "pad_token": "<|im_end|>"},
        "template": CHATML_TEMPLATE,
    },
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>", "<|eom_id|>", "<|finetune_right_pad_id|>"],
        "roles": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                  "pad_token": "<|finetune_right_pad_id|>"},
        "template": LLAMA3_TEMPLATE,
    },
    "deepseek_v3": {
        "specials": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                     "<｜Assistant｜>"],
        "roles": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                  "pad_token": "<｜▁pad▁｜>"},
        "template": DEEPSEEK_V3_TEMPLATE,
    },
    "kimi_k25": {
        "specials": ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                     "<|im_middle|>", "<think>", "</think>", "[UNK]", "[PAD]"],
        "roles": {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"},
        "template": KIMI_K25_TEMPLATE,
    },
    "qwen3": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<think>", "</think>"],
        "roles": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "template": QWEN3_TEMPLATE,
    },
    "deepseek_r1": {
        "specials": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                     "<｜Assistant｜>"],
        "added": ["<think>", "</think>"],
        "roles": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                  "pad_token": "<｜▁pad▁｜>"},
        "template": DEEPSEEK_R1_TEMPLATE,
    },
}

CHAT_KINDS = ("chatml", "llama3", "deepseek_v3", "kimi_k25")
THINKING_KINDS = ("kimi_k25", "qwen3", "deepseek_r1")

_CORPUS = [
    "Hello! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea and the wind.",
    "You are a helpful assistant. Answer the question step by step.",
    "Let me think about this: 12 times 7 is 84, so the answer is 84.",
    "system user assistant reasoning content think answer question",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens that the target model verifies in parallel.",
]


@functools.cache
def _trained_json(kind: str) -> str:
    """Train the BPE once per kind; callers get a fresh tokenizer object built from the JSON."""
    spec = _KINDS[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


def build_chat_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A tiny byte-level tokenizer with the chat template of `kind` (one of CHAT_KINDS)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {tuple(_KINDS)}")
    spec = _KINDS[kind]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_json(kind)), **spec["roles"])
    tok.add_special_tokens({"additional_special_tokens": [
        s for s in spec["specials"] if s not in spec["roles"].values()
    ]})
    tok.add_tokens(spec.get("added", []))  # plain added tokens: decode keeps them even when skipping specials
    tok.chat_template = spec["template"]
    return tok
