"""Retraining gain: does a drafter refitted to the target's own replies accept more? (issues 6 and 14)

A benchmark, not a test. One command runs the real CLIs as subprocesses on the embedded target:

  * data: chitchat first exchanges (human replies as they are) and, for B and C, the same prompts plus
    ``self_prompts`` prompts the target writes itself (``--data self``, one hint per MT-bench category),
    all answered by the target (``python -m extract --regenerate``, greedy, ``regen_backend`` vllm or hf);
    every training set is checked against MT-bench by extract (``--decontaminate``). Held out: MT-bench
    first turns answered greedily by the target, so the evaluation is exact;
  * drafter A (mismatched; the stand-in for "fitted to another target's outputs": the same prompts'
    human replies, written by other "models" than the target): ``steps_a`` steps;
  * drafter B (retrained): ``--init-from`` A (draft vocab rebuilt), the target's replies, A's token count
    again (its total exposure is A's plus its own), once per seed (``seeds``);
  * drafter C (scratch): the target's replies with the same token count;
  * B-xM (``budget_multiples``): B retrained again with M times A's tokens (its own lr schedule), for
    tau against the retraining budget;
  * storage variants: hidden dtype x teacher (fp8/topk against bf16/last_hidden by default), each per
    seed, on ``storage_samples`` target-written conversations spread over the set (0: all of it);
  * ``python -m eval.acceptance --split all`` on the MT-bench set: tau for chains of 1..K in the engine's
    convention, acceptance per position, one tree setting; the storage variants also on an fp8 copy;
  * B (seed 0) in vLLM CPU (``python -m eval.online``) on the same prompts: the engine's own tau;
  * A/B/C also on unseen chitchat prompts answered by the target (the training domain): no goal,
    it tells the gain from fitting the target apart from the chitchat -> MT-bench topic shift.

Token budgets are planned from the datasets (the trainer's own bucket sampler, in each run's seed, so
the step count of every run is the one whose tokens come closest to A's) and checked against the
tokens each run logged in its metrics.jsonl; both are reported. Reruns with the same --out reuse
finished stages (a stage is done when its marker in OUT/stages/ names the same command and its output
is complete; the CLIs resume their own partial outputs). The report (report.json, report.md,
report.png) states the wall time of every stage.

    python benchmarks/retrain_gain.py --out runs/retrain-gain                   # 10,000 conversations
    python benchmarks/retrain_gain.py --out runs/retrain-gain-q --scale 0.25
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from retrain_gain_report import diagnosis, goals, markdown, print_summary, write_plot

from redraft.core import cli as ending
from redraft.core.atomic import atomic_write_text
from redraft.core.drafter.folder import WEIGHTS_NAME, CheckpointError, read_record, resolve_drafter_folder
from redraft.core.errors import Failure

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.retrain_gain")

DEFAULT_CONFIG = ROOT / "configs/demo/retrain_gain.yaml"
ACCELERATE_CPU_CONFIG = ROOT / "configs/accelerate/cpu-2proc-zero2.yaml"
COMMON_KEYS = ("input_ids", "loss_mask", "sample_offsets")
HIDDEN_KEYS = ("aux_hidden", "aux_scale")
TEACHER_KEYS = {"topk": ("topk_ids", "topk_logprobs"), "last_hidden": ("last_hidden", "last_scale")}


class BenchError(Failure):
    """A stage failed or the work folder belongs to other settings; the message says which and where."""


# ----------------------------------------------------------------------------- config


@dataclass
class BenchConfig:
    """Sizes of the benchmark (configs/demo/retrain_gain.yaml); ``scaled`` applies --scale."""

    target: str = "smollm2-135m-instruct"
    train_prompts: int = 256
    max_prompt_chars: int = 1000
    eval_prompts: int = 80
    max_new_tokens: int = 64
    eval_max_new_tokens: int = 96
    indomain_eval_prompts: int = 128  # held-out chitchat prompts (after the training ones), answered by the target
    gen_batch_size: int = 8
    max_length: int = 512
    topk: int = 64
    samples_per_shard: int = 64
    train_config: str = "configs/demo/train.yaml"
    steps_a: int = 80
    lr: float | None = None
    retrain_lr: float | None = None
    train_overrides: dict[str, Any] = field(default_factory=dict)
    variants: list[str] = field(default_factory=lambda: ["bf16/topk", "fp8/topk", "bf16/last_hidden",
                                                         "fp8/last_hidden"])
    eval_hidden_dtypes: list[str] = field(default_factory=lambda: ["bf16", "fp8"])
    chain_steps: int = 7
    tree: dict[str, int] | None = field(default_factory=lambda: {"steps": 3, "topk": 2, "num_draft_tokens": 6})
    tree_positions: int = 64
    procs: int = 1
    train_jobs: int = 1  # drafters trained at once (1-process training only); threads are split between them
    self_prompts: int = 0  # prompts the target writes itself (--data self), added to B's and C's training set
    self_options: dict[str, Any] = field(default_factory=dict)  # extract --self-* options, e.g. {categories: mtbench}
    regen_backend: str = "hf"  # who writes the target's replies: hf, vllm (extract --regen-backend)
    storage_samples: int = 0  # storage variants train on N target-written conversations spread over the set (0: all)
    regen_kv_cache_gb: float | None = None  # vLLM's KV cache (bounds the prompts it runs at once)
    decontaminate: list[str] = field(default_factory=list)  # eval sets no training record may be close to
    seeds: int = 1  # training seeds of B and of the storage variants (mean and spread reported)
    online: dict[str, int] | None = None  # B's tau in vLLM CPU on the MT-bench set: {steps: 3, max_samples: 0}
    budget_multiples: list[int] = field(default_factory=list)  # B-xM: B (seed 0) again with M x A's tokens

    # keys that only add drafters named by their value: changing them keeps a run's other stages valid
    ADDITIVE: ClassVar[tuple[str, ...]] = ("budget_multiples",)

    @classmethod
    def load(cls, path: Path) -> BenchConfig:
        import yaml

        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise BenchError(f"{path}: expected a mapping of options, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BenchError(f"{path}: unknown key(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**raw)
        cfg.check(str(path))
        return cfg

    def check(self, where: str) -> None:
        for v in self.variants:
            dtype, _, teacher = v.partition("/")
            if dtype not in ("bf16", "fp8") or teacher not in TEACHER_KEYS:
                raise BenchError(f"{where}: variants: {v!r} is not HIDDEN_DTYPE/TEACHER (bf16|fp8 / topk|last_hidden)")
        bad = [d for d in self.eval_hidden_dtypes if d not in ("bf16", "fp8")]
        if bad or "bf16" not in self.eval_hidden_dtypes:
            raise BenchError(f"{where}: eval_hidden_dtypes must include bf16 and hold only bf16/fp8, got "
                             f"{self.eval_hidden_dtypes}")
        if self.procs not in (1, 2):
            raise BenchError(f"{where}: procs must be 1 or 2, got {self.procs}")
        if self.train_jobs < 1 or (self.procs > 1 and self.train_jobs > 1):
            raise BenchError(f"{where}: train_jobs must be >= 1, and 1 when procs is 2 (got train_jobs "
                             f"{self.train_jobs}, procs {self.procs})")
        if self.regen_backend not in ("hf", "vllm"):
            raise BenchError(f"{where}: regen_backend must be hf or vllm, got {self.regen_backend!r}")
        if self.seeds < 1 or self.self_prompts < 0:
            raise BenchError(f"{where}: seeds must be >= 1 and self_prompts >= 0 (got {self.seeds}, "
                             f"{self.self_prompts})")
        unknown = sorted(set(self.online or {}) - {"steps", "max_samples"})
        if unknown:
            raise BenchError(f"{where}: online: unknown key(s) {unknown}; known: ['max_samples', 'steps']")
        if any(not isinstance(m, int) or m < 2 for m in self.budget_multiples):
            raise BenchError(f"{where}: budget_multiples must be integers >= 2, got {self.budget_multiples}")

    def scaled(self, scale: float) -> BenchConfig:
        if scale <= 0:
            raise BenchError(f"--scale must be > 0, got {scale}")
        return dataclasses.replace(
            self, train_prompts=max(2, round(self.train_prompts * scale)),
            self_prompts=round(self.self_prompts * scale), storage_samples=round(self.storage_samples * scale),
            steps_a=max(1, round(self.steps_a * scale)))


# ----------------------------------------------------------------------------- stages


def bench_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", DS_ACCELERATOR="cpu",
               WANDB_MODE=env.get("WANDB_MODE", "offline"), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), REDRAFT_NO_PROGRESS="1")
    return env


class Stages:
    """Runs each stage's command once; a marker (command + wall time) in OUT/stages/ makes reruns skip it."""

    def __init__(self, work: Path, threads: int) -> None:
        self.work = work
        self.threads = threads
        self.seconds: dict[str, float] = {}
        self.reused: list[str] = []
        (work / "stages").mkdir(parents=True, exist_ok=True)
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def _interrupted_seconds(self, name: str, cmd: list[str], logfile: Path) -> float:
        """Time an interrupted earlier run of the same command already spent (the CLIs resume its work):
        from its start to its log's last write, plus what runs before it had counted."""
        started = self.work / "stages" / f"{name}.started"
        if not started.is_file() or not logfile.is_file():
            return 0.0
        rec = json.loads(started.read_text())
        if rec.get("cmd") != cmd:
            return 0.0
        spent = max(0.0, logfile.stat().st_mtime - float(rec["started"])) + float(rec.get("earlier", 0.0))
        log.info("%-22s resuming an interrupted run (%.0f s spent before, counted in its time)", name, spent)
        return spent

    def run(self, name: str, cmd: list[str], done: Any, threads: int | None = None) -> float:
        """Run ``cmd`` (cwd = repo root) unless its marker matches and ``done()`` says the output is complete."""
        marker = self.work / "stages" / f"{name}.json"
        if marker.is_file() and done():
            rec = json.loads(marker.read_text())
            if rec.get("cmd") == cmd:
                self.seconds[name] = float(rec["seconds"])
                self.reused.append(name)
                log.info("%-22s reused (took %.0f s when it ran)", name, rec["seconds"])
                return self.seconds[name]
        logfile = self.work / "logs" / f"{name}.log"
        earlier = self._interrupted_seconds(name, cmd, logfile)
        log.info("%-22s running: %s", name, " ".join(cmd))
        started = self.work / "stages" / f"{name}.started"
        atomic_write_text(started, json.dumps({"cmd": cmd, "started": time.time(), "earlier": earlier}) + "\n")
        t0 = time.perf_counter()
        with open(logfile, "w") as f:
            res = subprocess.run(cmd, cwd=ROOT, env=bench_env(threads or self.threads), stdout=f,
                                 stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - t0 + earlier
        if res.returncode != 0:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-30:])
            raise BenchError(f"stage {name} failed (exit {res.returncode}) after {seconds:.0f} s; log {logfile}:\n"
                             f"{tail}")
        if not done():
            raise BenchError(f"stage {name} exited 0 but its output is incomplete; log {logfile}")
        atomic_write_text(marker, json.dumps({"cmd": cmd, "seconds": seconds, "earlier_attempts_seconds": earlier,
                                              "finished": time.time()}) + "\n")
        started.unlink(missing_ok=True)
        self.seconds[name] = seconds
        log.info("%-22s done in %.0f s", name, seconds)
        return seconds


