"""Training throughput: tokens/s, achieved FLOP/s and peak memory next to the machine's matmul peak.

A benchmark, not a test. For each drafter shape (the demo config, a larger one, a Llama-3.2-1B-like
one) it reports

  * in-process (1 process, --threads threads): one optimizer step exactly as train/main.py runs
    it (teacher_from_topk densification, TTTModel forward over K TTT steps, backward, gradient
    clipping, AdamW), timed best-of-N, with a timed square fp32 matmul at the same thread count
    interleaved between the repeats (the "peak"); the figure is achieved FLOP/s / peak;
  * through train/main.py itself on a synthetic dataset (redraft.core.dataset.writer.write_shard +
    finalize_dataset) and a stub target folder: 1 plain process (--threads threads) and 2
    DeepSpeed ZeRO-2 processes over gloo (`accelerate launch --config_file
    configs/accelerate/cpu-2proc-zero2.yaml`, 1 thread each), tokens/s read from the run's own
    metrics.jsonl (log_every 1, first step dropped as warm-up, best step kept), against the
    peak at that process/thread layout (2-process peak = 2 x the 1-thread matmul peak);
  * side by side (--specforge and/or --code, benchmarks/train_sidebyside.py): redraft's step next
    to SpecForge 0.2.0's (benchmarks/specforge_train_step.py, run in SpecForge's own venv) and/or
    another checkout's, on the same weights and inputs, each side in its own process, alternating
    rounds: median step time with the min-max of the repeats, VmHWM over the steps, and a memory
    limit past which a side counts as not fitting.

FLOPs counted (analytic, matmuls only, per token; norms, RoPE, softmax, SiLU, the loss and the
optimizer count as 0): forward = fc (2 * 3Ht * H, once) + per TTT step k: q/k/v (2 * 2H * (nh +
2 nkv) * hd), o (2 * nh * hd * H), MLP (3 * 2 * H * I), lm_head (2 * H * Vd), attention scores
and values over the keys a query may see, causal step-0 keys plus k diagonal keys (4 * nh * hd *
((T + 1) / 2 + k)); backward = 2 x forward, except fc whose input needs no gradient (1 x). This is
the *useful* work, the same count for every side: the eager attention also multiplies the masked
part of its diagonal blocks (and recomputes the scores in the backward), SpecForge's the whole
[T, T] block; redraft's lm_head skips positions that predict no assistant token. Peak memory is
ru_maxrss of a worker process per shape (and its growth over the RSS before the first step); the
train/main.py rows report the largest rank's ru_maxrss.

    python benchmarks/train_throughput.py --json bench-train.json          # everything (4-8 min on a busy 2-core box)
    python benchmarks/train_throughput.py --skip-main --profile prof.txt   # in-process + profile only
    python benchmarks/train_throughput.py --shapes demo,1b --seqs 512,2048 --threads 1 \
        --specforge ~/.cache/redraft/conformance/specforge/bin/python --json bench-vs-specforge.json
    git archive BASE | tar -x -C /tmp/base && python benchmarks/train_throughput.py --shapes 1b \
        --seqs 512,2048,4096 --threads 1 --code /tmp/base --json bench-before-after.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import train_sidebyside
from train_case import (
    SHAPES,
    Shape,
    _drafter_and_batch,
    _train_step,
    flops_per_token,
    matmul_peak,
)

from redraft.core import cli as ending

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench.train")

ACCELERATE_CPU_CONFIG = ROOT / "configs/accelerate/cpu-2proc-zero2.yaml"
DEMO_TRAIN_CONFIG = ROOT / "configs/demo/train.yaml"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def worker(shape: Shape, threads: int, repeats: int) -> dict[str, Any]:
    """Time steps of one shape in this (fresh) process, interleaved with the matmul peak."""
    torch.set_num_threads(threads)
    model, batch = _drafter_and_batch(shape)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rss_before = _rss_bytes()
    _train_step(model, optimizer, batch)  # warm-up (allocator, AdamW state)
    step_times, cpu_times, peaks = [], [], []
    for _ in range(repeats):
        peaks.append(matmul_peak(threads, repeats=2))
        t0, c0 = time.perf_counter(), time.process_time()
        _train_step(model, optimizer, batch)
        step_times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_times": step_times, "cpu_times": cpu_times, "peaks": peaks, "rss_before": rss_before,
            "maxrss": maxrss}


def run_worker(shape: Shape, threads: int, repeats: int) -> dict[str, Any]:
    """worker() in a child process, so that ru_maxrss belongs to this shape alone."""
    cmd = [sys.executable, __file__, "--_worker", json.dumps(dataclasses.asdict(shape)),
           "--threads", str(threads), "--repeats", str(repeats)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads), cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"worker for {shape.name} failed (rc {res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def in_process_row(shape: Shape, threads: int, repeats: int, peaks: list[float]) -> dict[str, Any]:
    r = run_worker(shape, threads, repeats)
    peaks += r["peaks"]
    fl = flops_per_token(shape)
    best = min(r["step_times"])
    peak = max(r["peaks"])  # best step against the best peak seen: noise only ever slows either down
    return {
        "shape": shape.name, "mode": f"in-process x{threads}t", "tokens_per_step": shape.tokens,
        "step_s": best, "tokens_per_s": shape.tokens / best, "achieved_flops": fl["total"] * shape.tokens / best,
        "peak_flops": peak, "ratio": fl["total"] * shape.tokens / best / peak, "maxrss_mb": r["maxrss"] / 2**20,
        "step_rss_growth_mb": (r["maxrss"] - r["rss_before"]) / 2**20, "all_step_s": r["step_times"],
        # CPU seconds of the step: with 1 thread, the step's cost without the time other processes took
        "cpu_step_s": min(r["cpu_times"]), "all_cpu_step_s": r["cpu_times"],
    }


# ----------------------------------------------------------------------------- profile


def profile_step(shape: Shape, threads: int, path: Path | None, top: int = 20) -> dict[str, Any]:
    """torch.profiler over one warm training step; the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    model, batch = _drafter_and_batch(shape)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    _train_step(model, optimizer, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train_step(model, optimizer, batch)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    mm_ops = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_mkl_linear", "aten::linear"}
    matmul = sum(e.self_cpu_time_total for e in events if e.key in mm_ops)
    summary = {
        "step_ms": total / 1e3,
        "matmul_share": matmul / max(total, 1),
        "top": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / max(total, 1),
                 "calls": e.count} for e in rows[:top]],
    }
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    if path is not None:
        path.write_text(table)
    return summary


