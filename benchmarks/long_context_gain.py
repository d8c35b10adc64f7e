"""Why train at length: τ by position bucket for a drafter trained at 4K against one trained at the long length.

    python benchmarks/long_context_gain.py --out docs/results/long-context-gain [--target smollm2-135m-instruct] \\
        [--train-samples 24] [--eval-samples 8] [--max-length 8192] [--short-length 4096] [--epochs 2] \
        [--engine-truth]

How the long set is made (the embedded targets, no hub): each sample is one chat whose user turn is a transcript
of whole chitchat conversations joined end to end (a different length per sample, from a few hundred tokens to
near ``--max-length`` minus the reply), followed by a request to continue it; the target writes the reply itself
(``python -m extract --regenerate``, greedy, up to ``--max-new-tokens``), so every assistant token is the target's
own argmax and the offline walk is exact. The replies therefore sit at every position from the start to the end of
the context, and the two drafters see the same samples, steps and seed:

- ``short``: trained with ``max_length`` = ``--short-length`` (4,096: what the Kimi configs cut at), so a reply
  past that position is cut from its training;
- ``long``: trained with the whole samples (``--max-length``).

Both are then walked over held-out long samples (``python -m eval.acceptance``, chains of ``--steps``) and the
report gives τ per position bucket (0-4K, 4K-16K, 16K+; the engine walk's buckets) for each. ``--engine-truth``
also serves the long-trained drafter in vLLM on the same held-out samples and holds its own counters against the
offline walk, per request (``python -m eval.engine_truth``). Stages are the
project's own CLIs in subprocesses, rerun-safe (a finished stage is reused). OUT/report.json and report.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from retrain_gain import BenchError, Stages, has_manifest

from redraft.catalog.builtin import chitchat_records
from redraft.catalog.long_chats import long_chats, transcripts
from redraft.core import cli as ending
from redraft.core.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("long_context_gain")

def chats_file(count: int, first: int, texts: list[str], max_prompt_tokens: int, out: Path) -> Path:
    """redraft.catalog.long_chats' chats as JSONL, written only when changed, so a rerun reuses the extraction."""
    try:
        rows = long_chats(count, first, texts, max_prompt_tokens)
    except ValueError as e:
        raise BenchError(str(e)) from None
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not out.is_file() or out.read_text() != text:
        atomic_write_text(out, text)
    return out


def extract_cmd(args: argparse.Namespace, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "extract", "--target", args.target, "--data", str(data), "--out", str(out),
            "--teacher", "topk", "--topk", "8", "--max-length", str(args.max_length), "--samples-per-shard", "4",
            "--dtype", "float32", "--regenerate", "--max-user-turns", "1", "--temperature", "0",
            "--max-new-tokens", str(args.max_new_tokens), "--regen-backend", args.regen_backend]


