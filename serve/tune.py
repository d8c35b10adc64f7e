"""Which speculative settings to serve a drafter with, per concurrency, measured in a real engine.

    python -m serve.tune EXPORT --target T --data TRAFFIC --offline OFFLINE.json [--steps 1,2,3,4,5] \\
        [--concurrency 1,4,16] [--repeats 3] [--exports OTHER_EXPORT] --out runs/tune

The serving stage's inputs are the upstream stages' files: EXPORT, the drafter in one engine's layout
(``python -m eval.export``; its ``redraft.json`` names the engine swept); TRAFFIC, prompts answered by the target
(``python -m extract --regenerate``); OFFLINE, ``python -m eval.acceptance --json`` of the drafter on the same
samples (``serve/traffic.py`` checks that). ``python -m redraft.pipeline.tune`` makes all three from a checkpoint and
any prompts and then runs this, in one command. The engine is sent exactly the dataset's prompt ids.

Stages, each logged:

1. offline: tau for chains of 1..max(--steps) drafts (vLLM's walk), read from OFFLINE;
2. probes: short runs of base and of ``--probe-steps`` (default the smallest and largest k) on a few prompts,
   which fix the cost model's step costs (``serve/cost_model.py``) and so the *predicted* speed-up of every
   setting at every concurrency. ``--predict-only`` stops here: on a cluster, where each server start of a
   large target takes minutes, this is what avoids a full sweep;
3. sweep: base and every setting (k drafts), interleaved repeats, each on a freshly started server
   (``serve.repeats``, the loop ``benchmarks/serving_gain.py`` runs), tokens/s and the engine's acceptance
   per position from its own counters. The first repeat shares its server starts with the probes: a setting
   both probed and swept is started once, probed, then swept on that start (a start of a large target takes
   minutes); later repeats start afresh;
4. the answer (``serve/tune_report.py``): per concurrency the best setting and its speed-up (min-max over
   repeats), the concurrency from which no setting beats base, the launch lines with explicit request limits
   (each engine pointed at its own export: EXPORT and ``--exports``), and the prediction beside each measured
   ratio. OUT/report.json, report.md, report.png.

Engines: vLLM (in this interpreter on a GPU machine, else the vLLM CPU venv of ``make vllm-cpu-venv``) or
SGLang (this interpreter's, else the SGLang CPU venv of ``make sglang-cpu-venv``: SGLang's own engine with
redraft's stand-in for its CPU kernels, whose speed is the stand-in's, not SGLang's compiled kernels');
``--engine-python`` names another interpreter. The settings are chains of k drafts (SGLang: steps k, topk 1,
k + 1 draft tokens); each server's ``max_running_requests`` is reported as the server states it (SGLang's 48
when it speculates and none was asked).
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

from redraft.catalog.builtin import resolve_target
from redraft.core import cli as ending
from redraft.core import options
from redraft.core.config import ConfigError
from redraft.core.errors import UserError
from redraft.core.options import option
from redraft.engines.driver_protocol import EngineError
from redraft.engines.interpreters import engine_interpreter
from redraft.engines.launch import ENGINES, export_engine
from redraft.engines.sglang import installed_version
from serve import cost_model
from serve import doctor_findings as rules
from serve.repeats import (
    BASE,
    Job,
    ServerOptions,
    ServerSpec,
    SweepError,
    pool_server,
    run_interleaved,
    run_on_one_start,
)
from serve.traffic import Traffic, TrafficError, read_offline, read_traffic
from serve.tune_report import DEFINITIONS, answer, recommendation, setting_name, write_outputs

log = logging.getLogger("serve.tune")


class TuneError(UserError):
    """A stage that failed or inputs that do not fit together; the message says which."""


@dataclass(kw_only=True)
class TuneOptions:
    """The options of python -m serve.tune (redraft.core.options: --help, YAML keys and values)."""

    drafter: str = option(help="the drafter as one engine's export (python -m eval.export): the engine swept is "
                               "the one its redraft.json names", group="inputs", positional=True, metavar="EXPORT")
    target: str = option(help="target folder or built-in name", group="inputs")
    data: str = option(help="the traffic: a dataset of prompts answered by the target (python -m extract "
                            "--regenerate)", group="inputs")
    offline: str = option(help="python -m eval.acceptance --json of the drafter on --data (--split all "
                               "--max-samples NUM_PROMPTS --steps max(STEPS) --engine vllm)", group="inputs")
    exports: list[str] = option([], "the drafter's exports for other engines, for their launch lines",
                                group="inputs")
    num_prompts: int = option(32, "samples of the traffic used", group="inputs")
    engine_python: str | None = option(None, "interpreter with the engine (default: this one if it has it, else its "
                                             "CPU venv: VLLM_CPU_VENV / SGLANG_CPU_VENV or ~/.cache/redraft/*-cpu)",
                                       group="engine")
    dtype: str = option("float32", "the engine's dtype (vLLM --dtype)", group="engine")
    max_model_len: int = option(2048, "vLLM --max-model-len / SGLang --context-length", group="engine")
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
    out: str = option("runs/tune", "folder for report.json/.md/.png", group="output")

    def validate(self) -> None:
        if not self.steps or min(self.steps) < 1:
            raise ConfigError(f"--steps: positive integers, got {list(self.steps)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError(f"--concurrency: positive integers, got {list(self.concurrency)}")
        for name in ("repeats", "num_prompts", "probe_prompts", "min_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if any(k < 1 for k in self.probes()):
            raise ConfigError(f"--probe-steps: positive integers, got {list(self.probes())}")

    def probes(self) -> tuple[int, ...]:
        if self.probe_steps:
            return tuple(sorted(set(self.probe_steps)))
        return tuple(sorted({min(self.steps), max(self.steps)}))

    def chains(self) -> list[int]:
        """Every chain length the run needs offline tau for: the sweep's and the probes'."""
        return sorted(set(self.steps) | set(self.probes()))


# ----------------------------------------------------------------------------- inputs


def read_exports(cfg: TuneOptions) -> tuple[str, dict[str, str]]:
    """(the engine swept, engine -> export folder): EXPORT names the engine; --exports add the others."""
    if not Path(cfg.drafter).is_dir():
        raise TuneError(f"EXPORT {cfg.drafter}: no such folder")
    engine = export_engine(Path(cfg.drafter))
    if engine is None:
        raise TuneError(f"EXPORT {cfg.drafter}: not an eval.export folder (no redraft.json naming its engine); "
                        "export the checkpoint with python -m eval.export, or run python -m redraft.pipeline.tune")
    exports = {engine: str(cfg.drafter)}
    for folder in cfg.exports:
        other = export_engine(Path(folder))
        if other is None:
            raise TuneError(f"--exports {folder}: not an eval.export folder (no redraft.json naming its engine)")
        if other in exports and Path(exports[other]).resolve() != Path(folder).resolve():
            raise TuneError(f"--exports {folder}: a second {other} export (have {exports[other]})")
        exports[other] = str(folder)
    return engine, exports


def engine_location(engine: str, python: str | None) -> tuple[str, str]:
    """(interpreter, where it came from) of the engine; TuneError naming the make target when there is none."""
    try:
        return engine_interpreter(engine, python)
    except EngineError as e:
        raise TuneError(str(e)) from None


def check_before_launch(engine: str, python: str, export: Path, max_model_len: int) -> None:
    """The doctor's static checks of the export for this engine's version (serve.doctor --before-launch): a sweep
    of a drafter the engine would read at other layers, or serve past its context, measures nothing."""
    version = installed_version(python) if engine == "sglang" else None
    for finding in rules.before_launch_findings(engine, version, rules.drafter_facts(export), max_model_len):
        raise TuneError(f"EXPORT {export}: {finding.title} ({finding.evidence}); fix: {finding.fix}")


# ----------------------------------------------------------------------------- stages


def serving_config(cfg: TuneOptions, engine: str, target: str, max_tokens: int, *, probe: bool) -> Any:
    """serve.bench's settings for the sweep, or for a probe (fewer prompts, one round). A probe warms up as
    much as the sweep does, so that the cost model's step costs are measured as the sweep's rates are."""
    from serve.bench import ServingConfig

    return ServingConfig(concurrency=list(cfg.concurrency), max_tokens=max_tokens,
                         num_prompts=cfg.probe_prompts if probe else cfg.num_prompts,
                         min_rounds=1 if probe else cfg.min_rounds, warmup=cfg.warmup,
                         timeout=cfg.timeout, engine=engine, api="native", tokenizer=target)


def first_pass(cfg: TuneOptions, opts: ServerOptions, drafter: Path, target: str, traffic: Traffic,
               on_probe: Any, on_sweep: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(probe runs, the sweep's first repeat): base and each setting started once, in order of k; on a start,
    the probe (few prompts, one round) first when the setting is probed, then the sweep's run when it is swept
    (none with --predict-only)."""
    probes = set(cfg.probes())
    swept = set() if cfg.predict_only else set(cfg.steps)
    pcfg = serving_config(cfg, opts.engine, target, traffic.max_tokens, probe=True)
    scfg = serving_config(cfg, opts.engine, target, traffic.max_tokens, probe=False)
    few = traffic.prompts[: cfg.probe_prompts]
    extra_env = {"OMP_NUM_THREADS": str(opts.threads)} if opts.threads else None
    probe_runs: list[dict[str, Any]] = []
    sweep_runs: list[dict[str, Any]] = []
    for k in [0, *sorted(probes | swept)]:
        name = BASE if k == 0 else setting_name(k)
        jobs = []
        if k == 0 or k in probes:
            jobs.append(Job(f"probe-{name}", pcfg, [""] * len(few), few))
        if not cfg.predict_only and (k == 0 or k in swept):
            jobs.append(Job(name, scfg, [""] * len(traffic.prompts), traffic.prompts))
        log.info("repeat 1, server %s: starting (%s)", name, ", then ".join(j.name for j in jobs))
        for run in run_on_one_start(ServerSpec(name, None if k == 0 else drafter, k), opts, jobs, 0, extra_env):
            (probe_runs if run["server"].startswith("probe-") else sweep_runs).append(run)
        on_probe(probe_runs)
        if sweep_runs:
            on_sweep(sweep_runs)
    return probe_runs, sweep_runs