# ----------------------------------------------------------------------------- train/main.py runs


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS=str(threads), REDRAFT_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false")
    return env


def make_target(path: Path, s: Shape) -> Path:
    """Stub target folder: a Llama config.json and the input embedding (all train/main.py reads)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                head_dim=s.head_dim, intermediate_size=1536, num_hidden_layers=30, max_position_embeddings=8192,
                ).save_pretrained(path)
    g = torch.Generator().manual_seed(3)
    save_file({"model.embed_tokens.weight": (0.02 * torch.randn(s.vocab, s.hidden, generator=g)).to(torch.bfloat16)},
              str(path / "model.safetensors"))
    return path


def make_dataset(root: Path, target: Path, s: Shape, num_samples: int, per_shard: int = 8) -> Path:
    """Equal-length random samples (no padding, so tokens/s counts only real tokens)."""
    from redraft.core.dataset.format import SampleFeatures, dataset_header
    from redraft.core.dataset.writer import finalize_dataset, write_shard

    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(num_samples):
        t, k = s.seq, s.topk
        ids = torch.randint(0, s.vocab, (t,), generator=g)
        top = torch.randint(0, s.vocab // 2, (t, k), generator=g)  # skewed: the counted vocab is the low half
        lp = torch.log_softmax(2 * torch.randn(t, k, generator=g), -1).sort(-1, descending=True).values
        mask = torch.ones(t, dtype=torch.bool)
        mask[: t // 10] = False
        samples.append(SampleFeatures(sample_id=f"b{i:05d}", source="bench", category="chat", input_ids=ids,
                                      loss_mask=mask, aux_hidden=torch.randn(t, 3 * s.target_hidden, generator=g),
                                      topk_ids=top, topk_logprobs=lp))
    shards = [samples[i : i + per_shard] for i in range(0, num_samples, per_shard)]
    for index, chunk in enumerate(shards):
        write_shard(root, index, chunk, hidden_dtype="bf16", num_aux=3)
    header = dataset_header(
        {"name": "bench-stub", "path": str(target), "config_hash": "0" * 64, "architecture": "LlamaForCausalLM"},
        hidden_size=s.hidden, num_layers=30, vocab_size=s.vocab, aux_layer_ids=[1, 14, 26], tokenizer_hash="0" * 64,
        chat_template_hash="0" * 64, teacher=["topk"], topk=s.topk, hidden_dtype="bf16", max_length=s.seq,
    )
    finalize_dataset(root, num_shards=len(shards), header=header, vocab_size=s.vocab)
    return root


def main_run(data: Path, out: Path, s: Shape, procs: int, threads: int, steps: int) -> dict[str, Any]:
    """One train/main.py run; tokens/s per logged step from its metrics.jsonl."""
    args = ["train/main.py", "--config", str(DEMO_TRAIN_CONFIG), "--data", str(data), "--out", str(out),
            "--max_steps", str(steps), "--intermediate_size", str(s.intermediate),
            "--draft_vocab_size", str(s.draft_vocab), "--tokens_per_batch", str(s.tokens),
            "--max_length", str(s.seq), "--ttt_steps", str(s.ttt_steps), "--dtype", "fp32", "--log_every", "1",
            "--eval_every", "0", "--save_every", "0", "--val_fraction", "0", "--report_to", "none"]
    if procs == 1:
        cmd = [sys.executable, *args]
    else:
        accelerate = Path(sys.executable).with_name("accelerate")
        cmd = [str(accelerate), "launch", "--config_file", str(ACCELERATE_CPU_CONFIG), "--num_processes",
               str(procs), *args]
    # ru_maxrss of the children: GNU time is not everywhere, so wrap in python's resource module.
    wrapper = ("import resource,subprocess,sys;r=subprocess.run(sys.argv[1:]).returncode;"
               "print('MAXRSS_KB',resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,file=sys.stderr);"
               "sys.exit(r)")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True,
                         env=_env(threads), cwd=ROOT)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {res.returncode}):\n{res.stderr[-4000:]}")
    maxrss_kb = int(next(line.split()[1] for line in res.stderr.splitlines() if line.startswith("MAXRSS_KB")))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    tps = [r["tokens_per_s"] for r in rows]
    return {"tokens_per_s_steps": tps, "tokens_per_step": rows[-1]["tokens"], "wall_s": wall,
            "maxrss_mb": maxrss_kb / 1024}


def main_rows(shapes: list[Shape], threads: int, steps: int, peaks: dict[int, list[float]],
              procs_list: list[int]) -> list[dict[str, Any]]:
    """train/main.py runs; the peak is re-measured before each run and the best one seen is used."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        for s in shapes:
            target = make_target(Path(tmp) / f"target-{s.name}", s)
            need = (steps + 1) * max(procs_list) * s.batch
            data = make_dataset(Path(tmp) / f"data-{s.name}", target, s, num_samples=need)
            fl = flops_per_token(s)
            for procs in procs_list:
                per_proc_threads = threads if procs == 1 else 1
                peaks[per_proc_threads].append(matmul_peak(per_proc_threads))
                r = main_run(data, Path(tmp) / f"out-{s.name}-{procs}", s, procs, per_proc_threads, steps)
                peaks[per_proc_threads].append(matmul_peak(per_proc_threads))
                peak = procs * max(peaks[per_proc_threads])  # 2 processes x 1 thread: twice the 1-thread peak
                timed = r["tokens_per_s_steps"][1:] or r["tokens_per_s_steps"]  # drop the warm-up step
                best = max(timed)
                mode = "train/main.py 1 proc" if procs == 1 else f"train/main.py {procs} proc DS-ZeRO2"
                rows.append({
                    "shape": s.name, "mode": f"{mode} x{per_proc_threads}t", "tokens_per_step": r["tokens_per_step"],
                    "step_s": r["tokens_per_step"] / best, "tokens_per_s": best, "achieved_flops": fl["total"] * best,
                    "peak_flops": peak, "ratio": fl["total"] * best / peak, "maxrss_mb": r["maxrss_mb"],
                    "wall_s": r["wall_s"], "all_tokens_per_s": r["tokens_per_s_steps"],
                })
                log.info("%s %s: %.0f tok/s", s.name, mode, best)
    return rows