def train_cmd(args: argparse.Namespace, data: Path, out: Path, max_length: int) -> list[str]:
    return [sys.executable, "train/main.py", "--config", str(ROOT / "configs/demo/train.yaml"), "--data", str(data),
            "--out", str(out), "--max-length", str(max_length), "--tokens-per-batch", str(args.max_length),
            "--micro-batch-size", "1", "--max-steps", "0", "--num-epochs", str(args.epochs), "--val-fraction", "0",
            "--eval-every", "0", "--save-every", "0", "--keep-last", "1", "--ttt-steps", str(args.steps),
            "--attention-impl", "sdpa", "--activation-checkpointing", "true", "--lr", str(args.lr),
            "--warmup-ratio", "0.05", "--resume", "auto", "--report-to", "none"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="work folder and report (rerun-safe)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="built-in target or HF folder")
    p.add_argument("--train-samples", type=int, default=24)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--max-length", type=int, default=8192, help="the long length (the target's context at most)")
    p.add_argument("--short-length", type=int, default=4096, help="what the short drafter trains at")
    p.add_argument("--max-new-tokens", type=int, default=768, help="regenerated reply length")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="TTT steps in training and the chain length walked")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--regen-backend", default="vllm", choices=("hf", "vllm"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine-truth", action="store_true",
                   help="also hold the long-trained drafter's offline walk against vLLM's own counters per request")
    args = p.parse_args(argv)
    ending.configure_logging(logging.INFO, "%(asctime)s %(name)s: %(message)s")
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    stages = Stages(work, args.threads)
    texts = transcripts(chitchat_records())
    max_prompt = args.max_length - args.max_new_tokens - 64
    inputs = work / "inputs"
    inputs.mkdir(exist_ok=True)
    train_in = chats_file(args.train_samples, 0, texts, max_prompt, inputs / "train.jsonl")
    # the held-out chats start halfway through chitchat: no conversation of the training chats in them
    eval_in = chats_file(args.eval_samples, len(texts) // 2, texts, max_prompt, inputs / "eval.jsonl")
    data = {"train": work / "data-train", "eval": work / "data-eval"}
    stages.run("extract-train", extract_cmd(args, train_in, data["train"]), has_manifest(data["train"]))
    stages.run("extract-eval", extract_cmd(args, eval_in, data["eval"]), has_manifest(data["eval"]))
    runs = {"short": (work / "run-short", args.short_length), "long": (work / "run-long", args.max_length)}
    for name, (run, length) in runs.items():
        stages.run(f"train-{name}", train_cmd(args, data["train"], run, length), lambda r=run: (r / "latest").is_file())
    prefix = work / "acceptance"
    cmd = [sys.executable, "-m", "eval.acceptance", *(str(run) for run, _ in runs.values()),
           "--data", str(data["eval"]), "--split", "all", "--steps", str(args.steps), "--no-progress",
           "--json", f"{prefix}.json", "--markdown", f"{prefix}.md"]
    stages.run("eval", cmd, lambda: Path(f"{prefix}.json").is_file())
    truth = None
    if args.engine_truth:  # the engine's own counters on the same long samples, per request
        truth_json = work / "engine-truth.json"
        cmd = [sys.executable, "-m", "eval.engine_truth", str(runs["long"][0]), "--data", str(data["eval"]),
               "--engine", "vllm", "--steps", str(args.steps), "--min-samples",
               str(args.eval_samples), "--speed-samples", "0", "--json", str(truth_json)]
        stages.run("engine-truth", cmd, truth_json.is_file)
        truth = json.loads(truth_json.read_text())
    report = build_report(args, json.loads(Path(f"{prefix}.json").read_text()), data, stages)
    report["engine_truth"] = None if truth is None else _truth_summary(truth)
    atomic_write_text(work / "report.json", json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    atomic_write_text(work / "report.md", text)
    print(text)
    return report


def build_report(args: argparse.Namespace, acceptance: dict[str, Any], data: dict[str, Path],
                 stages: Stages) -> dict[str, Any]:
    """τ per position bucket per drafter, with how the sets were made."""
    by_run = {Path(name).name.removeprefix("run-"): res for name, res in acceptance["checkpoints"].items()}
    sets = {}
    for name, path in data.items():
        m = json.loads((path / "manifest.json").read_text())
        sets[name] = {"samples": m.get("num_samples"), "tokens": m.get("num_tokens"), "max_length": args.max_length}
    return {
        "target": args.target, "short_length": args.short_length, "long_length": args.max_length,
        "epochs": args.epochs, "chain_steps": args.steps, "sets": sets,
        "drafters": {name: {"tau": res["tau"], "tau_estimator": res.get("tau_estimator"),
                            "evaluation": res.get("evaluation"),
                            "tau_by_position": res["engine_walk"]["tau_by_position"]} for name, res in by_run.items()},
        "stage_seconds": stages.seconds,
    }


def markdown(report: dict[str, Any]) -> str:
    names = list(report["drafters"])
    buckets = list(next(iter(report["drafters"].values()))["tau_by_position"])
    head = " | ".join(f"{n} (trained at {report[f'{n}_length']:,})" for n in names)
    out = [f"# τ by position: trained at {report['short_length']:,} against {report['long_length']:,} tokens", "",
           f"Target {report['target']}; chains of {report['chain_steps']}; {report['epochs']} epochs over the same "
           f"{report['sets']['train']['samples']} long chats (seed 0); walked over {report['sets']['eval']['samples']} "
           f"held-out long chats whose replies the target wrote (offline walk: "
           f"{', '.join(sorted({str(d['evaluation']) for d in report['drafters'].values()}))}).", "",
           f"| positions | {head} |", "|---|" + "---:|" * len(names)]
    for b in buckets:
        cells = []
        for n in names:
            cell = report["drafters"][n]["tau_by_position"][b]
            cells.append("-" if cell["tau"] is None else f"{cell['tau']:.3f} ({cell['rounds']:,} rounds)")
        out.append(f"| {b} | {' | '.join(cells)} |")
    overall = " | ".join(f"{report['drafters'][n]['tau']:.3f}" for n in names)
    out.append(f"| all | {overall} |")
    truth = report.get("engine_truth")
    if truth:
        out += ["", "The long-trained drafter in vLLM on the same held-out chats (`eval.engine_truth`, the engine's own "
                "counters per request):", "", "```", json.dumps(truth, indent=1), "```"]
    return "\n".join(out) + "\n"


def _truth_summary(truth: dict[str, Any]) -> dict[str, Any]:
    """Per chain length: τ online and offline, verify rounds, and the requests counted alike."""
    out = {}
    for k, run in truth["by_steps"].items():
        c = run["comparison"]
        per = c.get("per_request") or {}
        out[f"K={k}"] = {"tau_vllm": round(c["tau_online"], 4), "tau_offline": round(c["tau_offline"], 4),
                         "verify_rounds_vllm": c["online_drafts"], "verify_rounds_offline": c["offline_rounds"],
                         "requests_counted_alike": f"{per.get('equal')} of {per.get('compared')}",
                         "differing": [{"sample": m["sample"], "vllm": m["online"], "offline": m["offline"]}
                                       for m in per.get("mismatched", [])]}
    return out


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.long_context_gain")))
