"""Drafter kinds side by side on the same data and budget: Llama-style against MLA attention (issue 22 item 5),
each as EAGLE-3, EAGLE-3.1, P-EAGLE and DFlash (issue 36; ``methods`` in the config; P-EAGLE and DFlash Llama-style
only).

A benchmark, not a test. For each target (default: SmolLM2-135M, a Llama, and kimi-k25-mini, the Kimi-K2.5-
shaped MLA MoE), the real CLIs run as subprocesses:

  * training data: chitchat first exchanges answered by the target (``python -m extract --regenerate``,
    greedy), checked against MT-bench (``--decontaminate mtbench``); held out: MT-bench first turns answered
    greedily by the target (an exact evaluation);
  * per attention kind (``gqa``, ``mla``), method (``eagle3``, ``eagle3.1``, ``p-eagle``) and seed: ``train/main.py
    --drafter-attention KIND --drafter-method METHOD`` for the same
    number of steps on the same data (the same token budget: the bucket sampler depends on the data and
    the seed only);
  * ``python -m eval.acceptance --split all`` on the held-out set: tau for a chain of ``chain_steps``
    (the engine's convention) and acceptance per position;
  * where vLLM CPU serves the pair (an MLA drafter only with an MLA target, a Llama-style one only with a
    non-MLA target), seed 0 in vLLM CPU (``python -m eval.online``): the engine's own tau on the same prompts.

Reported per target and kind: trainable parameters, draft KV-cache bytes per token in bf16, seconds per
training step (median over the logged windows), tau offline (mean, std and range over the seeds) and online,
and, where vLLM CPU serves the pair, seed 0's speed-up over the target alone at each ``speedup_concurrency``
(``serve.tune`` at chain ``chain_steps``: tokens/s with the drafter over without, the same prompts).
Reruns with the same --out reuse finished stages (retrain_gain's stage markers).

    python benchmarks/drafter_kinds.py --out runs/drafter-kinds --threads 2
    python benchmarks/drafter_kinds.py --out runs/drafter-kinds-small --config configs/demo/drafter_kinds.yaml \\
        --train-prompts 64 --steps 20 --seeds 1
    python benchmarks/drafter_kinds.py --out runs/drafter-methods --config configs/demo/drafter_methods.yaml

configs/demo/drafter_methods.yaml is issue 36's table: per target only the attention kind vLLM CPU serves beside
it (``kinds``), every method of that kind, each seed 0 served and timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain_gain import (
    BenchError,
    Stages,
    first_exchanges,
    has_manifest,
    latest_checkpoint,
    train_done,
)

from redraft.core import cli as ending
from redraft.core.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.drafter_kinds")

DEFAULT_CONFIG = ROOT / "configs/demo/drafter_kinds.yaml"
KINDS = ("gqa", "mla")
METHODS = ("eagle3", "eagle3.1", "p-eagle", "dflash")
GQA_ONLY = ("num_key_value_heads", "head_dim")  # train keys an MLA drafter must not get


@dataclass
class TargetSpec:
    """One target of the comparison and how each kind is trained on it."""

    name: str  # built-in name or a local folder
    train_config: str  # the train YAML (the Llama-style drafter's sizes)
    mla: dict[str, int] = field(default_factory=dict)  # MLA sizes (empty: the target's own, or DeepSeek-V3's)
    gqa: dict[str, int] = field(default_factory=dict)  # Llama-style sizes over train_config's (an MLA recipe's)
    online: list[str] = field(default_factory=list)  # the kinds vLLM CPU serves next to this target
    kinds: list[str] = field(default_factory=lambda: list(KINDS))  # attention kinds trained on this target


@dataclass
class KindsConfig:
    """configs/demo/drafter_kinds.yaml: sizes of the comparison."""

    targets: list[TargetSpec] = field(default_factory=list)
    train_prompts: int = 400
    max_prompt_chars: int = 1000
    eval_prompts: int = 80
    max_new_tokens: int = 64
    max_length: int = 512
    gen_batch_size: int = 16
    topk: int = 64
    regen_backend: str = "vllm"  # who answers the training prompts (the held-out set is answered by hf, exactly)
    steps: int = 150
    seeds: int = 3
    chain_steps: int = 3
    methods: list[str] = field(default_factory=lambda: ["eagle3"])  # drafter methods trained per attention kind
    train_jobs: int = 2
    train_overrides: dict[str, Any] = field(default_factory=dict)
    # speed-up over the target alone, seed 0 of every pair vLLM CPU serves: serve.tune at chain_steps
    speedup_concurrency: list[int] = field(default_factory=lambda: [1, 4])  # empty: no speed-up stage
    speedup_prompts: int = 8
    speedup_repeats: int = 1

    @classmethod
    def load(cls, path: Path, overrides: dict[str, Any]) -> KindsConfig:
        import yaml

        raw = yaml.safe_load(path.read_text()) or {}
        unknown = set(raw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise BenchError(f"{path}: unknown keys {sorted(unknown)}")
        targets = []
        for i, t in enumerate(raw.pop("targets", None) or []):
            bad = set(t) - {f.name for f in dataclasses.fields(TargetSpec)}
            if bad:
                raise BenchError(f"{path}: targets[{i}] has unknown keys {sorted(bad)}")
            kinds = t.get("kinds", list(KINDS))
            if not kinds or set(kinds) - set(KINDS):
                raise BenchError(f"{path}: targets[{i}].kinds {t.get('kinds')} must name some of {list(KINDS)}")
            targets.append(TargetSpec(**t))
        if not targets:
            raise BenchError(f"{path}: 'targets' is empty")
        bad_methods = sorted(set(raw.get("methods") or []) - set(METHODS))
        if bad_methods:
            raise BenchError(f"{path}: methods {bad_methods} are not drafter methods {list(METHODS)}")
        cfg = cls(targets=targets, **raw)
        return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def select_targets(cfg: KindsConfig, names: list[str]) -> KindsConfig:
    """``cfg`` with only the named targets, in the config's order: one target's rows rerun on their own."""
    known = [t.name for t in cfg.targets]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a target; the targets are {', '.join(known)}")
    return dataclasses.replace(cfg, targets=[t for t in cfg.targets if t.name in names])


def target_slug(spec: TargetSpec) -> str:
    return Path(spec.name).name


def variants(cfg: KindsConfig, spec: TargetSpec | None = None) -> list[tuple[str, str, str]]:
    """(name, attention, method) of every drafter trained on ``spec`` (on a target training every kind when None):
    "gqa", "mla", "gqa-eagle3.1", ...; p-eagle with the attention kinds that vLLM drafts in parallel only
    (redraft.core.drafter.config.PARALLEL_ATTENTION), dflash Llama-style only (vLLM's DFlashDraftModel is a Qwen3 stack)."""
    from redraft.core.drafter.config import PARALLEL_ATTENTION

    allowed = {"p-eagle": PARALLEL_ATTENTION, "dflash": ("gqa",)}
    kinds = spec.kinds if spec is not None else KINDS
    return [(kind if method == "eagle3" else f"{kind}-{method}", kind, method)
            for method in cfg.methods for kind in KINDS
            if kind in kinds and kind in allowed.get(method, KINDS)]


# ----------------------------------------------------------------------------- commands


def extract_cmd(cfg: KindsConfig, target: str, data: str, out: Path, *, max_samples: int, backend: str,
                training: bool) -> list[str]:
    cmd = [sys.executable, "-m", "extract", "--target", target, "--data", data, "--out", str(out),
           "--teacher", "topk", "--topk", str(cfg.topk), "--hidden-dtype", "bf16", "--max-length",
           str(cfg.max_length), "--max-samples", str(max_samples), "--dtype", "float32", "--regenerate",
           "--max-user-turns", "1", "--temperature", "0", "--max-new-tokens", str(cfg.max_new_tokens),
           "--gen-batch-size", str(cfg.gen_batch_size), "--regen-backend", backend]
    if training:
        cmd += ["--decontaminate", "mtbench"]
    return cmd


def train_cmd(cfg: KindsConfig, spec: TargetSpec, kind: str, seed: int, data: Path, out: Path,
              method: str = "eagle3") -> list[str]:
    cmd = [sys.executable, "train/main.py", "--config", str(ROOT / spec.train_config), "--data", str(data),
           "--out", str(out), "--max-steps", str(cfg.steps), "--seed", str(seed), "--drafter-attention", kind,
           "--drafter-method", method, "--resume", "auto", "--report-to", "none", "--save-every", "0",
           "--eval-every", "0"]
    for k, v in cfg.train_overrides.items():
        cmd += [f"--{k}", str(v)]
    if kind == "mla":
        cmd += [x for k in GQA_ONLY for x in (f"--{k}", "none")]
    for k, v in (spec.mla if kind == "mla" else spec.gqa).items():
        cmd += [f"--{k}", str(v)]
    return cmd


# ----------------------------------------------------------------------------- what a run measured


def drafter_facts(run: Path) -> dict[str, Any]:
    """Trainable parameters and draft KV bytes per token of a run's checkpoint; seconds per step from its log."""
    from safetensors import safe_open

    from redraft.core.drafter.config import DrafterConfig

    ckpt = latest_checkpoint(run)
    if ckpt is None:
        raise BenchError(f"{run}: no checkpoint")
    record = json.loads((ckpt / "redraft.json").read_text())
    cfg = DrafterConfig.from_dict(record["drafter"])
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys() if k not in ("d2t", "t2d"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in rows if r.get("kind") == "train"][1:]  # the first window holds the start-up
    per_step = []
    prev_step = None
    for r in [x for x in rows if x.get("kind") == "train"]:
        if prev_step is not None and r in windows and r.get("tokens_per_s"):
            per_step.append(r["tokens"] / r["tokens_per_s"] / max(r["step"] - prev_step, 1))
        prev_step = r["step"]
    return {"attention": cfg.attention, "params": params, "kv_bytes_per_token": cfg.kv_cache_bytes_per_token(),
            "seconds_per_step": statistics.median(per_step) if per_step else None,
            "architecture": json.loads((ckpt / "config.json").read_text())["architectures"][0]}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values), "values": values}


