"""`--data self`: the user-turn prefix of real template shapes, per-prompt seeds, resume, and SmolLM2 end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from extract.backends.base import GenerationConfig
from extract.chat import USER_SENTINEL, user_turn_prefix
from extract.config import ExtractConfig
from extract.regen_engines import token_requests
from extract.self_prompts import (
    CATEGORY_TOPICS,
    RECIPE_NAME,
    REPORT_NAME,
    SELF_DIR,
    SELF_NAME,
    category_hint,
    prefixes,
    prompt_seed,
    resolve_categories,
    synthesise,
)
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.catalog.tiny_tokenizers import CHAT_KINDS, THINKING_KINDS, build_chat_tokenizer
from redraft.core.config import ConfigError
from redraft.engines.request import sglang_sampling_params


def _render_ids(tok, msgs):
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("kind", sorted(set(CHAT_KINDS) | set(THINKING_KINDS)))
def test_user_turn_prefix_is_what_the_template_puts_before_a_user_message(kind):
    tok = build_chat_tokenizer(kind)
    for system in (None, "Users ask you about cats."):
        ids = user_turn_prefix(tok, system)
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "the cat sat on a mat"}]
        assert _render_ids(tok, msgs)[: len(ids)] == ids
        text = tok.decode(ids, skip_special_tokens=False)
        assert USER_SENTINEL not in text
        assert "the cat sat" not in text
        if system:
            assert text.count("Users ask you about cats.") == 1


def test_chatml_prefix_keeps_the_default_system_prompt_and_a_hint_replaces_it():
    tok = build_chat_tokenizer("chatml")  # SmolLM2's template shape
    plain = tok.decode(user_turn_prefix(tok), skip_special_tokens=False)
    assert plain.endswith("<|im_start|>user\n")
    assert "You are a helpful AI assistant named SmolLM" in plain
    hinted = tok.decode(prefixes(tok, ["math"])["math"], skip_special_tokens=False)
    assert "SmolLM" not in hinted and CATEGORY_TOPICS["math"] in hinted and hinted.endswith("<|im_start|>user\n")


def test_categories_expand_and_unknown_ones_are_refused():
    assert resolve_categories(["mtbench"]) == tuple(CATEGORY_TOPICS)
    assert len(CATEGORY_TOPICS) == 8
    assert resolve_categories(["coding", "math", "coding"]) == ("coding", "math")
    with pytest.raises(ConfigError, match="unknown category 'cooking'"):
        resolve_categories(["cooking"])
    assert "programming" in category_hint("coding")


def test_per_prompt_seeds_reach_every_engine_request():
    gen = GenerationConfig(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=3)
    prompts = [[1, 2, 3]] * 4  # the same prefix four times: only the seeds tell them apart
    seeds = [prompt_seed(3, i) for i in range(4)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**31 for s in seeds)
    reqs = token_requests(prompts, [8] * 4, gen, [0], seeds)
    assert [r.seed for r in reqs] == seeds
    assert len({r.seed for r in token_requests(prompts, [8] * 4, gen, [0])}) == 1  # default: derived from the ids
    params = [sglang_sampling_params(r) for r in reqs]  # what the SGLang backend sends per request
    assert [p["sampling_seed"] for p in params] == seeds and all(p["top_p"] == 0.9 for p in params)


def test_config_needs_regenerate_and_a_positive_temperature(tmp_path):
    base = dict(target="t", data=["self"], out=str(tmp_path), rank=0, world_size=1)
    with pytest.raises(ConfigError, match="--regenerate"):
        ExtractConfig(**base).validate()
    with pytest.raises(ConfigError, match="self_temperature"):
        ExtractConfig(**base, regenerate=True, self_temperature=0.0).validate()
    cfg = ExtractConfig(**{**base, "data": ["chitchat,self"]}, regenerate=True,
                        self_categories=["math,coding"]).validate()
    assert cfg.data == ["chitchat", "self"] and cfg.self_categories == ["math", "coding"]


# ----------------------------------------------------------------------------- synthesis on a tiny model


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("target") / "llama", num_layers=4)


def _tiny_cfg(target: Path, out: Path, **kw) -> ExtractConfig:
    base = dict(target=str(target), data=["self"], out=str(out), regenerate=True, self_prompts=4,
                self_max_samples=12, self_max_new_tokens=6, self_language="any", self_categories=["mtbench"],
                gen_batch_size=4, rank=0, world_size=1)
    return ExtractConfig(**{**base, **kw}).validate()


def _synth(cfg: ExtractConfig, out: Path, calls: list[int] | None = None):
    from extract.backends.hf import HFTarget
    from extract.regen_engines import BackendRegenerator

    backend = HFTarget(cfg.target, name="tiny", device="cpu")

    def regenerator():
        if calls is not None:
            calls.append(1)
        return BackendRegenerator(backend)

    return synthesise(cfg, out, backend.tokenizer, regenerator)


def test_synthesis_resumes_and_reproduces_and_refuses_another_recipe(tiny_target, tmp_path):
    out = tmp_path / "ds"
    cfg = _tiny_cfg(tiny_target, out)
    first = _synth(cfg, out)
    counts = first.report["counts"]
    # A random model rarely ends its turn: few survive, so sampling runs on to --self-max-samples.
    assert counts["sampled"] == 12 and counts["dropped"]["cut"] >= 8
    assert counts["survived"] + sum(counts["dropped"].values()) == 12
    assert counts["kept"] == min(4, counts["survived"]) == len((out / SELF_NAME).read_text().splitlines())
    chunks = {p.name: p.read_bytes() for p in (out / SELF_DIR).glob("chunk-*.jsonl")}
    rows = [json.loads(line) for b in chunks.values() for line in b.decode().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(12))
    assert len({tuple(r["output_ids"]) for r in rows}) == 12  # same prefix per category, distinct samples
    assert [r["category"] for r in sorted(rows, key=lambda r: r["index"])][:9] == [*CATEGORY_TOPICS, "writing"]

    calls: list[int] = []
    again = _synth(cfg, out, calls)  # finished: nothing is sampled again
    assert calls == [] and again.report == first.report

    (out / SELF_NAME).unlink()  # killed before the result was written: the chunks are reused
    (out / SELF_DIR / REPORT_NAME).unlink()
    assert _synth(cfg, out, calls).report == first.report and calls == []

    shutil.rmtree(out / SELF_DIR)  # nothing kept: the same seeds sample the same prompts
    (out / SELF_NAME).unlink()
    _synth(cfg, out)
    assert {p.name: p.read_bytes() for p in (out / SELF_DIR).glob("chunk-*.jsonl")} == chunks

    with pytest.raises(ConfigError, match="another recipe.*top_p"):
        _synth(_tiny_cfg(tiny_target, out, self_top_p=0.5), out)
    (out / SELF_NAME).unlink()  # mid-way, too: the recipe is checked before the chunks are reused
    with pytest.raises(ConfigError, match="another recipe.*seed"):
        _synth(_tiny_cfg(tiny_target, out, seed=1), out)
    assert json.loads((out / SELF_DIR / RECIPE_NAME).read_text())["seed"] == 0


# ----------------------------------------------------------------------------- SmolLM2 end to end


