"""Token-exact regeneration: the stored assistant tokens are the ids the target generated, in the context
it generated them in, for three thinking conventions, multi-turn conversations and cut replies.

Most tests script the target's sampler (`ScriptedTarget`: a real tiny model for capture, fixed reply ids
so the reasoning markers and tricky tokenizations are there for sure); the comparisons are always
against the (prompt, reply) pairs the backend was asked for and returned, never against our own code's
bookkeeping. The real Hugging Face `generate` runs in `test_real_hf_generation_is_stored_as_generated`
(tiny random models) and on SmolLM2 in the slow test.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from helpers_regen import assert_stored_as_generated, extract_cfg, recording_backend, stored_samples
from transformers import AutoTokenizer

import extract.pipeline as pipeline
from extract.backends.hf import HFTarget
from extract.chat import encode_prompt, stop_token_ids
from extract.generated import check_generated, generated_samples, prompt_sha256
from extract.records import Generation, Message, Record, read_records
from extract.regenerate import split_reasoning, think_markers
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.catalog.tiny_tokenizers import THINKING_KINDS
from redraft.core.dataset.reader import DatasetReader

# User turns of the scripted conversations (ScriptedTarget answers each with fixed ids)
Q1, Q2, Q3 = "What is 12 times 7?", "Write a short poem about the sea.", "Hello! How are you today?"
Q_SINGLE = "Speculative decoding drafts tokens."
EOT = {"kimi_k25": "<|im_end|>", "qwen3": "<|im_end|>", "deepseek_r1": "<｜end▁of▁sentence｜>", "chatml": "<|im_end|>"}


# ---------------------------------------------------------------------------------------------------------
# A target whose sampler follows a script
# ---------------------------------------------------------------------------------------------------------


class ScriptedTarget(HFTarget):
    """A real tiny model (capture) whose replies are fixed ids per user message. Like any backend it
    returns at most max_new_tokens ids, so a long script is cut there without its stop id."""

    def __init__(self, path: Path, replies: dict[str, list[int]]) -> None:
        super().__init__(str(path))
        self.replies = replies
        self.calls: list[tuple[list[int], list[int]]] = []

    def generate(self, prompts, gen, stop_ids):
        outputs = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            last_user = max(self.replies, key=text.rfind)
            out = self.replies[last_user][: gen.max_new_tokens]
            self.calls.append((list(p), list(out)))
            outputs.append(out)
        return outputs


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def enc_chars(tok, text: str) -> list[int]:
    """Ids that decode to `text` but are not its canonical encoding (one piece per character)."""
    return [i for ch in text for i in enc(tok, ch)]


def reply(tok, kind: str, reasoning: str, content: list[int], *, stop: bool = True) -> tuple[list[int], str, str]:
    """(ids, expected reasoning_content, expected content prefix) as the target writes them in `kind`'s style."""
    close = tok.convert_tokens_to_ids("</think>")
    if kind == "kimi_k25":  # the generation prompt opened <think>; no whitespace around the markers
        ids = enc(tok, reasoning) + [close] + content
        want = (reasoning, "")
    else:  # Qwen3 / DeepSeek-R1: "<think>\n" opened by the prompt, newlines around </think>
        ids = enc(tok, reasoning + "\n") + [close] + enc(tok, "\n\n") + content
        want = (reasoning + "\n", "\n\n")
    if stop:
        ids.append(tok.convert_tokens_to_ids(EOT[kind]))
    return ids, want[0], want[1]