# ----------------------------------------------------------------------------- report


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'shape':<6} {'mode':<34} {'tok/step':>8} {'step s':>7} {'tok/s':>8} {'GFLOP/s':>8} {'peak':>8} " \
           f"{'ratio':>6} {'maxRSS MB':>9}"
    print(head + f" {'cpu-s':>7}")
    print("-" * (len(head) + 8))
    for r in rows:
        cpu = f"{r['cpu_step_s']:>7.3f}" if "cpu_step_s" in r else f"{'':>7}"
        print(f"{r['shape']:<6} {r['mode']:<34} {r['tokens_per_step']:>8} {r['step_s']:>7.3f} {r['tokens_per_s']:>8.0f} "
              f"{r['achieved_flops'] / 1e9:>8.1f} {r['peak_flops'] / 1e9:>8.1f} {r['ratio']:>6.1%} "
              f"{r['maxrss_mb']:>9.0f} {cpu}")


def side_by_side(a: argparse.Namespace, shapes: list[Shape]) -> None:
    """--specforge / --code: alternating rounds per shape and sequence length; a table and --json."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the running side is stopped too
    if a.code and not (a.code / "train" / "ttt.py").is_file():
        raise SystemExit(f"--code {a.code}: not a redraft checkout (no train/ttt.py)")
    sides: list[dict[str, Any]] = [{"name": "redraft", "kind": "redraft"}]
    if a.code:
        sides.append({"name": f"redraft@{a.code.name}", "kind": "redraft", "code": a.code.resolve()})
    if a.specforge:
        sides.append({"name": "specforge", "kind": "specforge", "python": a.specforge})
    seqs = [int(x) for x in a.seqs.split(",")] if a.seqs else None
    t_start = time.perf_counter()
    peaks: list[float] = []
    cases = []
    for s in shapes:
        for seq in seqs or [s.seq]:
            shape = dataclasses.replace(s, seq=seq)
            log.info("%s T=%d (B=%d): %s", s.name, seq, s.batch, " vs ".join(x["name"] for x in sides))
            res = train_sidebyside.compare(
                json.dumps(dataclasses.asdict(shape)), sides, threads=a.threads, rounds=a.rounds, warmup=a.warmup,
                repeats=a.side_repeats, mem_limit=int(a.mem_limit_gb * 2**30), env=_env(a.threads), peaks=peaks,
                log=log)
            cases.append({"shape": dataclasses.asdict(shape), "flops_per_token": flops_per_token(shape), **res})
    peak = max(peaks)
    print_side_table(cases, peaks, a)
    if a.json is not None:
        report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                              "threads": a.threads},
                  "matmul_peak_flops": peak, "matmul_peak_samples": peaks,
                  "settings": {"rounds": a.rounds, "warmup": a.warmup, "repeats": a.side_repeats,
                               "mem_limit_gb": a.mem_limit_gb},
                  "cases": cases, "wall_s": time.perf_counter() - t_start}
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, a.json)


def print_side_table(cases: list[dict[str, Any]], peaks: list[float], a: argparse.Namespace) -> None:
    """One row per side: wall and CPU step time (median, min-max), FLOP/s, peak memory; ratios against redraft."""
    peak = max(peaks)
    head = (f"{'shape':<5} {'T':>5} {'side':<22} {'wall s (min-max)':>20} {'x':>6} {'CPU s (min-max)':>20} {'x':>6} "
            f"{'of peak':>7} {'peak GB':>8} {'redraft/this':>12} {'set-up GB':>9} {'loss@1':>9}")
    print(head)
    print("-" * len(head))
    gb = 2**30
    for c in cases:
        s = c["shape"]
        ours = c["sides"][0]
        tokens = s["batch"] * s["seq"]
        for side in c["sides"]:
            if not side["fits"]:
                print(f"{s['name']:<5} {s['seq']:>5} {side['name']:<22} {'did not fit: RSS passed':>48} "
                      f"{side['mem_limit'] / gb:.0f} GB (seen {side['rss_seen'] / gb:.1f})")
                continue
            cpu = [t for r in side["runs"] if not r.get("killed") for t in r["cpu_times"]]
            wall = f"{side['step_s_median']:.2f} ({side['step_s_min']:.2f}-{side['step_s_max']:.2f})"
            cpus = f"{side['cpu_s_median']:.2f} ({min(cpu):.2f}-{max(cpu):.2f})"
            busy = side["cpu_s_median"] / a.threads  # the step's time on otherwise idle cores
            flops = c["flops_per_token"]["total"] * tokens / busy
            x_wall = x_cpu = mem = ""
            if side is not ours and ours["fits"]:
                x_wall = f"{side['step_s_median'] / ours['step_s_median']:.2f}"
                x_cpu = f"{side['cpu_s_median'] / ours['cpu_s_median']:.2f}"
                mem = f"{ours['step_peak'] / side['step_peak']:.2f}"
            print(f"{s['name']:<5} {s['seq']:>5} {side['name']:<22} {wall:>20} {x_wall:>6} {cpus:>20} {x_cpu:>6} "
                  f"{flops / peak:>7.1%} {side['step_peak'] / gb:>8.2f} {mem:>12} {side['rss_before'] / gb:>9.2f} "
                  f"{side['first_loss']:>9.4f}")
    loads = [x for c in cases for x in c["load_1min"]]
    print(f"threads {a.threads}; {a.rounds} alternating rounds x ({a.warmup} warm-up + {a.side_repeats} timed) steps "
          f"per side; matmul peak (fp32 2048^3, {a.threads} thread(s), best of {len(peaks)}): {peak / 1e9:.1f} "
          f"GFLOP/s; 1-min load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs")
    print("x: this side's median / redraft's. CPU s: the step's process time (with 1 thread, its time on a core of "
          "its own); of peak: useful FLOPs / (CPU s / threads) / matmul peak. peak GB: VmHWM over the process's "
          "steps (after its set-up); set-up GB: VmRSS before the first step; redraft/this: redraft's peak / this "
          "side's; loss@1: the first step's loss (SpecForge's has its own masking and normalisation)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="demo,large", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of a 1-process run")
    ap.add_argument("--repeats", type=int, default=3, help="timed in-process steps per shape (best kept)")
    ap.add_argument("--main-steps", type=int, default=3, help="optimizer steps per train/main.py run (first dropped)")
    ap.add_argument("--procs", default="1,2", help="process counts for the train/main.py runs")
    ap.add_argument("--skip-main", action="store_true", help="only the in-process measurement")
    ap.add_argument("--profile", type=Path, default=None, help="write the demo step's profiler table here")
    ap.add_argument("--json", type=Path, default=None, help="write all numbers here")
    side = ap.add_argument_group("side by side (same weights and inputs, each side in its own process, alternating "
                                 "rounds; replaces the modes above)")
    side.add_argument("--specforge", default=None, metavar="PYTHON",
                      help="SpecForge 0.2.0's venv python (conformance/make_venv.sh specforge; the conformance lane builds "
                           "~/.cache/redraft/conformance/specforge): redraft's step next to SpecForge's")
    side.add_argument("--code", type=Path, default=None, metavar="DIR",
                      help="another redraft checkout (e.g. `git archive BASE | tar -x -C DIR`): this checkout's "
                           "step next to that one's (before/after)")
    side.add_argument("--seqs", default=None, help="comma list of sequence lengths (default: each shape's own)")
    side.add_argument("--rounds", type=int, default=2, help="alternating rounds (each side: one process per round)")
    side.add_argument("--warmup", type=int, default=1, help="untimed steps per process")
    side.add_argument("--side-repeats", type=int, default=1, help="timed steps per process")
    side.add_argument("--mem-limit-gb", type=float, default=16.0,
                      help="stop a side whose RSS passes this many GiB and report it as not fitting")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker is not None:
        print(json.dumps(worker(Shape(**json.loads(a._worker)), a.threads, a.repeats)))
        return
    ending.configure_logging(logging.INFO, "%(asctime)s %(name)s: %(message)s")
    shapes = [SHAPES[n] for n in a.shapes.split(",")]
    if a.specforge or a.code:
        side_by_side(a, shapes)
        return
    t_start = time.perf_counter()
    peaks: dict[int, list[float]] = {1: [matmul_peak(1)], a.threads: [matmul_peak(a.threads)]}
    log.info("matmul peak: %.1f GFLOP/s (1 thread), %.1f GFLOP/s (%d threads)", peaks[1][0] / 1e9,
             peaks[a.threads][0] / 1e9, a.threads)
    rows = []
    for s in shapes:
        rows.append(in_process_row(s, a.threads, a.repeats, peaks[a.threads]))
        log.info("%s in-process: %.0f tok/s", s.name, rows[-1]["tokens_per_s"])
    prof = None
    if a.profile is not None:
        prof = profile_step(SHAPES["demo"], a.threads, a.profile)
    if not a.skip_main:
        rows += main_rows(shapes, a.threads, a.main_steps, peaks, [int(p) for p in a.procs.split(",")])
    print_table(rows)
    print(f"matmul peak (fp32 2048^3, best of {len(peaks[1])}/{len(peaks[a.threads])} measurements): "
          f"{max(peaks[1]) / 1e9:.1f} GFLOP/s at 1 thread, {max(peaks[a.threads]) / 1e9:.1f} at {a.threads}")
    for s in shapes:
        fl = flops_per_token(s)
        print(f"{s.name}: {fl['total'] / 1e6:.1f} MFLOP/token/step (fwd {fl['forward'] / 1e6:.1f}); "
              + ", ".join(f"{k[6:]} {v / fl['total']:.0%}" for k, v in fl.items() if k.startswith("total_")))
    if prof is not None:
        print(f"profile (demo, 1 step, {prof['step_ms']:.0f} ms self CPU; matmul {prof['matmul_share']:.0%}):")
        for e in prof["top"][:12]:
            print(f"  {e['op']:<40} {e['self_ms']:>8.1f} ms {e['share']:>6.1%} x{e['calls']}")
    if a.json is not None:
        report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                              "threads": a.threads},
                  "matmul_peak_flops": {str(k): max(v) for k, v in peaks.items()},
                  "matmul_peak_samples": {str(k): v for k, v in peaks.items()},
                  "shapes": {s.name: {**dataclasses.asdict(s), "flops_per_token": flops_per_token(s)} for s in shapes},
                  "rows": rows, "profile": prof, "wall_s": time.perf_counter() - t_start}
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, a.json)


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.train_throughput")))