def probe_costs(cfg: TuneOptions, probe_runs: list[dict[str, Any]]) -> dict[int, cost_model.StepCost]:
    """The cost model's step costs per concurrency, from the probes."""
    names = {0: f"probe-{BASE}", **{k: f"probe-{setting_name(k)}" for k in cfg.probes()}}
    summary = {n: pool_server(probe_runs, n) for n in names.values()}
    try:
        return cost_model.costs_from_probes(summary, names)
    except cost_model.ModelError as e:
        raise TuneError(f"the probes cannot fix the cost model: {e}") from None


def later_repeats(cfg: TuneOptions, opts: ServerOptions, drafter: Path, target: str, traffic: Traffic,
                  first: list[dict[str, Any]], on_run: Any) -> list[dict[str, Any]]:
    """The sweep's repeats after the first, interleaved, each on freshly started servers; all the sweep's runs."""
    specs = [ServerSpec(BASE)] + [ServerSpec(setting_name(k), drafter, k) for k in cfg.steps]
    scfg = serving_config(cfg, opts.engine, target, traffic.max_tokens, probe=False)
    return first + run_interleaved(specs, opts, scfg, [""] * len(traffic.prompts), traffic.prompts, cfg.repeats - 1,
                                   on_run=lambda runs: on_run(first + runs), first_repeat=1)