@pytest.fixture(scope="module", params=THINKING_KINDS)
def scripted_run(request, tmp_path_factory):
    """Regenerate a three-turn conversation and a one-turn prompt with scripted thinking replies."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    target = make_tiny_llama(root / "target", chat=kind)
    tok = AutoTokenizer.from_pretrained(target)
    odd = enc_chars(tok, "I am fine, thank you.")
    assert odd != enc(tok, "I am fine, thank you.")  # the third reply is not canonically tokenized
    r1, think1, pre1 = reply(tok, kind, "12 times 7 is 84", enc(tok, "The answer is 84."))
    r3, think3, pre3 = reply(tok, kind, "A greeting", odd)
    r4, _, _ = reply(tok, kind, "Short", enc(tok, "Yes."))
    max_new = max(len(r1), len(r3), len(r4)) + 1
    long = enc(tok, "The sea and the wind sing softly. " * 8)
    assert len(long) > max_new  # the second reply is cut inside its reasoning
    replies = {Q1: r1, Q2: long, Q3: r3, Q_SINGLE: r4}
    data = root / "prompts.jsonl"
    data.write_text(json.dumps({"id": "c0", "turns": [Q1, Q2, Q3]}) + "\n"
                    + json.dumps({"id": "p1", "prompt": Q_SINGLE}) + "\n")
    backend = ScriptedTarget(target, replies)
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "load_backend", lambda cfg, path: backend)
    out = root / "ds"
    try:
        summary = pipeline.run_extraction(extract_cfg(target, data, out, regenerate=True, max_new_tokens=max_new))
    finally:
        mp.undo()
    return {"kind": kind, "target": target, "tok": tok, "out": out, "summary": summary, "calls": backend.calls,
            "want": {Q1: (think1, pre1 + "The answer is 84."), Q3: (think3, pre3 + "I am fine, thank you.")},
            "long": long, "max_new": max_new}


def test_stored_tokens_are_the_generated_ids(scripted_run):
    tok = scripted_run["tok"]
    samples = stored_samples(scripted_run["out"])
    assert len(scripted_run["calls"]) == 4
    assert_stored_as_generated(samples, scripted_run["calls"], set(stop_token_ids(tok)))
    regen = scripted_run["summary"].manifest["regeneration"]
    assert regen == {"samples": len(samples), "turns": 4, "mismatched_samples": 0, "cut_samples": 1,
                     "first_mismatches": []}


def test_cut_reply_is_stored_as_cut(scripted_run):
    tok, max_new = scripted_run["tok"], scripted_run["max_new"]
    cut_calls = [(p, o) for p, o in scripted_run["calls"] if o == scripted_run["long"][:max_new]]
    assert len(cut_calls) == 1
    prompt, output = cut_calls[0]
    holder = [s for s in stored_samples(scripted_run["out"]) if s.ids[: len(prompt) + max_new] == prompt + output]
    assert len(holder) == 1
    assert len(holder[0].ids) == len(prompt) + max_new  # nothing appended: no end-of-turn the target did not write
    assert holder[0].truncated
    cut = read_records([scripted_run["out"] / "regenerated.jsonl"]).records[0].messages[3]
    assert cut.generation.finish_reason == "length" and list(cut.generation.output_ids) == output
    assert cut.content == "" and cut.reasoning_content == tok.decode(output, clean_up_tokenization_spaces=False)


def test_reasoning_stays_where_the_target_put_it(scripted_run):
    kind, tok = scripted_run["kind"], scripted_run["tok"]
    c0 = read_records([scripted_run["out"] / "regenerated.jsonl"]).records[0]
    assert [m.role for m in c0.messages] == ["user", "assistant"] * 3
    for q, msg in ((Q1, c0.messages[1]), (Q3, c0.messages[5])):
        think, content = scripted_run["want"][q]
        assert (msg.reasoning_content, msg.content) == (think, content), kind
        assert msg.generation.finish_reason == "stop"
    if kind == "deepseek_r1":
        return  # R1's template knows no reasoning_content (it keeps only what follows </think>)
    # A valid chat input again: the template renders reasoning and content back into the target's text.
    prompt, output = next((p, o) for p, o in scripted_run["calls"] if Q1 in tok.decode(p) and Q2 not in tok.decode(p))
    first = c0.messages[1]
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": Q1},
         {"role": "assistant", "content": first.content, "reasoning_content": first.reasoning_content}],
        tokenize=False)
    assert rendered.startswith(tok.decode(prompt + output, clean_up_tokenization_spaces=False)), kind


def test_multi_turn_earlier_reasoning_dropped_by_the_template(scripted_run):
    kind, tok = scripted_run["kind"], scripted_run["tok"]
    samples = {s.sample_id: s for s in stored_samples(scripted_run["out"])}
    # Kimi renders the latest assistant turn with its reasoning, so turn 2's prompt extends turn 1's ids and
    # they share one sample; turn 3's prompt shows turn 1 without reasoning, so it starts a new one. Qwen3 and
    # R1 drop reasoning from every earlier turn: one sample per turn.
    chains = {"kimi_k25": ["c0/turn-1", "c0/turn-3"]}.get(kind, ["c0/turn-1", "c0/turn-2", "c0/turn-3"])
    assert sorted(samples) == sorted(chains + ["p1"])
    last = samples["c0/turn-3"]
    context = tok.decode(last.ids[: last.mask.index(1)])
    assert Q1 in context and Q3 in context and "The answer is 84." in context
    assert "12 times 7 is 84" not in context  # turn 1's reasoning is not in turn 3's prompt
    assert not last.truncated and samples["c0/turn-1"].truncated == (kind == "kimi_k25")


def test_re_extracting_regenerated_jsonl_reproduces_the_ids(scripted_run, tmp_path):
    """regenerated.jsonl as plain input (no --regenerate): the same samples, ids, masks and shard bytes."""
    out = tmp_path / "again"
    summary = pipeline.run_extraction(extract_cfg(scripted_run["target"], scripted_run["out"] / "regenerated.jsonl", out))
    first = stored_samples(scripted_run["out"])
    again = stored_samples(out)
    assert again == first
    assert [s["sha256"] for s in summary.manifest["shards"]] == \
        [s["sha256"] for s in scripted_run["summary"].manifest["shards"]]
    assert summary.manifest["regeneration"]["mismatched_samples"] == 0


def test_capture_with_another_template_is_counted_as_mismatch(scripted_run, tmp_path, caplog):
    """The check is real: a chat template that renders the prompts differently fails every sample, by name."""
    other = tmp_path / "other-target"
    shutil.copytree(scripted_run["target"], other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.chat_template = "{{- 'Be brief. ' -}}" + tok.chat_template
    tok.save_pretrained(other)
    with caplog.at_level(logging.WARNING, logger="extract.pipeline"):
        summary = pipeline.run_extraction(extract_cfg(other, scripted_run["out"] / "regenerated.jsonl", tmp_path / "ds"))
    regen = summary.manifest["regeneration"]
    assert regen["samples"] > 0 and regen["mismatched_samples"] == regen["samples"]
    assert {m["id"] for m in regen["first_mismatches"]} == set(DatasetReader(tmp_path / "ds").sample_ids)
    assert "the prompt it was generated from" in caplog.text and "c0/turn-1" in caplog.text


# ---------------------------------------------------------------------------------------------------------
# The check and the reasoning split, directly
# ---------------------------------------------------------------------------------------------------------


def _sample(tok, output: list[int], finish: str = "stop"):
    prompt = encode_prompt(tok, [Message("user", "Hi")])
    g = Generation(tuple(output), finish, len(prompt), prompt_sha256(prompt))
    rec = Record("r", (Message("user", "Hi"), Message("assistant", "x", generation=g)), "s", None, "f:1")
    return generated_samples(tok, rec, 512)[0], g


def test_check_flags_every_way_of_not_storing_the_generated_ids():
    from redraft.catalog.tiny_tokenizers import build_chat_tokenizer

    tok = build_chat_tokenizer("chatml")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    cut, g_cut = _sample(tok, enc(tok, "Hello there"), "length")
    assert check_generated(cut.input_ids, cut.loss_mask, [g_cut], True) is None
    assert "not flagged truncated" in check_generated(cut.input_ids, cut.loss_mask, [g_cut], False)
    # the template's end-of-turn appended to a cut reply, and trained on
    added = check_generated(cut.input_ids + [eot], cut.loss_mask + [1], [g_cut], True)
    assert "differ from the generated ids" in added
    # decode -> re-encode: the same text, other ids
    done, g = _sample(tok, enc_chars(tok, "Hello there") + [eot])
    assert check_generated(done.input_ids, done.loss_mask, [g], False) is None
    n = g.prompt_tokens
    reencoded = done.input_ids[:n] + enc(tok, "Hello there") + [eot]
    assert "differ" in check_generated(reencoded, [0] * n + [1] * (len(reencoded) - n), [g], False)
    # another context before the same reply
    other = encode_prompt(tok, [Message("user", "Ho")])
    assert len(other) == n
    shifted = other + list(g.output_ids)
    assert "not the prompt" in check_generated(shifted, [0] * n + [1] * len(g.output_ids), [g], False)
    # the reply left unmasked, or the prompt masked
    assert "not masked" in check_generated(done.input_ids, [0] * len(done.input_ids), [g], False)
    assert "starts at token 0" in check_generated(done.input_ids, [1] * len(done.input_ids), [g], False)
    two_runs = done.loss_mask[:]
    two_runs[1] = 1
    assert "starts at token 1" in check_generated(done.input_ids, two_runs, [g], False)


def test_split_reasoning_conventions():
    markers = ("<think>", "</think>")
    assert split_reasoning("r</think>c", markers, opened=True) == ("c", "r")  # the prompt opened <think>
    assert split_reasoning("<think>r</think>c", markers, opened=False) == ("c", "r")  # the target opened it
    assert split_reasoning("\nr\n</think>\n\nc", markers, opened=True) == ("\n\nc", "\nr\n")  # nothing stripped
    assert split_reasoning("still thinking", markers, opened=True) == ("", "still thinking")  # cut inside
    assert split_reasoning("no reasoning", markers, opened=False) == ("no reasoning", None)
    assert split_reasoning("<think>r</think>c", None, opened=False) == ("<think>r</think>c", None)
    from redraft.catalog.tiny_tokenizers import build_chat_tokenizer

    assert think_markers(build_chat_tokenizer("chatml")) is None
    assert all(think_markers(build_chat_tokenizer(k)) == markers for k in THINKING_KINDS)


# ---------------------------------------------------------------------------------------------------------
# The real Hugging Face generate
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chatml", "kimi_k25"])
def test_real_hf_generation_is_stored_as_generated(kind, tmp_path, monkeypatch):
    """Random tiny models write byte soup (invalid UTF-8 decodes to U+FFFD and re-encodes to other ids):
    exactly the replies a decode -> encode round trip would change."""
    target = make_tiny_llama(tmp_path / "t", chat=kind, seed=3)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"{Q1} {i}", Q3]}) + "\n" for i in range(3)))
    calls = recording_backend(monkeypatch)
    summary = pipeline.run_extraction(extract_cfg(target, data, tmp_path / "ds", regenerate=True, max_new_tokens=12,
                                           gen_batch_size=2))
    tok = AutoTokenizer.from_pretrained(target)
    assert len(calls) == 6
    samples = stored_samples(tmp_path / "ds")
    assert_stored_as_generated(samples, calls, set(stop_token_ids(tok)))
    assert summary.manifest["regeneration"]["mismatched_samples"] == 0
    assert summary.manifest["regeneration"]["turns"] == 6
    again = pipeline.run_extraction(extract_cfg(target, tmp_path / "ds" / "regenerated.jsonl", tmp_path / "again"))
    assert stored_samples(tmp_path / "again") == samples
    assert again.manifest["regeneration"]["mismatched_samples"] == 0


