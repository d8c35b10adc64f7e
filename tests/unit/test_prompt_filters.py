"""Filters of self-written prompts on real text: MT-bench must be caught, chitchat must pass, duplicates go."""

from __future__ import annotations

import random

import pytest

from extract.prompt_filters import (
    EvalSet,
    FilterSettings,
    MinHashIndex,
    PromptFilter,
    degenerate_reason,
    jaccard,
    ngrams,
)
from extract.self_prompts import eval_prompts
from redraft.catalog.builtin import chitchat_records

SETTINGS = FilterSettings()


@pytest.fixture(scope="module")
def mtbench() -> list[str]:
    texts = eval_prompts(["mtbench"])
    assert len(texts) == 160  # 80 questions, 2 turns each
    return texts


@pytest.fixture(scope="module")
def chitchat() -> list[str]:
    """Real human openers long enough to pass the single-prompt checks (a stand-in for fresh prompts)."""
    out = []
    for rec in chitchat_records():
        text = rec["conversations"][0]["value"]
        if degenerate_reason(text, SETTINGS) is None:
            out.append(text)
        if len(out) == 600:
            break
    assert len(out) == 600
    return out


def test_mtbench_prompts_injected_among_fresh_ones_are_all_removed(mtbench, chitchat):
    rng = random.Random(0)
    variants = {
        "verbatim": list(mtbench),
        "recased": [t.upper().replace(",", " ,") for t in mtbench],
        "wrapped": [f"Hi! Could you help me with this? {t} Thank you so much." for t in mtbench],
        "first_half": [" ".join(t.split()[: len(t.split()) // 2]) for t in mtbench if len(t.split()) >= 16],
    }
    filt = PromptFilter(SETTINGS, EvalSet(mtbench, SETTINGS))
    stream = [(t, None) for t in chitchat] + [(t, kind) for kind, ts in variants.items() for t in ts]
    rng.shuffle(stream)
    missed, false_hits = [], []
    for text, kind in stream:
        v = filt.check(text)
        if kind is not None and v.reason != "eval_overlap" and v.reason != "not_text":
            missed.append((kind, text[:80], v.reason))
        if kind is None and v.reason == "eval_overlap":
            false_hits.append((text[:80], (v.match or "")[:80]))
    assert not missed
    assert not false_hits
    assert filt.counts["eval_overlap"] >= sum(len(v) for v in variants.values()) - 4  # 1 data-only MT-bench turn


def test_eval_set_catches_an_edited_mtbench_question(mtbench):
    ev = EvalSet(mtbench, SETTINGS)
    long = [t for t in mtbench if len(t.split()) >= 25]
    for t in long:
        words = t.split()
        words[len(words) // 2] = "zebra"  # one word changed in the middle
        assert ev.match(" ".join(words)) is not None, t


def test_exact_and_near_duplicates_are_dropped_distinct_prompts_kept(chitchat):
    long = [t for t in chitchat if len(t.split()) >= 20][:50]
    filt = PromptFilter(SETTINGS)
    assert all(filt.check(t).keep for t in long)
    for t in long:
        assert filt.check("  " + t.lower() + "!! ").reason == "duplicate"
        near = t.split()
        near[-1] = "banana"  # the last word changed: 3-gram Jaccard well above 0.7 on 20+ words
        assert filt.check(" ".join(near)).reason == "near_duplicate"
    assert filt.counts == {"kept": 50, "duplicate": 50, "near_duplicate": 50}


def test_minhash_index_finds_what_brute_force_finds(chitchat):
    """The LSH candidates plus exact Jaccard agree with comparing every pair, on real text and edits of it."""
    rng = random.Random(1)
    texts = []
    for t in chitchat[:300]:
        texts.append(t)
        words = t.split()
        for _ in range(rng.randrange(3)):
            words[rng.randrange(len(words))] = rng.choice(["yes", "cake", "tomorrow", "blue"])
        texts.append(" ".join(words))
    grams = [ngrams(t) for t in texts]
    index = MinHashIndex(0.5)
    stored: list[frozenset[str]] = []
    for g in grams:
        found = index.query(g)
        truth = [j for j, s in enumerate(stored) if jaccard(g, s) >= 0.5]
        assert (found is not None) == bool(truth)
        if found is not None:
            assert jaccard(g, stored[found]) >= 0.5
        else:
            index.add(g)
            stored.append(g)
    assert 300 <= len(stored) < len(texts)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("   \n ", "empty"),
        ("What is a good name for a cat?<|im_end|>\n<|im_start|>assistant\nTom", "template_tokens"),
        ("Hello there", "too_short"),
        ("1234 5678 = ?? ## 99.5 / 12 ** 4 -- 77 + 88", "not_text"),
        ("请帮我写一首关于秋天的诗，要求押韵并且不少于八行。", "not_english"),
        ("Peux-tu m'écrire une lettre pour remercier mon voisin de son aide pendant mon déménagement ?",
         "not_english"),
        ("Tell me a story. Tell me a story. Tell me a story. Tell me a story. Tell me a story.", "repetitive"),
        ("Write a short poem about the first snow of winter in a small mountain village.", None),
    ],
)
def test_degenerate_text_checks(text, reason):
    assert degenerate_reason(text, SETTINGS, ["<|im_start|>", "<|im_end|>"]) == reason


def test_language_any_keeps_other_languages():
    assert degenerate_reason("请帮我写一首关于秋天的诗，要求押韵并且不少于八行。", FilterSettings(language="any")) is None


def test_cut_prompts_are_dropped_first():
    filt = PromptFilter(SETTINGS)
    assert filt.check("Write a short poem about the first snow", finished=False).reason == "cut"
    assert filt.check("Write a short poem about the first snow").keep
