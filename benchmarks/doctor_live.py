"""serve.doctor on live deployments, one planted fault each and two healthy ones per engine (a benchmark).

    python benchmarks/doctor_live.py --out docs/results/doctor-live [--engines vllm,sglang]

What runs: the built-in SmolLM2 target served by each engine (vLLM 0.32's own CPU engine; SGLang 0.5.23's engine with
redraft's stand-in for its compiled CPU kernels, so its speeds are the stand-in's), a base server of the same target
beside the speculative ones, and ``python -m serve.doctor`` against each deployment as a user runs it. Two drafters,
both trained here by the real commands (``python -m extract`` regenerating the target's replies, ``train/main.py``
with ``configs/demo/train-fitted.yaml``, ``python -m eval.export``), on the same amount of data:

- *fitted*: the target's own replies to the probe's prompts (the first MT-bench first turns): a drafter that fits the
  traffic it serves (the healthy deployments);
- *other-data*: the target's replies to as many chitchat openings: a drafter fitted to another data set.

Deployments per engine (each row: the fault planted, the findings the doctor must name, the ones it may name as
consequences of that fault; any other finding is a false finding):

- healthy: the fitted drafter at its own ids and context, beside the base at 1 and 4 streams (SGLang: an explicit
  ``--max-running-requests``); a second healthy deployment with other settings (vLLM: 2 drafts in a longer context;
  SGLang: a tree);
- other data: the other-data drafter beside the base at 1 and 4 streams (SGLang: with its defaults, so the cap of 48
  too): the drafter does not fit, and its 3 drafts cost throughput at 4 streams;
- one layer off / short context: the healthy server examined with a copy of its drafter folder whose ids are one
  layer below the trained ones / whose context is half the server's;
- SGLang only: the write-up's deployment done redraft's way on Kimi-K2.5's miniature (kimi-k25-mini, its MLA drafter
  fitted the same way, an explicit ``--max-running-requests``), beside a base kimi-k25-mini server.

``--work DIR`` keeps the drafters between runs (each stage is skipped when its output is there).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reporting import publish

from redraft.core import cli as ending

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.doctor_live")
TARGET = "smollm2-135m-instruct"
KIMI = "kimi-k25-mini"
CONTEXT = 1024
# each drafter: its data (the target's replies to it), the extraction config and the training config (+ overrides)
RECIPES = {
    "fitted": ("mtbench", "configs/engine-truth/mtbench.yaml", ["--config", "configs/demo/train-fitted.yaml"]),
    "other-data": ("chitchat", "configs/engine-truth/mtbench.yaml", ["--config", "configs/demo/train-fitted.yaml"]),
    # Kimi-K2.5's miniature and its MLA drafter (the shape engine-truth's Kimi lane trains), fitted the same way
    "kimi-fitted": ("mtbench", "configs/engine-truth/kimi-mtbench.yaml",
                    ["--config", "configs/engine-truth/kimi-train-mla.yaml", "--max-steps", "40", "--lr", "3e-3",
                     "--ttt-steps", "3", "--val-fraction", "0", "--eval-every", "0", "--save-every", "0"]),
}


@dataclass
class Deployment:
    engine: str
    name: str
    planted: str  # the fault, or "none"
    server: str  # which speculative server (see servers())
    expected: set[str] = field(default_factory=set)  # must be named
    allowed: set[str] = field(default_factory=set)  # consequences of the planted fault, not false findings
    folder_edit: str | None = None  # "one-layer-off" | "short-context": the drafter folder given with --drafter
    beside_base: bool = False


DEPLOYMENTS = [
    Deployment("vllm", "healthy, 3 drafts", "none", "vllm-fitted-3", beside_base=True),
    Deployment("vllm", "healthy, 2 drafts, context 2,048", "none", "vllm-fitted-2"),
    Deployment("vllm", "other data", "a drafter fitted to other data; 3 drafts at 4 streams", "vllm-other-3",
               {"drafter-does-not-fit", "loses-at-concurrency"}, {"no-gain-one-stream"}, beside_base=True),
    Deployment("vllm", "one layer off", "aux ids one layer off", "vllm-fitted-3", {"layer-ids-misread"},
               folder_edit="one-layer-off"),
    Deployment("vllm", "short context", "drafter context 512 < 1,024 served", "vllm-fitted-3", {"context-length"},
               folder_edit="short-context"),
    Deployment("sglang", "healthy chain", "none", "sglang-fitted-chain", beside_base=True),
    Deployment("sglang", "healthy tree", "none", "sglang-fitted-tree"),
    Deployment("sglang", "other data, SGLang's defaults", "a drafter fitted to other data; no "
               "--max-running-requests; 3 steps at 4 streams", "sglang-other-defaults",
               {"sglang-cap-48", "drafter-does-not-fit", "loses-at-concurrency"}, {"no-gain-one-stream"},
               beside_base=True),
    Deployment("sglang", "one layer off", "aux ids one layer off", "sglang-fitted-chain", {"layer-ids-misread"},
               folder_edit="one-layer-off"),
    Deployment("sglang", "short context", "drafter context 512 < 1,024 served", "sglang-fitted-chain",
               {"context-length"}, folder_edit="short-context"),
    # the write-up's deployment done redraft's way, on Kimi-K2.5's miniature: its own MLA drafter, fitted to the
    # traffic, the ids SGLang 0.5.23 reads as trained, an explicit --max-running-requests
    Deployment("sglang", "kimi-k25-mini, redraft's drafter", "none", "sglang-kimi-chain", beside_base=True),
]


def run(cmd: list[str], logfile: Path) -> None:
    """A real command, its output in ``logfile``; a failure stops the benchmark with the log's end."""
    with logfile.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}):\n{logfile.read_text()[-3000:]}")