# ----------------------------------------------------------------------------- data


def first_exchanges(n: int, out: Path, max_prompt_chars: int, skip: int = 0) -> Path:
    """n chitchat conversations cut to their first (human, reply) exchange, as a JSONL input.

    Opening turns longer than ``max_prompt_chars`` are passed over: a prompt that does not fit in
    max_length cannot be answered by the target, and A/B/C must see the same prompts. ``skip``
    passes over the first usable conversations (the training prompts, for the held-out set).
    Closeness to MT-bench is checked by extract itself (``--decontaminate``, cfg.decontaminate).
    """
    from redraft.catalog.builtin import resolve_data

    src = resolve_data("chitchat")
    rows: list[dict[str, Any]] = []
    with src.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(rows) >= skip + n:
                break
            try:
                rec = json.loads(line)
                turns = rec["conversations"][:2]
            except (ValueError, KeyError, TypeError) as e:
                raise BenchError(f"{src}:{lineno}: not a chitchat conversation ({e!r})") from e
            if (len(turns) == 2 and all(str(t.get("value", "")).strip() for t in turns)
                    and len(str(turns[0]["value"])) <= max_prompt_chars):
                rows.append({"id": rec["id"], "source": "chitchat", "conversations": turns})
    if len(rows) < skip + n:
        raise BenchError(f"{src}: only {len(rows)} usable conversations, {skip + n} asked for")
    return _write_if_changed(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[skip:]))