# ----------------------------------------------------------------------------- the run


def run_target(cfg: KindsConfig, spec: TargetSpec, work: Path, stages: Stages, threads: int) -> dict[str, Any]:
    slug = target_slug(spec)
    base = work / slug
    prompts = first_exchanges(cfg.train_prompts, base / "train-prompts.jsonl", cfg.max_prompt_chars)
    train = base / "data-train"
    stages.run(f"{slug}-extract-train", extract_cmd(cfg, spec.name, str(prompts), train,
                                                    max_samples=cfg.train_prompts, backend=cfg.regen_backend,
                                                    training=True), has_manifest(train))
    held_out = base / "data-mtbench"
    stages.run(f"{slug}-extract-mtbench", extract_cmd(cfg, spec.name, "mtbench", held_out,
                                                      max_samples=cfg.eval_prompts, backend="hf", training=False),
               has_manifest(held_out))
    kinds = {name: (kind, method) for name, kind, method in variants(cfg, spec)}
    runs = {(name, seed): base / "runs" / f"{name}.s{seed}" for name in kinds for seed in range(cfg.seeds)}
    jobs = max(1, cfg.train_jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(stages.run, f"{slug}-train-{name}.s{seed}",
                               train_cmd(cfg, spec, kinds[name][0], seed, train, out, kinds[name][1]),
                               train_done(out, cfg.steps), max(1, threads // jobs))
                   for (name, seed), out in runs.items()]
        for f in futures:
            f.result()
    acc_json = base / "acceptance.json"
    stages.run(f"{slug}-acceptance", [sys.executable, "-m", "eval.acceptance", *map(str, runs.values()),
                                      "--data", str(held_out), "--split", "all", "--steps", str(cfg.chain_steps),
                                      "--no-progress", "--json", str(acc_json)],
               lambda: acc_json.is_file())
    offline = json.loads(acc_json.read_text())
    online: dict[str, Any] = {}
    for kind in [name for name, (attention, _) in kinds.items() if attention in spec.online]:
        out = base / f"online-{kind}.json"
        stages.run(f"{slug}-online-{kind}", [sys.executable, "-m", "eval.online", str(runs[(kind, 0)]), "--data",
                                             str(held_out), "--split", "all", "--steps", str(cfg.chain_steps),
                                             "--speed-samples", "0", "--json", str(out)],
                   lambda out=out: out.is_file())
        online[kind] = json.loads(out.read_text())
        if cfg.speedup_concurrency:
            online[kind]["speedup"] = measure_speedup(cfg, spec, f"{slug}-{kind}", runs[(kind, 0)], held_out,
                                                      base / f"speedup-{kind}", stages)
    return summarise(cfg, spec, runs, offline, online)


def measure_speedup(cfg: KindsConfig, spec: TargetSpec, name: str, run: Path, traffic: Path, out: Path,
                    stages: Stages) -> dict[str, Any]:
    """Speed-up over the target alone at each ``speedup_concurrency``, chain ``chain_steps``: the real CLIs
    (eval.export for vLLM, eval.acceptance --json on the same prompts, serve.tune), vLLM CPU's servers."""
    export, offline, tune = out / "export", out / "offline.json", out / "tune"
    stages.run(f"{name}-export", [sys.executable, "-m", "eval.export", str(run), str(export), "--format", "vllm",
                                  "--target", spec.name, "--force", "-q"],
               lambda: (export / "redraft.json").is_file())
    stages.run(f"{name}-offline", [sys.executable, "-m", "eval.acceptance", str(run), "--data", str(traffic),
                                   "--split", "all", "--max-samples", str(cfg.speedup_prompts), "--steps",
                                   str(cfg.chain_steps), "--engine", "vllm", "--no-progress", "--json", str(offline)],
               lambda: offline.is_file())
    stages.run(f"{name}-tune", [sys.executable, "-m", "serve.tune", str(export), "--target", spec.name, "--data",
                                str(traffic), "--offline", str(offline), "--num-prompts", str(cfg.speedup_prompts),
                                "--steps", str(cfg.chain_steps), "--concurrency",
                                ",".join(map(str, cfg.speedup_concurrency)), "--repeats", str(cfg.speedup_repeats),
                                "--out", str(tune)],
               lambda: (tune / "report.json").is_file())
    return speedups(json.loads((tune / "report.json").read_text()), cfg.chain_steps)


def speedups(report: dict[str, Any], steps: int) -> dict[str, Any]:
    """{concurrency: median speed-up (and the engine's tau) of chain ``steps``} from a serve.tune report."""
    out: dict[str, Any] = {}
    for level in report["answer"]["per_concurrency"]:
        for setting in level["settings"]:
            if setting["k"] == steps:
                out[str(level["concurrency"])] = {"speedup": setting["speedup"]["median"],
                                                  "speedup_range": [setting["speedup"]["min"],
                                                                    setting["speedup"]["max"]],
                                                  "tau_engine": setting["tau_engine"]}
    if not out:
        raise BenchError(f"serve.tune's report has no chain of {steps}")
    return out


def _offline_entry(offline: dict[str, Any], run: Path) -> dict[str, Any]:
    for res in offline["checkpoints"].values():
        if Path(str(res["checkpoint"])).resolve() == run.resolve():
            return res
    raise BenchError(f"eval.acceptance's JSON has no entry for {run}")


def summarise(cfg: KindsConfig, spec: TargetSpec, runs: dict[tuple[str, int], Path], offline: dict[str, Any],
              online: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for kind, _, method in variants(cfg, spec):
        taus, rates, facts = [], [], []
        for seed in range(cfg.seeds):
            res = _offline_entry(offline, runs[(kind, seed)])
            taus.append(float(res["tau"]))
            rates.append(res["accept_rate"])
            facts.append(drafter_facts(runs[(kind, seed)]))
        on = online.get(kind)
        rows[kind] = {
            **{k: facts[0][k] for k in ("attention", "architecture", "params", "kv_bytes_per_token")},
            "method": method,
            "seconds_per_step": spread([f["seconds_per_step"] for f in facts if f["seconds_per_step"]]),
            "tau_offline": spread(taus),
            "accept_rate_offline_mean": [statistics.fmean(r[k] for r in rates) for k in range(cfg.chain_steps)],
            "tau_online_seed0": on["all"]["tau"] if on else None,
            "online_same_as_data": f"{on['same_as_data']}/{on['requests']}" if on else None,
            "tau_online_seed0_same_tokens": on["same_tokens"]["tau"] if on else None,
            "tau_offline_seed0": taus[0],
            "speedup_seed0": on.get("speedup") if on else None,
        }
    return {"target": spec.name, "kinds": rows}


def markdown(report: dict[str, Any]) -> str:
    conc = report["config"].get("speedup_concurrency") or []
    head = ("| target | drafter | parameters | draft KV bytes/token (bf16) | s/step | tau offline, mean ± std "
            f"(min–max, {report['config']['seeds']} seeds) | P(accept) 1..K | tau online, vLLM CPU (seed 0) |"
            + "".join(f" speed-up at concurrency {c} (seed 0) |" for c in conc))
    lines = [head, "|---|---|---:|---:|---:|---:|---|---:|" + "---:|" * len(conc)]
    for t in report["targets"]:
        for kind, r in t["kinds"].items():
            tau = r["tau_offline"]
            s = r["seconds_per_step"]
            online = (f"{r['tau_online_seed0']:.3f} (offline seed 0: {r['tau_offline_seed0']:.3f}; "
                      f"{r['online_same_as_data']} replies as stored)" if r["tau_online_seed0"] is not None
                      else "not served by vLLM CPU with this target")
            lines.append(
                f"| {t['target']} | {kind} ({r['architecture']}, {r.get('method', 'eagle3')}) | {r['params'] / 1e6:.2f}M | "
                f"{r['kv_bytes_per_token']:,} | {s['mean']:.2f} | {tau['mean']:.3f} ± {tau['std']:.3f} "
                f"({tau['min']:.3f}–{tau['max']:.3f}) | "
                f"{' / '.join(f'{x:.3f}' for x in r['accept_rate_offline_mean'])} | {online} |"
                + "".join(f" {_speedup_cell(r.get('speedup_seed0'), c)} |" for c in conc))
    return "\n".join(lines) + "\n"


def _speedup_cell(speedup: dict[str, Any] | None, concurrency: int) -> str:
    got = (speedup or {}).get(str(concurrency))
    if got is None:
        return "—"
    lo, hi = got["speedup_range"]
    return f"{got['speedup']:.2f}x" + (f" ({lo:.2f}–{hi:.2f})" if hi > lo else "")


def run(cfg: KindsConfig, work: Path, threads: int) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    stages = Stages(work, threads)
    t0 = time.time()
    targets = [run_target(cfg, spec, work, stages, threads) for spec in cfg.targets]
    report = {"config": dataclasses.asdict(cfg), "targets": targets, "stage_seconds": stages.seconds,
              "reused_stages": stages.reused, "wall_seconds": time.time() - t0,
              "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": threads},
              "command": " ".join(sys.argv)}
    atomic_write_text(work / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(work / "report.md", markdown(report))
    print(markdown(report), flush=True)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python benchmarks/drafter_kinds.py",
                                description="Llama-style against MLA drafter on the same data and budget: parameters, "
                                            "draft KV bytes, step time, tau offline (seeds) and in vLLM CPU.")
    p.add_argument("--out", required=True, type=Path, help="work folder (reruns reuse its finished stages)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=f"sizes (default {DEFAULT_CONFIG})")
    p.add_argument("--threads", type=int, default=2, help="CPU threads in all (split between parallel trainings)")
    p.add_argument("--train-prompts", type=int, default=None, help="override train_prompts")
    p.add_argument("--eval-prompts", type=int, default=None, help="override eval_prompts")
    p.add_argument("--steps", type=int, default=None, help="override steps (every drafter)")
    p.add_argument("--seeds", type=int, default=None, help="override seeds")
    p.add_argument("--target", action="append", default=None, metavar="NAME",
                   help="run only this config target (repeatable; default every target): one target's rows")
    a = p.parse_args(argv)
    ending.configure_logging(logging.INFO, "%(asctime)s %(name)s: %(message)s")
    cfg = KindsConfig.load(a.config, {"train_prompts": a.train_prompts, "eval_prompts": a.eval_prompts,
                                      "steps": a.steps, "seeds": a.seeds})
    if a.target:
        try:
            cfg = select_targets(cfg, a.target)
        except ValueError as e:
            p.error(f"--target {e} (in {a.config})")
    return run(cfg, a.out, a.threads)


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.drafter_kinds")))