def train_drafter(work: Path, name: str, target: Path, prompts: int, max_tokens: int) -> Path:
    """Regenerate the target's replies (with transformers, greedily) to ``prompts`` records of the drafter's data,
    then train on them (``RECIPES``)."""
    data, ckpt = work / name / "data", work / name / "run"
    data_name, extract_config, train_args = RECIPES[name]
    if not (data / "manifest.json").is_file():
        run([sys.executable, "-m", "extract", "--config", extract_config, "--target", str(target), "--regen-backend",
             "hf", "--data", data_name, "--max-samples", str(prompts), "--max-new-tokens", str(max_tokens),
             "--out", str(data)], work / f"{name}-extract.log")
    if not (ckpt / "latest").exists():
        run([sys.executable, "train/main.py", *train_args, "--data", str(data), "--out", str(ckpt)],
            work / f"{name}-train.log")
    return ckpt


def export(work: Path, name: str, ckpt: Path, target: Path, engine: str) -> Path:
    out = work / name / f"export-{engine}"
    if not (out / "config.json").is_file():
        run([sys.executable, "-m", "eval.export", str(ckpt), str(out), "--format", engine, "--target", str(target),
             "--dtype", "fp32"], work / f"{name}-export-{engine}.log")
    return out


def edited_folder(folder: Path, edit: str, work: Path) -> Path:
    """A copy of the served drafter folder with one fault written into its config.json."""
    out = work / f"{folder.parent.name}-{folder.name}-{edit}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    if edit == "one-layer-off":
        eagle = config["eagle_config"]
        eagle["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    else:
        config["max_position_embeddings"] = CONTEXT // 2
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def servers(engine: str, targets: dict[str, Path], drafters: dict[str, Path]) -> dict[str, Any]:
    """Each speculative server's settings (started one at a time) and the bases' ("base" for SmolLM2, "base-kimi")."""
    target = targets[TARGET]
    if engine == "vllm":
        from redraft.engines.vllm import EngineSettings

        def spec(drafter: str, steps: int, length: int = CONTEXT) -> EngineSettings:
            return EngineSettings(target=str(target), drafter=str(drafters[drafter]), steps=steps,
                                  max_model_len=length, kv_cache_bytes=1 << 28)

        return {"base": EngineSettings(target=str(target), max_model_len=CONTEXT, kv_cache_bytes=1 << 28),
                "vllm-fitted-3": spec("fitted", 3), "vllm-fitted-2": spec("fitted", 2, 2 * CONTEXT),
                "vllm-other-3": spec("other-data", 3)}
    plain = {"model_path": str(target), "dtype": "float32", "context_length": CONTEXT}

    def eagle(drafter: str, topk: int, tokens: int, mrr: int | None = 8) -> dict[str, Any]:
        return {**plain, **({"max_running_requests": mrr} if mrr else {}), "speculative_algorithm": "EAGLE3",
                "speculative_draft_model_path": str(drafters[drafter]), "speculative_num_steps": 3,
                "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens}

    kimi = {"model_path": str(targets[KIMI]), "dtype": "float32", "context_length": CONTEXT, "max_running_requests": 8}
    return {"base": {**plain, "max_running_requests": 8}, "sglang-fitted-chain": eagle("fitted", 1, 4),
            "sglang-fitted-tree": eagle("fitted", 2, 6), "sglang-other-defaults": eagle("other-data", 1, 4, None),
            "base-kimi": kimi, "sglang-kimi-chain": {**kimi, **{k: v for k, v in eagle("kimi-fitted", 1, 4).items()
                                                                 if k.startswith("speculative")}}}


def start(engine: str, settings: Any) -> AbstractContextManager:
    if engine == "vllm":
        from redraft.engines.vllm import VLLMServer

        return VLLMServer(settings, stats=True)
    from redraft.engines.sglang import SGLangServer

    return SGLangServer(settings)


def examine(d: Deployment, url: str, base_url: str, drafter: Path, target: Path, args: argparse.Namespace,
            work: Path) -> dict[str, Any]:
    """``python -m serve.doctor`` on one deployment, and its findings against the planted fault."""
    folder = edited_folder(drafter, d.folder_edit, work) if d.folder_edit else drafter
    slug = "".join(c if c.isalnum() else "-" for c in d.name.lower()).replace("--", "-").strip("-")
    out = work / f"doctor-{d.engine}-{slug}.json"
    cmd = [sys.executable, "-m", "serve.doctor", "--url", url, "--drafter", str(folder), "--tokenizer", str(target),
           "--num-prompts", str(args.prompts), "--max-tokens", str(args.max_tokens), "--json", str(out)]
    cmd += ["--base-url", base_url, "--concurrency", "1,4"] if d.beside_base else ["--concurrency", "1"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)}: rc {res.returncode}\n{res.stderr[-3000:]}")
    result = json.loads(out.read_text())
    found = [f["code"] for f in result["findings"]]
    one = next(lv for lv in result["probe"]["levels"] if lv["concurrency"] == 1)
    ratios = {r["concurrency"]: r["aggregate_tok_s"]["ratio"] for r in result["probe"]["comparison"]}
    return {"engine": d.engine, "deployment": d.name, "planted": d.planted, "expected": sorted(d.expected),
            "found": found, "missing": sorted(d.expected - set(found)),
            "false": sorted(set(found) - d.expected - d.allowed), "exit": res.returncode,
            "accept_length_1": one["accept_length"], "ratio_1": ratios.get(1), "ratio_4": ratios.get(4),
            "probe_seconds": result["probe"]["seconds"], "fixes": {f["code"]: f["fix"] for f in result["findings"]},
            "report": out.name}


def drafter_of(server: str) -> str:
    return "kimi-fitted" if "kimi" in server else "other-data" if "other" in server else "fitted"


def engine_rows(engine: str, targets: dict[str, Path], ckpts: dict[str, Path], args: argparse.Namespace,
                work: Path) -> list[dict[str, Any]]:
    """Each base server in turn, and beside it each speculative server of its target, one at a time."""
    wanted = {d.server for d in DEPLOYMENTS if d.engine == engine}
    drafters = {name: export(work, name, ckpt, targets[KIMI if name.startswith("kimi") else TARGET], engine)
                for name, ckpt in ckpts.items() if any(drafter_of(s) == name for s in wanted)}
    plan = servers(engine, targets, drafters)
    rows = []
    for base_name in [s for s in plan if s.startswith("base")]:
        kimi = base_name == "base-kimi"
        spec = [s for s in plan if s in wanted and ("kimi" in s) == kimi]
        if not spec:
            continue
        target = targets[KIMI if kimi else TARGET]
        with start(engine, plan[base_name]) as base:
            for server in spec:
                started = time.monotonic()
                log.info("%s: starting %s", engine, server)
                with start(engine, plan[server]) as srv:
                    log.info("%s: %s up in %.0f s", engine, server, time.monotonic() - started)
                    for d in [d for d in DEPLOYMENTS if d.engine == engine and d.server == server]:
                        rows.append(examine(d, srv.url, base.url, drafters[drafter_of(server)], target, args, work))
                        r = rows[-1]
                        log.info("%s %s: found %s (missing %s, false %s)", engine, d.name, r["found"],
                                 r["missing"], r["false"])
    return rows


def portable(text: str, names: dict[str, str]) -> str:
    for path, name in names.items():
        text = text.replace(path, name)
    return text


def render(report: dict[str, Any]) -> str:
    lines = ["# serve.doctor on live deployments", "",
             f"`python benchmarks/doctor_live.py --out docs/results/doctor-live` ({report['prompts']} MT-bench "
             f"prompts, {report['max_tokens']} tokens each; {report['seconds']:.0f} s).", "",
             "| engine | deployment | planted fault | doctor found | missing | false | tokens per round at 1 | "
             "speed-up at 1 / 4 | probe s | exit |", "|---|---|---|---|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        speed = " / ".join("-" if x is None else f"{x:.2f}x" for x in (r["ratio_1"], r["ratio_4"]))
        acc = "n/a" if r["accept_length_1"] is None else f"{r['accept_length_1']:.2f}"
        lines.append(f"| {r['engine']} | {r['deployment']} | {r['planted']} | {', '.join(r['found']) or 'nothing'} "
                     f"| {', '.join(r['missing']) or '-'} | {', '.join(r['false']) or '-'} | {acc} | {speed} | "
                     f"{r['probe_seconds']:.0f} | {r['exit']} |")
    s = report["summary"]
    lines += ["", f"Planted faults named: {s['named']} of {s['planted']}; healthy deployments with no finding: "
              f"{s['healthy_clean']} of {s['healthy']}; false findings: {s['false']}; slowest probe "
              f"{s['slowest_probe_s']:.0f} s.", "",
              "Whose numbers: acceptance and tokens/s are each engine's own (vLLM's /metrics, SGLang's per-request "
              "counters); SGLang runs on redraft's stand-in for its CPU kernels, so its speeds are the stand-in's.",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="write report.json / report.md and the doctor's reports here")
    ap.add_argument("--engines", default="vllm,sglang", help="comma-separated: vllm, sglang")
    ap.add_argument("--prompts", type=int, default=4, help="prompts the drafters train on and the probe sends")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per reply, in training and in the probe")
    ap.add_argument("--work", default="", help="working folder, reused when run again (default: a temporary one)")
    args = ap.parse_args(argv)
    ending.configure_logging(logging.INFO, "%(asctime)s %(name)s: %(message)s")
    engines = [e for e in args.engines.split(",") if e]
    if not set(engines) <= {"vllm", "sglang"}:
        ap.error(f"--engines {args.engines}: expected vllm and/or sglang")
    if args.prompts < 1 or args.max_tokens < 1:
        ap.error(f"--prompts {args.prompts} --max-tokens {args.max_tokens}: both must be at least 1")
    from redraft.catalog.builtin import resolve_target

    work = Path(args.work or tempfile.mkdtemp(prefix="doctor-live-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    targets = {TARGET: resolve_target(TARGET), **({KIMI: resolve_target(KIMI)} if "sglang" in engines else {})}
    ckpts = {name: train_drafter(work, name, targets[KIMI if name.startswith("kimi") else TARGET], args.prompts,
                                 args.max_tokens)
             for name in RECIPES if not name.startswith("kimi") or "sglang" in engines}
    rows = [r for engine in engines for r in engine_rows(engine, targets, ckpts, args, work)]
    healthy = [r for r in rows if r["planted"] == "none"]
    summary = {"planted": sum(r["planted"] != "none" for r in rows),
               "named": sum(r["planted"] != "none" and not r["missing"] for r in rows),
               "healthy": len(healthy), "healthy_clean": sum(not r["found"] for r in healthy),
               "false": sum(len(r["false"]) for r in rows), "slowest_probe_s": max(r["probe_seconds"] for r in rows)}
    report = {"prompts": args.prompts, "max_tokens": args.max_tokens, "engines": engines, "rows": rows,
              "summary": summary, "seconds": time.monotonic() - started}
    # the paths of this run's folders said by name, so that the committed reports hold no path of one machine
    names = {str(work): "WORK", str(targets[TARGET].parent): "$REDRAFT_CACHE"}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for r in rows:  # the doctor's own reports beside the table
            (Path(args.out) / r["report"]).write_text(portable((work / r["report"]).read_text(), names))
    publish(json.loads(portable(json.dumps(report), names)), render(report), args.out, "report")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.doctor_live")))
