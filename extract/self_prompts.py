"""`--data self`: the target writes its own user prompts (the "Magpie" recipe, Xu et al. 2024).

An aligned chat model given only its template's user-turn prefix (everything up to where a user's
text would start: BOS, the default system prompt, the user header) continues it with a plausible user
request and ends it with its end-of-turn id. Those requests are in the target's own distribution and
need no dataset. An optional hint steers them towards the eight MT-bench categories: a system message
of ours in place of the template's default, cycled over the prompts. The hint is not part of the
stored conversation: the prompt is answered like any other user request.

Sampling goes through the same regenerator as `--regenerate` (`extract.regen_engines`: hf, vllm or a
server), token ids in and out. Prompt ``i`` has its own seed, derived from ``--seed`` and ``i``, so
engines that seed per request (vLLM, SGLang, servers) write the same prompt ``i`` however the samples
are batched; hf samples a batch from one generator and reproduces with the same ``--gen-batch-size``.

Samples are drawn in chunks, each written to ``self_prompts/chunk-NNNNNN.jsonl`` as it completes, and
filtered in index order (``extract.prompt_filters``) until ``--self-prompts`` survive or
``--self-max-samples`` were drawn. The first ``--self-prompts`` survivors go to ``self_prompts.jsonl``
in the output folder (a valid input file again) and the recipe and counts to
``self_prompts/report.json`` and to the manifest. A rerun reuses the chunks and the result, and
refuses a folder whose prompts were written with another recipe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extract.backends.base import GenerationConfig
from extract.chat import chat_template_hash, sha256_json, stop_token_ids, tokenizer_hash, user_turn_prefix
from extract.decontaminate import eval_prompts
from extract.progress import Heartbeat
from extract.prompt_filters import DROP_REASONS, EvalSet, FilterSettings, PromptFilter
from extract.records import Message, Record, write_records_jsonl
from extract.regen_engines import Regenerator
from redraft.catalog.builtin import SELF_DATA
from redraft.core.atomic import atomic_write_text
from redraft.core.config import ConfigError

log = logging.getLogger(__name__)

SELF_NAME = "self_prompts.jsonl"  # in the output folder
SELF_DIR = "self_prompts"
REPORT_NAME = "report.json"
RECIPE_NAME = "recipe.json"
CHUNK = 256  # most samples per chunk (one regenerator call, one file)
METHOD = "magpie: the target continues its chat template's user-turn prefix (Xu et al. 2024)"

# The eight MT-bench categories, each with the topic a hint names (our wording).
CATEGORY_TOPICS = {
    "writing": "writing: stories, poems, essays, emails, speeches and other texts",
    "roleplay": "role-play: the assistant takes on a character, a profession or a persona in a scenario",
    "reasoning": "reasoning: logic puzzles, riddles and questions that need step-by-step thinking",
    "math": "mathematics: arithmetic, algebra, geometry, probability and word problems",
    "coding": "programming: writing, explaining, reviewing or fixing code",
    "extraction": "information extraction: pulling names, figures or facts out of a text the user provides",
    "stem": "science, technology, engineering and medicine",
    "humanities": "the humanities and social sciences: history, philosophy, economics, law, art",
}
CATEGORY_SETS = {"mtbench": tuple(CATEGORY_TOPICS)}  # names that stand for several categories


def category_hint(category: str) -> str:
    """The system message that steers sampled user requests towards a category."""
    return (f"You are a helpful AI assistant. Users come to you with questions and tasks about "
            f"{CATEGORY_TOPICS[category]}.")


def resolve_categories(names: Sequence[str]) -> tuple[str, ...]:
    """Category names with sets (mtbench) expanded; ConfigError naming an unknown one."""
    out: list[str] = []
    for name in names:
        for c in CATEGORY_SETS.get(name, (name,)):
            if c not in CATEGORY_TOPICS:
                known = ", ".join([*CATEGORY_SETS, *CATEGORY_TOPICS])
                raise ConfigError(f"self_categories: unknown category {name!r} (known: {known})")
            if c not in out:
                out.append(c)
    return tuple(out)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index`` (31 bits: every engine accepts it)."""
    digest = hashlib.sha256(f"redraft-self:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % ((1 << 31) - 1)


@dataclass(frozen=True)
class SelfPromptOptions:
    """What `--data self` is asked for (from ExtractConfig)."""

    prompts: int
    max_samples: int
    categories: tuple[str, ...]
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    decontaminate: tuple[str, ...]
    filters: FilterSettings

    @classmethod
    def from_config(cls, cfg: Any) -> SelfPromptOptions:
        # --max-samples N uses at most N records, so no more than N prompts are wanted (or sampled for)
        wanted = min(cfg.self_prompts, cfg.max_samples) if cfg.max_samples else cfg.self_prompts
        return cls(
            prompts=wanted,
            max_samples=cfg.self_max_samples or 4 * wanted,
            categories=resolve_categories(cfg.self_categories),
            temperature=cfg.self_temperature,
            top_p=cfg.self_top_p,
            max_new_tokens=cfg.self_max_new_tokens,
            seed=cfg.seed,
            decontaminate=tuple(cfg.self_decontaminate),
            filters=FilterSettings(language=cfg.self_language, near_duplicate=cfg.self_near_duplicate,
                                   eval_overlap=cfg.self_eval_overlap),
        )

    def generation(self, batch_size: int) -> GenerationConfig:
        return GenerationConfig(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                                seed=self.seed, batch_size=batch_size)


def prefixes(tokenizer: Any, categories: Sequence[str]) -> dict[str, list[int]]:
    """The prompt ids of each category ('' : no hint, the template's own default)."""
    if not categories:
        return {"": user_turn_prefix(tokenizer)}
    return {c: user_turn_prefix(tokenizer, category_hint(c)) for c in categories}


def make_recipe(opts: SelfPromptOptions, target: str, tokenizer: Any, starts: dict[str, list[int]],
                evals: Sequence[str]) -> dict[str, Any]:
    """Everything that decides the prompts; a rerun must agree with it (recorded in the manifest)."""
    return {
        "method": METHOD,
        "target": target,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": chat_template_hash(tokenizer),
        "prompts": opts.prompts,
        "max_samples": opts.max_samples,
        "categories": list(opts.categories),
        "hints": {c: category_hint(c) for c in opts.categories},
        "prefixes": {c: {"tokens": len(ids), "sha256": sha256_json(ids),
                         "text": tokenizer.decode(ids, skip_special_tokens=False)} for c, ids in starts.items()},
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "max_new_tokens": opts.max_new_tokens,
        "seed": opts.seed,
        "seeds": "sha256('redraft-self:{seed}:{index}') mod 2^31-1, one per prompt",
        "stop_token_ids": stop_token_ids(tokenizer),
        "filters": opts.filters.to_json(),
        "decontaminate": {"sources": list(opts.decontaminate), "prompts": len(evals), "sha256": sha256_json(list(evals))},
    }


def special_strings(tokenizer: Any) -> list[str]:
    """Special tokens' text: a prompt holding one has left the user turn."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted(t for t in found if t)


@dataclass
class SelfPromptsResult:
    """The written prompts and the report that goes into the manifest."""

    path: Path
    report: dict[str, Any]


def _check_same(path: Path, recipe: dict[str, Any], what: str) -> None:
    old = json.loads(path.read_text())
    old = old.get("recipe", old)
    if old != recipe:
        diff = sorted(k for k in set(old) | set(recipe) if old.get(k) != recipe.get(k))
        details = "; ".join(f"{k}: folder has {old.get(k)!r}, this run {recipe.get(k)!r}" for k in diff[:4])
        raise ConfigError(f"{path}: {what} were written with another recipe ({details}); use a new --out")


def _read_chunks(folder: Path) -> list[dict[str, Any]]:
    """Samples of the chunks written so far, in index order; stops at the first gap (a chunk is redone)."""
    samples: list[dict[str, Any]] = []
    for path in sorted(folder.glob("chunk-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not rows or rows[0]["index"] != len(samples):
            break
        samples += rows
    return samples


def _sample(regenerator: Regenerator, tokenizer: Any, opts: SelfPromptOptions, starts: dict[str, list[int]],
            first: int, count: int, batch_size: int, stops: Sequence[int]) -> list[dict[str, Any]]:
    cats = list(starts)
    index = list(range(first, first + count))
    cat_of = [cats[i % len(cats)] for i in index]
    seeds = [prompt_seed(opts.seed, i) for i in index]
    outs = regenerator.generate([starts[c] for c in cat_of], [opts.max_new_tokens] * count,
                                opts.generation(batch_size), stops, seeds=seeds)
    stop_set = set(stops)
    rows = []
    for i, cat, seed, ids in zip(index, cat_of, seeds, outs, strict=True):
        finished = bool(ids) and ids[-1] in stop_set
        body = ids[:-1] if finished else ids
        text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False).strip()
        rows.append({"index": i, "seed": seed, "category": cat or None, "output_ids": [int(t) for t in ids],
                     "finished": finished, "text": text})
    return rows


def _left_after(sampled: int, counts: Any) -> dict[str, int]:
    left, out = sampled, {}
    for reason in DROP_REASONS:
        left -= int(counts[reason])
        out[reason] = left
    return out


def synthesise(cfg: Any, out: Path, tokenizer: Any, regenerator: Callable[[], Regenerator]) -> SelfPromptsResult:
    """Write (or reuse) ``out/self_prompts.jsonl``; ``regenerator`` is called only when sampling is needed."""
    opts = SelfPromptOptions.from_config(cfg)
    evals = eval_prompts(opts.decontaminate)
    starts = prefixes(tokenizer, opts.categories)
    recipe = make_recipe(opts, cfg.target, tokenizer, starts, evals)
    folder = out / SELF_DIR
    final, report_path, recipe_path = out / SELF_NAME, folder / REPORT_NAME, folder / RECIPE_NAME
    if final.exists() and report_path.exists():
        _check_same(report_path, recipe, "the self-written prompts")
        log.info("reusing the %s self-written prompts in %s", json.loads(report_path.read_text())["counts"]["kept"],
                 final)
        return SelfPromptsResult(final, json.loads(report_path.read_text()))
    folder.mkdir(parents=True, exist_ok=True)
    if recipe_path.exists():
        _check_same(recipe_path, recipe, "the sampled prompts")
    else:
        atomic_write_text(recipe_path, json.dumps(recipe, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    for stale in folder.glob(".chunk-*.tmp-*"):
        stale.unlink(missing_ok=True)

    filt = PromptFilter(opts.filters, EvalSet(evals, opts.filters) if evals else None, special_strings(tokenizer))
    samples = _read_chunks(folder)
    if samples:
        log.info("self prompts: reusing %d samples already drawn in %s", len(samples), folder)
    survivors: list[dict[str, Any]] = []

    def judge(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if filt.check(row["text"], finished=row["finished"]).keep:
                survivors.append(row)

    judge(samples)
    stops = stop_token_ids(tokenizer)
    engine: Regenerator | None = None
    beat = Heartbeat(f"self prompts ({opts.prompts} wanted)", total=opts.max_samples, unit="drawn (at most)")
    beat.advance(len(samples))
    with beat:
        while len(survivors) < opts.prompts and len(samples) < opts.max_samples:
            rate = max(len(survivors) / len(samples), 0.1) if samples else 1.0
            count = min(CHUNK, opts.max_samples - len(samples), math.ceil((opts.prompts - len(survivors)) / rate))
            engine = engine or regenerator()
            rows = _sample(engine, tokenizer, opts, starts, len(samples), count, cfg.gen_batch_size, stops)
            path = folder / f"chunk-{len(samples):09d}.jsonl"
            atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            samples += rows
            judge(rows)
            dropped = {k: v for k, v in sorted(filt.counts.items()) if k != "kept"}
            log.info("self prompts: %d sampled, %d of %d wanted survive the filters; dropped %s", len(samples),
                     min(len(survivors), opts.prompts), opts.prompts, dropped or "none")
    kept = survivors[: opts.prompts]
    if len(kept) < opts.prompts:
        log.warning("self prompts: only %d of %d wanted survived %d samples (--self-max-samples); "
                    "going on with those", len(kept), opts.prompts, len(samples))
    counts = {
        "sampled": len(samples),
        "kept": len(kept),
        "survived": len(survivors),  # survivors past the wanted number are drawn in the last chunk, unused
        "dropped": {r: int(filt.counts[r]) for r in DROP_REASONS if filt.counts[r]},
        # How many are left after each check, in the order they run (a prompt counts at its first failure).
        "left_after": _left_after(len(samples), filt.counts),
    }
    if opts.categories:
        counts["by_category"] = {c: sum(r["category"] == c for r in kept) for c in opts.categories}
    records = [Record(f"self-{r['index']:06d}", (Message("user", r["text"]),), SELF_DATA, r["category"],
                      f"{folder}:{r['index']}") for r in kept]
    write_records_jsonl(final, records)
    report = {"recipe": recipe, "counts": counts, "file": SELF_NAME}
    atomic_write_text(report_path, json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    log.info("self prompts: wrote %d to %s (%d sampled; dropped %s)", len(kept), final, len(samples),
             counts["dropped"] or "none")
    return SelfPromptsResult(final, report)