def _write_if_changed(out: Path, text: str) -> Path:
    """Write a stage's input file only when its text changed (a rerun leaves a finished input untouched)."""
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        atomic_write_text(out, text)
    return out


def every_kth(src: Path, n: int, out: Path) -> Path:
    """``n`` records spread evenly over a JSONL file (both sources, chitchat and self, in proportion)."""
    lines = src.read_text(encoding="utf-8").splitlines()
    if n > len(lines):
        raise BenchError(f"storage_samples {n} > the {len(lines)} records of {src}")
    picked = [lines[i * len(lines) // n] for i in range(n)]
    return _write_if_changed(out, "".join(line + "\n" for line in picked))


def extract_cmd(cfg: BenchConfig, data: str, out: Path, *, teachers: list[str], hidden_dtype: str,
                regenerate: bool, max_samples: int, max_new_tokens: int, self_prompts: int = 0,
                training: bool = False) -> list[str]:
    """``python -m extract`` for one dataset; ``training`` sets are checked against cfg.decontaminate, and
    ``self_prompts`` > 0 adds that many prompts the target writes itself (``--data self``)."""
    if self_prompts > 0:
        data = f"{data},self"
    cmd = [sys.executable, "-m", "extract", "--target", cfg.target, "--data", data, "--out", str(out),
           "--teacher", ",".join(teachers), "--topk", str(cfg.topk), "--hidden-dtype", hidden_dtype,
           "--max-length", str(cfg.max_length), "--samples-per-shard", str(cfg.samples_per_shard),
           "--max-samples", str(max_samples), "--dtype", "float32"]
    if regenerate:
        cmd += ["--regenerate", "--max-user-turns", "1", "--temperature", "0", "--max-new-tokens",
                str(max_new_tokens), "--gen-batch-size", str(cfg.gen_batch_size), "--regen-backend",
                cfg.regen_backend]
        if cfg.regen_backend == "vllm" and cfg.regen_kv_cache_gb:
            cmd += ["--regen-kv-cache-gb", str(cfg.regen_kv_cache_gb)]
    if self_prompts > 0:
        cmd += ["--self-prompts", str(self_prompts)]
        for k, v in cfg.self_options.items():
            cmd += [f"--self-{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    if training and cfg.decontaminate:
        cmd += ["--decontaminate", ",".join(cfg.decontaminate)]
    return cmd


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def has_manifest(path: Path) -> Any:
    return lambda: (path / "manifest.json").is_file()


def tensor_bytes(data: Path) -> dict[str, int]:
    """Bytes per tensor name summed over the shards, read from the safetensors headers (no tensor is loaded)."""
    totals: dict[str, int] = {}
    for shard in manifest(data)["shards"]:
        path = data / shard["path"]
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                begin, end = meta["data_offsets"]
                totals[key] = totals.get(key, 0) + end - begin
    return totals


def storage_row(data: Path, teacher: str) -> dict[str, Any]:
    """Bytes per token of the tensors one (hidden dtype, teacher) combination needs, and of the whole files."""
    m = manifest(data)
    per_key = tensor_bytes(data)
    keys = COMMON_KEYS + HIDDEN_KEYS + TEACHER_KEYS[teacher]
    used = sum(per_key.get(k, 0) for k in keys)
    files = sum((data / s["path"]).stat().st_size for s in m["shards"])
    tokens = max(int(m["num_tokens"]), 1)
    return {"hidden_dtype": m["hidden_dtype"], "teacher": teacher, "num_tokens": int(m["num_tokens"]),
            "bytes_per_token": used / tokens, "file_bytes_per_token": files / tokens,
            "bytes_by_key": {k: per_key[k] for k in keys if k in per_key}}


# ----------------------------------------------------------------------------- token budgets


def _train_option(opts: dict[str, Any], key: str, default: Any) -> Any:
    return opts.get(key, opts.get(key.replace("_", "-"), default))


def train_options(cfg: BenchConfig) -> dict[str, Any]:
    """train/main.py options as the trainer will see them: train_config YAML, then the benchmark's overrides."""
    import yaml

    opts = yaml.safe_load((ROOT / cfg.train_config).read_text()) or {}
    opts.update(cfg.train_overrides)
    if cfg.lr is not None:
        opts["lr"] = cfg.lr
    return opts


def planned_tokens(data: Path, steps: int, opts: dict[str, Any], world: int) -> list[int]:
    """Cumulative training tokens after each of ``steps`` optimizer steps, from the trainer's own sampler."""
    from redraft.core.dataset.reader import DatasetReader
    from train.data import DistributedBucketSampler, split_by_id

    reader = DatasetReader(data)
    max_length = int(_train_option(opts, "max_length", 0))
    lengths = [min(n, max_length) if max_length > 0 else n for n in reader.lengths]
    seed = int(_train_option(opts, "seed", 0))
    train_idx, _ = split_by_id(reader.sample_ids, float(_train_option(opts, "val_fraction", 0.02)),
                               int(_train_option(opts, "val_max_samples", 512)), seed)
    accum = int(_train_option(opts, "grad_accum", 1))
    samplers = [DistributedBucketSampler(
        train_idx, lengths, tokens_per_batch=int(_train_option(opts, "tokens_per_batch", 8192)),
        max_samples=int(_train_option(opts, "micro_batch_size", 0)),
        mega_batch_samples=int(_train_option(opts, "mega_batch_samples", 512)), seed=seed, rank=r,
        world_size=world, grad_accum=accum) for r in range(world)]
    if samplers[0].steps_in_epoch(0) == 0:
        raise BenchError(f"{data}: {len(train_idx)} training samples give no optimizer step")
    out, total, epoch = [], 0, 0
    while len(out) < steps:
        per_rank = [s.rank_batches(epoch) for s in samplers]
        for i in range(samplers[0].steps_in_epoch(epoch)):
            for batches in per_rank:
                for b in batches[i * accum:(i + 1) * accum]:
                    total += sum(lengths[j] for j in b)
            out.append(total)
            if len(out) == steps:
                break
        epoch += 1
    return out


def steps_for_tokens(data: Path, budget: int, opts: dict[str, Any], world: int, start: int) -> int:
    """The step count whose cumulative tokens on ``data`` come closest to ``budget``."""
    steps = max(1, start)
    while True:
        cum = planned_tokens(data, steps, opts, world)
        if cum[-1] >= budget:
            break
        steps = max(steps + 1, math.ceil(steps * budget / max(cum[-1], 1)))
    best = min(range(len(cum)), key=lambda i: (abs(cum[i] - budget), i))
    return best + 1


def logged_tokens(run: Path) -> dict[str, Any]:
    """Tokens and loss tokens the trainer logged (metrics.jsonl train rows, all ranks) and its last metrics."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    val = [r for r in rows if r.get("kind") == "val"]
    last = train[-1] if train else {}
    return {"tokens": sum(int(r.get("tokens", 0)) for r in train),
            "loss_tokens": sum(int(r.get("loss_tokens", 0)) for r in train),
            "last_train": {k: last.get(k) for k in ("step", "loss", "acc", "tau", "lr", "tokens_per_s")},
            "last_val": {k: val[-1].get(k) for k in ("step", "loss", "acc", "tau")} if val else None}


def latest_checkpoint(run: Path) -> Path | None:
    """The run's newest checkpoint, or None before its first save."""
    try:
        return resolve_drafter_folder(run) if run.is_dir() else None
    except CheckpointError:
        return None


def train_done(run: Path, steps: int) -> Any:
    def done() -> bool:
        ckpt = latest_checkpoint(run)
        if ckpt is None or not (ckpt / "trainer_state.json").is_file():
            return False
        return int(json.loads((ckpt / "trainer_state.json").read_text()).get("step", -1)) == steps
    return done


def _newer_than_checkpoints(path: Path, runs: list[Path]) -> bool:
    """An evaluation is current when its JSON exists and no drafter it scored was saved after it."""
    if not path.is_file():
        return False
    ckpts = [latest_checkpoint(r) for r in runs]
    return all(c is not None and (c / WEIGHTS_NAME).stat().st_mtime <= path.stat().st_mtime for c in ckpts)


# ----------------------------------------------------------------------------- evidence


def vocab_coverage(ckpt: Path, eval_data: Path) -> float:
    """Fraction of the eval set's loss tokens whose token is in the drafter's draft vocab (t2d)."""
    from safetensors import safe_open

    from redraft.core.dataset.reader import DatasetReader

    with safe_open(str(ckpt / WEIGHTS_NAME), "pt") as f:
        t2d = f.get_tensor("t2d").bool()
    counts = DatasetReader(eval_data).token_counts().double()
    n = min(len(counts), len(t2d))
    return float(counts[:n][t2d[:n]].sum() / counts.sum().clamp(min=1))


# ----------------------------------------------------------------------------- the run


@dataclass
class Drafter:
    name: str
    data: Path
    teacher: str
    hidden_dtype: str
    steps: int = 0
    init_from: str = ""
    lr: float | None = None
    description: str = ""
    seed: int = 0  # train/main.py --seed: the data order and held-out split (and a scratch run's init)

    @property
    def family(self) -> str:
        """The name without its seed suffix: B.s1 -> B."""
        return self.name.split(".s")[0]


def train_cmd(cfg: BenchConfig, d: Drafter, out: Path) -> list[str]:
    if cfg.procs == 1:
        cmd = [sys.executable, "train/main.py"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU_CONFIG),
               "--num_processes", str(cfg.procs), "train/main.py"]
    cmd += ["--config", str(ROOT / cfg.train_config), "--data", str(d.data), "--out", str(out),
            "--max-steps", str(d.steps), "--teacher", d.teacher, "--resume", "auto", "--report-to", "none"]
    for k, v in cfg.train_overrides.items():
        cmd += [f"--{k}", str(v)]
    if d.lr is not None:
        cmd += ["--lr", str(d.lr)]
    if d.init_from:
        cmd += ["--init-from", d.init_from]
    if d.seed:
        cmd += ["--seed", str(d.seed)]
    return cmd


def seeded(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}.s{seed}"


def with_seed(opts: dict[str, Any], seed: int) -> dict[str, Any]:
    return {**opts, "seed": seed} if seed else opts


def train_all(cfg: BenchConfig, drafters: list[Drafter], runs: Path, stages: Stages, *, threads: int) -> None:
    """Train every drafter, ``cfg.train_jobs`` at a time; B (warm start) starts once A is done.

    Why concurrent: on a few cores two 1-thread trainings get more done than one 2-thread
    training (the small matmuls do not scale to two threads), and the runs are independent.
    """
    from concurrent.futures import Future, ThreadPoolExecutor

    def train(d: Drafter, after: Future | None) -> None:
        if after is not None:
            after.result()  # re-raises A's failure
        if d.init_from == "(A)":
            ckpt_a = latest_checkpoint(runs / "A")
            if ckpt_a is None:
                raise BenchError(f"{runs / 'A'}: no checkpoint to warm-start B from")
            d.init_from = str(ckpt_a)
        out = runs / d.name
        stages.run(f"train-{d.name}", train_cmd(cfg, d, out), train_done(out, d.steps), threads=threads)

    # A starts first; B is queued after the first train_jobs independent runs, so no worker sits
    # parked on A while there is other work (train_jobs 1 keeps the order A, B, C, ...)
    independent = [d for d in drafters if d.init_from != "(A)"]
    warm = [d for d in drafters if d.init_from == "(A)"]
    order = independent[:cfg.train_jobs] + warm + independent[cfg.train_jobs:]
    futures: dict[str, Future] = {}
    with ThreadPoolExecutor(max_workers=cfg.train_jobs) as pool:
        for d in order:
            after = futures.get("A") if d.init_from == "(A)" else None
            futures[d.name] = pool.submit(train, d, after)
        for f in futures.values():
            f.result()


def acceptance_cmd(cfg: BenchConfig, runs: list[Path], data: Path, prefix: Path, tree: bool) -> list[str]:
    cmd = [sys.executable, "-m", "eval.acceptance", *map(str, runs), "--data", str(data), "--split", "all",
           "--no-progress", "--json", f"{prefix}.json", "--markdown", f"{prefix}.md", "--plot", f"{prefix}.png"]
    if tree and cfg.tree:
        cmd += ["--steps", str(cfg.tree["steps"]), "--topk", str(cfg.tree["topk"]), "--num-draft-tokens",
                str(cfg.tree["num_draft_tokens"]), "--tree-positions", str(cfg.tree_positions)]
    else:
        cmd += ["--steps", str(cfg.chain_steps)]
    return cmd


def online_cmd(cfg: BenchConfig, run: Path, data: Path, prefix: Path) -> list[str]:
    opts = cfg.online or {}
    return [sys.executable, "-m", "eval.online", str(run), "--data", str(data), "--steps",
            str(opts.get("steps", 3)), "--max-samples", str(opts.get("max_samples", 0)),
            "--max-model-len", str(cfg.max_length), "--speed-samples", "0", "--json",
            f"{prefix}.json", "--markdown", f"{prefix}.md"]


def run_benchmark(cfg: BenchConfig, work: Path, *, scale: float, threads: int) -> dict[str, Any]:
    t_start = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    snapshot = {"scale": scale, **dataclasses.asdict(cfg)}
    snap_path = work / "bench-config.json"
    if snap_path.is_file():
        old = json.loads(snap_path.read_text())
        diff = sorted(k for k in set(old) | set(snapshot)
                      if old.get(k) != snapshot.get(k) and k not in BenchConfig.ADDITIVE)
        if diff:
            raise BenchError(f"{work} holds a run with other settings ({', '.join(diff)} differ, see {snap_path}); "
                             "use another --out")
    atomic_write_text(snap_path, json.dumps(snapshot, indent=2) + "\n")
    stages = Stages(work, threads)
    train_threads = max(1, threads // cfg.train_jobs) if cfg.procs == 1 else 1
    opts = train_options(cfg)
    world = cfg.procs
    variants = [tuple(v.split("/")) for v in cfg.variants]
    storage_teachers = sorted({t for _, t in variants})
    # the whole set is captured once more per storage dtype, or the storage variants get their own subset
    train_dtypes = sorted({"bf16", *(d for d, _ in variants)}) if cfg.storage_samples == 0 else ["bf16"]
    train_teachers = sorted({"topk", *storage_teachers}) if cfg.storage_samples == 0 else ["topk"]

    # ---------------------------------------------------------------- data
    prompts = first_exchanges(cfg.train_prompts, work / "inputs" / f"chitchat-first-{cfg.train_prompts}.jsonl",
                              cfg.max_prompt_chars)
    data = work / "data"
    human = data / "train-human"
    stages.run("extract-train-human", extract_cmd(cfg, str(prompts), human, teachers=["topk"], hidden_dtype="bf16",
                                                  regenerate=False, max_samples=0, max_new_tokens=0, training=True),
               has_manifest(human))
    regen = {d: data / f"train-regen-{d}" for d in train_dtypes}
    stages.run("extract-train-regen-bf16", extract_cmd(
        cfg, str(prompts), regen["bf16"], teachers=train_teachers, hidden_dtype="bf16", regenerate=True,
        max_samples=0, max_new_tokens=cfg.max_new_tokens, self_prompts=cfg.self_prompts, training=True),
        has_manifest(regen["bf16"]))
    for d in train_dtypes:
        if d != "bf16":  # the same conversations: the bf16 run's regenerated.jsonl, captured again
            stages.run(f"extract-train-regen-{d}", extract_cmd(
                cfg, str(regen["bf16"] / "regenerated.jsonl"), regen[d], teachers=train_teachers, hidden_dtype=d,
                regenerate=False, max_samples=0, max_new_tokens=0, training=True), has_manifest(regen[d]))
    if cfg.storage_samples == 0:
        storage_data = regen
    else:  # storage_samples conversations spread over the same set, captured once per hidden dtype
        subset = every_kth(regen["bf16"] / "regenerated.jsonl", cfg.storage_samples,
                           work / "inputs" / f"storage-subset-{cfg.storage_samples}.jsonl")
        storage_data = {d: data / f"train-storage-{d}" for d in sorted({d for d, _ in variants})}
        for d, path in storage_data.items():
            stages.run(f"extract-train-storage-{d}", extract_cmd(
                cfg, str(subset), path, teachers=storage_teachers, hidden_dtype=d, regenerate=False, max_samples=0,
                max_new_tokens=0, training=True), has_manifest(path))
    indomain = None
    if cfg.indomain_eval_prompts > 0:  # unseen chitchat prompts: the training domain without the topic shift
        held_out = first_exchanges(cfg.indomain_eval_prompts,
                                   work / "inputs" / f"chitchat-heldout-{cfg.indomain_eval_prompts}.jsonl",
                                   cfg.max_prompt_chars, skip=cfg.train_prompts)
        indomain = data / "eval-chitchat-bf16"
        stages.run("extract-eval-chitchat-bf16", extract_cmd(
            cfg, str(held_out), indomain, teachers=["topk"], hidden_dtype="bf16", regenerate=True, max_samples=0,
            max_new_tokens=cfg.max_new_tokens), has_manifest(indomain))
    evals = {d: data / f"eval-mtbench-{d}" for d in cfg.eval_hidden_dtypes}
    stages.run("extract-eval-bf16", extract_cmd(
        cfg, "mtbench", evals["bf16"], teachers=["topk"], hidden_dtype="bf16", regenerate=True,
        max_samples=cfg.eval_prompts, max_new_tokens=cfg.eval_max_new_tokens), has_manifest(evals["bf16"]))
    for d in cfg.eval_hidden_dtypes:
        if d != "bf16":
            stages.run(f"extract-eval-{d}", extract_cmd(
                cfg, str(evals["bf16"] / "regenerated.jsonl"), evals[d], teachers=["topk"], hidden_dtype=d,
                regenerate=False, max_samples=0, max_new_tokens=0), has_manifest(evals[d]))

    # ---------------------------------------------------------------- drafters
    runs = work / "drafters"
    a = Drafter("A", human, "topk", "bf16", steps=cfg.steps_a, lr=cfg.lr,
                description="mismatched: chitchat human replies")
    budget = planned_tokens(human, a.steps, opts, world)[-1]
    drafters = [a]

    def add(name: str, data_path: Path, teacher: str, dtype: str, seed: int, multiple: int = 1, **kw: Any) -> None:
        # every run gets the step count whose tokens (in its own seed's data order) come closest to
        # ``multiple`` x A's
        steps = steps_for_tokens(data_path, budget * multiple, with_seed(opts, seed), world, start=a.steps * multiple)
        drafters.append(Drafter(seeded(name, seed), data_path, teacher, dtype, steps=steps, seed=seed, **kw))

    retrain_lr = cfg.retrain_lr if cfg.retrain_lr is not None else cfg.lr
    for seed in range(cfg.seeds):
        add("B", regen["bf16"], "topk", "bf16", seed, init_from="(A)", lr=retrain_lr,
            description="retrained: warm start from A, target's replies")
    # how tau grows with the retraining budget (each run its own lr schedule); the longest queued first
    for m in sorted(cfg.budget_multiples, reverse=True):
        add(f"B-x{m}", regen["bf16"], "topk", "bf16", 0, multiple=m, init_from="(A)", lr=retrain_lr,
            description=f"retrained: warm start from A, {m}x A's tokens")
    add("C", regen["bf16"], "topk", "bf16", 0, lr=cfg.lr, description="scratch: target's replies")
    for dtype, teacher in variants:
        for seed in range(cfg.seeds):
            add(f"S-{dtype}-{teacher}", storage_data[dtype], teacher, dtype, seed, lr=cfg.lr,
                description=f"storage variant: scratch, {dtype} hidden, {teacher}")
    log.info("token budget: A %d steps = %d tokens planned; the others: %s", a.steps, budget,
             ", ".join(f"{d.name} {d.steps} steps" for d in drafters[1:]))
    train_all(cfg, drafters, runs, stages, threads=train_threads)

    # ---------------------------------------------------------------- evaluation
    ev = work / "eval"
    ev.mkdir(exist_ok=True)
    all_runs = [runs / d.name for d in drafters]
    abc = [runs / n for n in ("A", "B", "C")]
    storage_runs = [runs / d.name for d in drafters if d.family.startswith("S-")]
    b_runs = [runs / d.name for d in drafters if d.family == "B"]
    jobs = [("chain-bf16", all_runs, evals["bf16"], False)]
    if cfg.tree:
        jobs.append(("tree-bf16", abc, evals["bf16"], True))
    for d in cfg.eval_hidden_dtypes:
        if d != "bf16":
            jobs.append((f"chain-{d}", storage_runs, evals[d], False))
    if indomain is not None:
        jobs.append(("indomain-chain", [abc[0], *b_runs, abc[2]], indomain, False))
    results: dict[str, dict[str, Any]] = {}
    for name, job_runs, job_data, tree in jobs:
        prefix = ev / name
        stages.run(f"eval-{name}", acceptance_cmd(cfg, job_runs, job_data, prefix, tree),
                   lambda p=prefix, r=job_runs: _newer_than_checkpoints(Path(f"{p}.json"), r))
        rep = json.loads(Path(f"{prefix}.json").read_text())
        results[name] = dict(zip([r.name for r in job_runs], rep["checkpoints"].values(), strict=True))
    online = None
    if cfg.online is not None:  # B's tau as vLLM CPU counts it, on the same MT-bench prompts and replies
        prefix = ev / "online-B"
        stages.run("online-B", online_cmd(cfg, runs / "B", evals["bf16"], prefix),
                   lambda p=prefix: _newer_than_checkpoints(Path(f"{p}.json"), [runs / "B"]))
        online = {"B": json.loads(Path(f"{prefix}.json").read_text())}
        online["B"].pop("per_request", None)

    # ---------------------------------------------------------------- evidence and report
    datasets = {}
    for p in dict.fromkeys([human, *regen.values(), *storage_data.values(), *evals.values(),
                            *([indomain] if indomain else [])]):
        m = manifest(p)
        datasets[p.name] = {"path": str(p), "num_samples": m["num_samples"], "num_tokens": m["num_tokens"],
                            "num_loss_tokens": m["num_loss_tokens"], "hidden_dtype": m["hidden_dtype"],
                            "teacher": m["teacher"], "generation": m.get("generation"),
                            "self_prompts": m.get("self_prompts"), "decontamination": m.get("decontamination"),
                            "tokens_per_sample": m["num_tokens"] / max(m["num_samples"], 1),
                            "loss_tokens_per_sample": m["num_loss_tokens"] / max(m["num_samples"], 1)}
    storage = {f"{dt}/{te}": storage_row(storage_data[dt], te) for dt, te in variants}
    drafter_rows: dict[str, Any] = {}
    for d in drafters:
        run = runs / d.name
        ckpt = latest_checkpoint(run)
        assert ckpt is not None
        state = json.loads((ckpt / "trainer_state.json").read_text())
        logged = logged_tokens(run)
        dm = manifest(d.data)
        drafter_rows[d.name] = {
            "description": d.description, "data": d.data.name, "teacher": d.teacher, "hidden_dtype": d.hidden_dtype,
            "init_from": d.init_from or None, "warm_start": (read_record(ckpt) or {}).get("warm_start"),
            "steps": d.steps,
            "lr": d.lr if d.lr is not None else _train_option(opts, "lr", None),
            "ttt_steps": _train_option(opts, "ttt_steps", 7),
            "draft_vocab_size": _train_option(opts, "draft_vocab_size", None),
            "seed": d.seed, "family": d.family,
            "planned_tokens": planned_tokens(d.data, d.steps, with_seed(opts, d.seed), world)[-1],
            "tokens_seen_metrics": logged["tokens"], "loss_tokens_seen_metrics": logged["loss_tokens"],
            "tokens_seen_rank0": state.get("tokens_seen"),
            "epochs_over_data": logged["tokens"] / max(int(dm["num_tokens"]), 1),
            "vocab_coverage_eval": vocab_coverage(ckpt, evals["bf16"]),
            "last_train": logged["last_train"], "last_val": logged["last_val"], "checkpoint": str(ckpt),
            "train_seconds": stages.seconds.get(f"train-{d.name}"),
        }
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "threads": threads, "train_processes": cfg.procs, "python": platform.python_version()},
        "config": snapshot, "train_options": opts, "datasets": datasets, "storage": storage,
        "drafters": drafter_rows, "eval": results, "online": online,
        "stage_seconds": stages.seconds, "stages_reused": stages.reused,
        "stage_seconds_total": sum(stages.seconds.values()),
        "wall_seconds_this_invocation": time.perf_counter() - t_start,
    }
    report["goals"] = goals(report)
    report["diagnosis"] = diagnosis(report)
    atomic_write_text(work / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    atomic_write_text(work / "report.md", markdown(report))
    write_plot(report, work / "report.png")
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="sizes (YAML, BenchConfig keys)")
    ap.add_argument("--out", type=Path, required=True, help="work folder: data, drafters, eval, report.*")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies train_prompts, self_prompts, "
                    "storage_samples and steps_a (the evaluation sets keep their size)")
    ap.add_argument("--procs", type=int, default=None, help="training processes: 1 (plain) or 2 (accelerate "
                    "launch, DeepSpeed ZeRO-2 on CPU); default from the config")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="OMP threads of extraction, evaluation and 1-process training")
    a = ap.parse_args(argv)
    ending.configure_logging(logging.INFO, "%(asctime)s %(name)s: %(message)s")
    try:
        cfg = BenchConfig.load(a.config)
        if a.procs is not None:
            cfg = dataclasses.replace(cfg, procs=a.procs)
            cfg.check("--procs")
        report = run_benchmark(cfg.scaled(a.scale), a.out, scale=a.scale, threads=a.threads)
    except BenchError as e:
        log.error("%s", e)
        sys.exit(2)
    print_summary(report)
    print(f"report: {a.out / 'report.md'}, {a.out / 'report.json'}, {a.out / 'report.png'}")
    return report


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.retrain_gain")))
