"""Peak RSS of the extraction stage on a Kimi-shaped stand-in, per shard size (a measurement, not a test).

The stand-in target has Kimi-K2.5's hidden size (7168) and 3 captured layers, so every captured token
is 86 KB of fp32 features as on the real model, while its weights stay tiny
(``redraft.catalog.tiny_models.make_kimi_shaped_standin``). The data are long conversations. Each run is the
real command line (``python -m extract``) in a fresh child process; its peak RSS is the child's
``ru_maxrss`` (``os.wait4``). The goal (issue 13) is that the peak stays within

    budget = model + 2 x one batch's features

whatever the shard size. ``model`` is measured, not assumed: the peak RSS of a child that loads the
stand-in through the HF backend and runs its forward over one full batch (``batch_tokens`` tokens)
with nothing captured, i.e. interpreter, libraries, weights and the forward's own activations (on a
CPU they are host memory; on a GPU host they would not count). One batch's features are
``batch_tokens x 3 x 7168 x 4`` bytes, the fp32 aux states of a full batch. The report also gives the
import-only RSS and the weight bytes.

`--code DIR` runs another checkout's extraction with this same script, so before and after are
measured alike:

    git archive 5f34f22 | tar -x -C /tmp/redraft-main          # main before bounded memory
    OMP_NUM_THREADS=1 python benchmarks/extract_memory.py --code /tmp/redraft-main --json mem-main.json
    OMP_NUM_THREADS=1 python benchmarks/extract_memory.py --json mem-branch.json

Shard sizes are set with --samples-per-shard only (main has no --shard-bytes; the default 4 GiB does not
bind at these sizes): by default 2 samples per shard (the fewest that still fill a 4096-token batch with
these ~1,900-token samples, so both runs capture the same batches) and every sample in one shard.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from redraft.core import cli as ending

ROOT = Path(__file__).resolve().parents[1]
KIMI_HIDDEN = 7168
NUM_AUX = 3

WORDS = ("the river bends where old stones sleep and a heron waits for the light to change while "
         "children count boats under a sky of slow clouds").split()


@dataclass
class Run:
    samples_per_shard: int
    shards: int
    peak_rss: int  # bytes
    seconds: float
    shard_bytes_on_disk: int  # largest shard file
    shard_tokens: int  # tokens in the largest shard


def build_world(root: Path, *, samples: int, words: int, seed: int = 0) -> tuple[Path, Path]:
    """The stand-in target and `samples` long conversations (one user turn, one long reply)."""
    from redraft.catalog.tiny_models import make_kimi_shaped_standin

    target = root / "kimi-shaped"
    if not (target / "config.json").exists():
        make_kimi_shaped_standin(target, hidden_size=KIMI_HIDDEN)
    rng = random.Random(seed)
    data = root / "long.jsonl"
    with open(data, "w") as f:
        for i in range(samples):
            reply = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"id": f"long-{i}", "conversations": [
                {"from": "human", "value": f"Tell me story number {i}."}, {"from": "gpt", "value": reply}]}) + "\n")
    return target, data


def child_env(code: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(code))
    return env


def peak_rss(cmd: list[str], code: Path, log: Path) -> tuple[int, float]:
    """(peak RSS in bytes, seconds) of one child process; raises if it fails."""
    start = time.perf_counter()
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, cwd=code, env=child_env(code), stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} exited {proc.returncode}; see {log}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start  # Linux reports KiB


def base_rss(code: Path, log: Path) -> int:
    """Peak RSS of a child that only imports what the extraction imports (no model, no data)."""
    imports = "import torch, transformers, extract.pipeline, extract.backends.hf"
    return peak_rss([sys.executable, "-c", imports], code, log)[0]


MODEL_FORWARD = """
import sys, torch
from extract.backends.hf import HFTarget
target = HFTarget(sys.argv[1], name="stand-in")
ids = torch.randint(0, target.info.vocab_size, (1, int(sys.argv[2])))
with torch.inference_mode():
    target.text_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
