"""Loss masks from real-shaped chat templates: exactly the assistant tokens, on four template families."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from extract.chat import (
    _tokenize_by_segments,
    assistant_char_spans,
    chat_template_hash,
    encode_prompt,
    stop_token_ids,
    tokenize_conversation,
    tokenizer_hash,
)
from extract.records import Message
from redraft.catalog.tiny_tokenizers import CHAT_KINDS, build_chat_tokenizer

EOT = {
    "chatml": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "deepseek_v3": "<｜end▁of▁sentence｜>",
    "kimi_k25": "<|im_end|>",
}
# Tokens that only ever belong to prompts (role headers, BOS): never masked.
HEADER_TOKENS = {
    "chatml": ["<|im_start|>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"],
    "deepseek_v3": ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
    "kimi_k25": ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<think>"],
}

CONVO = (
    Message("system", "You answer briefly."),
    Message("user", "Hello! How are you today?"),
    Message("assistant", "I am fine, thank you.", reasoning_content="A greeting; reply politely."),
    Message("user", "What is 12 times 7?"),
    Message("assistant", "12 times 7 is 84. Café ☕ ok", reasoning_content="12*7 = 84."),
    Message("user", "Write a short poem about the sea."),
    Message("assistant", "The sea and the wind\nsing softly.", reasoning_content="Keep it short."),
)


@pytest.fixture(scope="module", params=CHAT_KINDS)
def kind_tok(request):
    return request.param, build_chat_tokenizer(request.param)


def masked_runs(tok, sample) -> list[str]:
    """Decoded text of each contiguous run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(sample.input_ids, sample.loss_mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def expected_turn(kind: str, msg: Message, is_last: bool) -> str:
    """What the target generates after its generation prompt for this assistant turn."""
    if kind == "llama3":
        return msg.content.strip() + EOT[kind]
    if kind == "kimi_k25":
        # The generation prompt opens <think>; the last turn shows reasoning, history shows none.
        reasoning = (msg.reasoning_content or "") if is_last else ""
        return reasoning + "</think>" + msg.content + EOT[kind]
    return msg.content + EOT[kind]


def test_every_assistant_turn_masked_and_only_those(kind_tok):
    kind, tok = kind_tok
    sample = tokenize_conversation(tok, CONVO, max_length=4096)
    assert not sample.truncated
    assert len(sample.input_ids) == len(sample.loss_mask)
    assert set(sample.loss_mask) == {0, 1}
    assistants = [m for m in CONVO if m.role == "assistant"]
    expected = [expected_turn(kind, m, i == len(assistants) - 1) for i, m in enumerate(assistants)]
    assert masked_runs(tok, sample) == expected
    # The tokens are the template's own rendering, BOS included once.
    assert tok.decode(sample.input_ids) == tok.apply_chat_template(
        [{"role": m.role, "content": m.content, "reasoning_content": m.reasoning_content} for m in CONVO],
        tokenize=False,
    )


def test_no_header_system_or_user_token_masked(kind_tok):
    kind, tok = kind_tok
    sample = tokenize_conversation(tok, CONVO, max_length=4096)
    header_ids = {tok.convert_tokens_to_ids(t) for t in HEADER_TOKENS[kind]}
    masked = {i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m}
    assert not masked & header_ids
    unmasked_text = tok.decode([i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m])
    for m in CONVO:
        if m.role != "assistant":
            assert m.content in unmasked_text


def test_prompt_tokens_match_serving_prompt(kind_tok):
    """The prompt the target sees when generating turn i is a token prefix, unmasked, then masking starts."""
    kind, tok = kind_tok
    turns = [i for i, m in enumerate(CONVO) if m.role == "assistant"]
    convo = CONVO
    if kind == "kimi_k25":
        # Kimi shows a turn's reasoning only while it is the last turn, so a prompt rendered for a
        # later turn differs from the history; serving sees the same, so compare without it.
        convo = tuple(Message(m.role, m.content) if i != turns[-1] else m for i, m in enumerate(CONVO))
    sample = tokenize_conversation(tok, convo, max_length=4096)
    for i in turns:
        prompt = encode_prompt(tok, convo[:i])
        assert sample.input_ids[: len(prompt)] == prompt
        assert sample.loss_mask[len(prompt)] == 1
        prev_assistant = max((j for j in turns if j < i), default=None)
        if prev_assistant is None:
            assert sum(sample.loss_mask[: len(prompt)]) == 0


def test_encode_prompt_ends_with_generation_prompt(kind_tok):
    kind, tok = kind_tok
    text = tok.decode(encode_prompt(tok, CONVO[:2]))
    suffix = {
        "chatml": "<|im_start|>assistant\n",
        "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "deepseek_v3": "<｜Assistant｜>",
        "kimi_k25": "<|im_assistant|>assistant<|im_middle|><think>",
    }[kind]
    assert text.endswith(suffix)
    bos = {"llama3": "<|begin_of_text|>", "deepseek_v3": "<｜begin▁of▁sentence｜>"}.get(kind)
    if bos:
        assert text.startswith(bos) and text.count(bos) == 1


def test_truncation(kind_tok):
    _, tok = kind_tok
    full = tokenize_conversation(tok, CONVO, max_length=4096)
    cut = tokenize_conversation(tok, CONVO, max_length=len(full.input_ids) - 5)
    assert cut.truncated
    assert cut.input_ids == full.input_ids[:-5]
    assert cut.loss_mask == full.loss_mask[:-5]
    exact = tokenize_conversation(tok, CONVO, max_length=len(full.input_ids))
    assert not exact.truncated and exact.input_ids == full.input_ids
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(tok, CONVO, max_length=0)


def test_single_turn_without_system_and_empty_answer(kind_tok):
    kind, tok = kind_tok
    convo = (Message("user", "Hi"), Message("assistant", ""), Message("user", "Again?"), Message("assistant", "Yes."))
    sample = tokenize_conversation(tok, convo, max_length=512)
    expected = [expected_turn(kind, convo[1], False), expected_turn(kind, convo[3], True)]
    assert masked_runs(tok, sample) == expected


def test_segment_tokenization_matches_offsets(kind_tok):
    """The slow-tokenizer path (no offsets) gives the same ids and mask on these templates."""
    _, tok = kind_tok
    text, spans = assistant_char_spans(tok, CONVO)
    ids, mask = _tokenize_by_segments(tok, text, spans)
    sample = tokenize_conversation(tok, CONVO, max_length=4096)
    assert ids == sample.input_ids
    assert mask == sample.loss_mask


def test_stop_token_ids():
    expected = {
        "chatml": ["<|im_end|>", "<|endoftext|>"],
        "llama3": ["<|eot_id|>", "<|eom_id|>"],
        "deepseek_v3": ["<｜end▁of▁sentence｜>"],
        "kimi_k25": ["[EOS]", "<|im_end|>"],
    }
    for kind in CHAT_KINDS:
        tok = build_chat_tokenizer(kind)
        ids = stop_token_ids(tok)
        assert tok.convert_ids_to_tokens(ids) == expected[kind]
        assert ids[0] == tok.eos_token_id


def test_kimi_reasoning_history_fallback():
    """Kimi renders a turn's reasoning only while it is the last one, so prefix renders do not line up."""
    tok = build_chat_tokenizer("kimi_k25")
    dicts = [{"role": m.role, "content": m.content, "reasoning_content": m.reasoning_content} for m in CONVO]
    full = tok.apply_chat_template(dicts, tokenize=False)
    first_turn = tok.apply_chat_template(dicts[:3], tokenize=False)
    assert "<think>A greeting; reply politely.</think>" in first_turn
    assert not full.startswith(first_turn)  # the plain prefix method cannot work here
    assert "<think></think>I am fine" in full
    sample = tokenize_conversation(tok, CONVO, max_length=4096)
    runs = masked_runs(tok, sample)
    assert runs[0] == "</think>I am fine, thank you.<|im_end|>"
    assert runs[-1] == "Keep it short.</think>The sea and the wind\nsing softly.<|im_end|>"


def test_reasoning_ignored_by_templates_that_do_not_render_it():
    for kind in ("chatml", "llama3", "deepseek_v3"):
        tok = build_chat_tokenizer(kind)
        sample = tokenize_conversation(tok, CONVO, max_length=4096)
        assert "Keep it short." not in tok.decode(sample.input_ids)


def test_unmaskable_template_raises():
    # DeepSeek hoists every system message to the top, so a late system message rewrites earlier prompts.
    tok = build_chat_tokenizer("deepseek_v3")
    convo = (Message("user", "Hi"), Message("assistant", "Hello."), Message("system", "Be terse."),
             Message("user", "Bye"), Message("assistant", "Bye."))
    with pytest.raises(ValueError, match="assistant message 1.*not a prefix"):
        tokenize_conversation(tok, convo, max_length=512)


def test_missing_template_raises():
    tok = build_chat_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_conversation(tok, CONVO, max_length=64)
    with pytest.raises(ValueError, match="no chat template"):
        chat_template_hash(tok)


def test_hashes_stable_across_save_load(tmp_path):
    hashes = {}
    for kind in CHAT_KINDS:
        tok = build_chat_tokenizer(kind)
        th, ch = tokenizer_hash(tok), chat_template_hash(tok)
        assert len(th) == 64 and len(ch) == 64
        tok(["a b c"], truncation=True, max_length=2, padding="max_length")  # mutates backend state
        assert tokenizer_hash(tok) == th
        tok.save_pretrained(tmp_path / kind)
        loaded = AutoTokenizer.from_pretrained(tmp_path / kind)
        assert tokenizer_hash(loaded) == th
        assert chat_template_hash(loaded) == ch
        assert tokenize_conversation(loaded, CONVO, 4096) == tokenize_conversation(tok, CONVO, 4096)
        hashes[kind] = (th, ch)
    assert len({h[0] for h in hashes.values()}) == len(CHAT_KINDS)
    assert len({h[1] for h in hashes.values()}) == len(CHAT_KINDS)
    tok = build_chat_tokenizer("chatml")
    tok.chat_template = tok.chat_template + " "
    assert chat_template_hash(tok) != hashes["chatml"][1]
    tok.add_tokens(["<extra_tok>"])
    assert tokenizer_hash(tok) != hashes["chatml"][0]


def test_helper_tokenizers_are_small():
    for kind in CHAT_KINDS:
        assert len(build_chat_tokenizer(kind)) <= 1000