def new_report(cfg: TuneOptions, argv: Sequence[str], *, engine: str, exports: dict[str, str], target: str,
               python: str, where: str, traffic: Traffic, off: dict[str, Any]) -> dict[str, Any]:
    """The report as it is written after each server run: settings, traffic and offline tau first."""
    return {
        "schema": "redraft.tune/1", "complete": False, "engine_version": None,
        "engine": engine, "max_running_requests": None,
        "settings": {"drafter": cfg.drafter, "drafter_export": cfg.drafter, "drafter_exports": exports,
                     "target": target, "steps": list(cfg.steps), "probe_steps": list(cfg.probes()),
                     "concurrency": list(cfg.concurrency), "repeats": cfg.repeats, "probe_prompts": cfg.probe_prompts,
                     "warmup": cfg.warmup, "min_rounds": cfg.min_rounds, "dtype": cfg.dtype,
                     "max_model_len": cfg.max_model_len, "kv_cache_bytes": cfg.kv_cache_bytes,
                     "engine_python": python, "engine_source": where,
                     "threads": cfg.threads or os.environ.get("OMP_NUM_THREADS"), "host": platform.node(),
                     "cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg()),
                     "command": " ".join(["python -m serve.tune", *argv]),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "traffic": {"data": str(traffic.data), "source": traffic.source, "samples": traffic.samples,
                    "requests": len(traffic.prompts), "max_tokens": traffic.max_tokens},
        "offline": {**off, "tau": {str(k): v for k, v in off["tau"].items()}},
        "definitions": DEFINITIONS, "probes": None, "costs": None, "predicted": None, "answer": None,
        "recommendation": None, "sweep": None,
    }


def run(cfg: TuneOptions, argv: Sequence[str]) -> dict[str, Any]:
    out = Path(cfg.out)
    target = str(resolve_target(cfg.target))
    engine, exports = read_exports(cfg)
    python, where = engine_location(engine, cfg.engine_python)
    check_before_launch(engine, python, Path(exports[engine]), cfg.max_model_len)
    try:
        traffic = read_traffic(Path(cfg.data), cfg.num_prompts)
        off = read_offline(Path(cfg.offline), traffic, max(cfg.chains()))
    except TrafficError as e:
        raise TuneError(str(e)) from None
    log.info("traffic: %d samples, %d requests, max %d new tokens (%s)", traffic.samples, len(traffic.prompts),
             traffic.max_tokens, traffic.data)
    log.info("offline tau: %s", ", ".join(f"k{k} {v:.3f}" for k, v in off["tau"].items()))
    longest = max(len(p) for p in traffic.prompts) + traffic.max_tokens + max(cfg.chains()) + 1
    if longest > cfg.max_model_len:
        raise TuneError(f"--max-model-len {cfg.max_model_len} is below the longest request ({longest} tokens)")
    drafter = Path(cfg.drafter)
    opts = ServerOptions(target=target, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                         kv_cache_bytes=cfg.kv_cache_bytes, max_num_seqs=max(max(cfg.concurrency), cfg.warmup, 1),
                         engine_python=cfg.engine_python, threads=cfg.threads, start_timeout=cfg.start_timeout,
                         engine=engine)
    report = new_report(cfg, argv, engine=engine, exports=exports, target=target, python=python, where=where,
                        traffic=traffic, off=off)

    def save(stage: str) -> Any:
        def on_run(runs: list[dict[str, Any]]) -> None:
            report[stage] = {"runs": runs}
            versions = {r["result"]["info"].get("version") for r in runs} - {None}
            report["engine_version"] = report["engine_version"] or ", ".join(sorted(versions)) or None
            write_outputs(report, out, plot=False)
        return on_run

    try:
        probe_runs, first = first_pass(cfg, opts, drafter, target, traffic, save("probes"), save("sweep"))
        costs = probe_costs(cfg, probe_runs)
        predicted = cost_model.predict(costs, off["tau"], list(cfg.steps))
        report.update(probes={"runs": probe_runs}, costs=cost_model.as_dict(costs),
                      predicted={str(c): {str(k): v for k, v in p.items()} for c, p in predicted.items()})
        write_outputs(report, out, plot=False)
        if not cfg.predict_only:
            runs = later_repeats(cfg, opts, drafter, target, traffic, first, save("sweep"))
            report["answer"] = answer(runs, list(cfg.steps), off["tau"], predicted)
            report["recommendation"] = recommendation(report["answer"], target, exports, tp=cfg.tp)
            report["max_running_requests"] = served_limits(runs)
    except (SweepError, cost_model.ModelError) as e:
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


PROG = "python -m serve.tune"
DESCRIPTION = __doc__.split("\n")[0]


def parse_options(argv: Sequence[str] | None) -> TuneOptions:
    return options.parse(TuneOptions, argv, prog=PROG, description=DESCRIPTION, section="sweep")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(TuneOptions, prog=PROG, description=DESCRIPTION)


def print_answer(report: dict[str, Any], out: str) -> None:
    """The answer table, the detail table and the launch lines (or the prediction when no sweep ran)."""
    from serve.report import render_markdown_table as table
    from serve.tune_report import answer_rows, detail_rows

    if report["answer"] is not None:
        print(table(answer_rows(report)))
        print()
        print(table(detail_rows(report)))
        rec = report["recommendation"]
        if rec is None:
            print("\nno setting beats base at any concurrency measured: serve base")
        else:
            print(f"\nserve with k = {rec['k']} up to {rec['max_running_requests']} requests:")
            for engine in ENGINES:
                print(rec.get(engine) or f"# {engine}: no {engine} export given (--exports); python -m eval.export "
                                         f"CKPT OUT --format {engine} writes one")
    else:
        print("predicted speed-up per concurrency: " + str(report["predicted"]))
    print(f"\nreport: {Path(out) / 'report.md'}, report.json, report.png")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_options(argv)
    print_answer(run(cfg, argv), cfg.out)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("serve.tune"))


if __name__ == "__main__":
    sys.exit(cli())