"""


def model_rss(code: Path, target: Path, batch_tokens: int, log: Path) -> int:
    """Peak RSS of loading the target and running one full batch through it, capturing nothing."""
    return peak_rss([sys.executable, "-c", MODEL_FORWARD, str(target), str(batch_tokens)], code, log)[0]


def extract(code: Path, target: Path, data: Path, out: Path, *, per_shard: int, batch_tokens: int,
            max_length: int, hidden_dtype: str, log: Path) -> Run:
    cmd = [sys.executable, "-m", "extract", "--target", str(target), "--data", str(data), "--out", str(out),
           "--samples-per-shard", str(per_shard), "--batch-tokens", str(batch_tokens), "--max-length",
           str(max_length), "--hidden-dtype", hidden_dtype, "--teacher", "topk", "--topk", "64", "--rank", "0",
           "--world-size", "1"]
    rss, seconds = peak_rss(cmd, code, log)
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    return Run(per_shard, len(shards), rss, seconds, max((out / s["path"]).stat().st_size for s in shards),
               max(s["num_tokens"] for s in shards))


def model_bytes(target: Path) -> int:
    return sum(p.stat().st_size for p in target.glob("*.safetensors"))


def measure(code: Path, work: Path, *, samples: int, words: int, batch_tokens: int, max_length: int,
            shard_sizes: list[int], hidden_dtype: str = "fp8") -> dict:
    """Build the world under `work` and run each shard size; returns the report (also what the test checks)."""
    work.mkdir(parents=True, exist_ok=True)
    target, data = build_world(work, samples=samples, words=words)
    log = work / "extract.log"
    base = base_rss(code, log)
    runs = []
    for per_shard in shard_sizes:
        out = work / f"ds-{per_shard}"
        if out.exists():
            import shutil

            shutil.rmtree(out)
        runs.append(extract(code, target, data, out, per_shard=per_shard, batch_tokens=batch_tokens,
                            max_length=max_length, hidden_dtype=hidden_dtype, log=log))
    batch_features = batch_tokens * NUM_AUX * KIMI_HIDDEN * 4
    model = model_rss(code, target, batch_tokens, log)
    manifest = json.loads((work / f"ds-{shard_sizes[0]}" / "manifest.json").read_text())
    return {
        "code": str(code), "samples": samples, "tokens": manifest["num_tokens"],
        "batch_tokens": batch_tokens, "hidden_size": KIMI_HIDDEN, "hidden_dtype": hidden_dtype,
        "num_aux": NUM_AUX, "base_rss": base, "weight_bytes": model_bytes(target), "model_rss": model,
        "batch_feature_bytes": batch_features,
        "dataset_feature_bytes_fp32": manifest["num_tokens"] * NUM_AUX * KIMI_HIDDEN * 4,
        "budget": model + 2 * batch_features, "runs": [asdict(r) for r in runs],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }


def print_table(report: dict) -> None:
    mb = 1 << 20
    print(f"code: {report['code']}; {report['samples']} samples, {report['tokens']} tokens, hidden "
          f"{report['hidden_size']} x {report['num_aux']} aux stored as {report['hidden_dtype']}, top-64 teacher, "
          f"batch {report['batch_tokens']} tokens")
    print(f"imports {report['base_rss'] / mb:,.0f} MiB; weights {report['weight_bytes'] / mb:,.0f} MiB; model (load + "
          f"one batch's forward) {report['model_rss'] / mb:,.0f} MiB; one batch's features "
          f"{report['batch_feature_bytes'] / mb:,.0f} MiB; all features (fp32) "
          f"{report['dataset_feature_bytes_fp32'] / mb:,.0f} MiB; budget (model + 2 batches) "
          f"{report['budget'] / mb:,.0f} MiB")
    print(f"{'samples/shard':>14}{'shards':>8}{'largest shard':>24}{'peak RSS':>11}{'above model':>13}"
          f"{'in batches':>12}{'<= budget':>11}{'seconds':>9}")
    for r in report["runs"]:
        above = r["peak_rss"] - report["model_rss"]
        print(f"{r['samples_per_shard']:>14}{r['shards']:>8}{r['shard_tokens']:>8,} tok {r['shard_bytes_on_disk'] / mb:>7,.0f} MiB"
              f"{r['peak_rss'] / mb:>7,.0f} MiB{above / mb:>9,.0f} MiB{above / report['batch_feature_bytes']:>12.2f}"
              f"{'yes' if r['peak_rss'] <= report['budget'] else 'NO':>11}{r['seconds']:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--code", default=str(ROOT), help="Checkout whose extraction runs (default: this one).")
    p.add_argument("--work", default=None, help="Working folder (default: a temporary one, removed after).")
    p.add_argument("--samples", type=int, default=12, help="Conversations in the data.")
    p.add_argument("--words", type=int, default=500, help="Words per reply (about 3.8 tokens each).")
    p.add_argument("--batch-tokens", type=int, default=4096, help="Padded tokens per capture batch.")
    p.add_argument("--max-length", type=int, default=4096, help="Tokens per sample at most.")
    p.add_argument("--hidden-dtype", default="fp8", choices=("bf16", "fp8"),
                   help="Storage dtype of hidden states (fp8: what configs/kimi-k25 uses).")
    p.add_argument("--shard-sizes", default="2,all", help="Samples per shard of each run (comma-separated; "
                                                           "'all': every sample in one shard).")
    p.add_argument("--json", default=None, help="Write the report here.")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="extract-memory-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        report = measure(Path(args.code).resolve(), work, samples=args.samples, words=args.words,
                         batch_tokens=args.batch_tokens, max_length=args.max_length,
                         shard_sizes=[args.samples if x == "all" else int(x) for x in args.shard_sizes.split(",")],
                         hidden_dtype=args.hidden_dtype)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.extract_memory")))
