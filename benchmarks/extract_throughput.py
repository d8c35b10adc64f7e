"""The extraction stage as a user runs it, part by part, next to a bare forward of the backbone (a benchmark).

    OMP_NUM_THREADS=1 python benchmarks/extract_throughput.py --threads 1 --samples 64 --repeats 3 \\
        --json bench-extract.json --markdown bench-extract.md
    python benchmarks/extract_throughput.py --samples 64 --regenerate hf,vllm --regen-samples 16 --max-new-tokens 64

Stage: ``extract.pipeline.run_extraction`` with the config ``python -m extract`` builds from the same
flags (a fresh output folder each time), so it includes everything a run does: reading the records,
planning the shards (which tokenises them once to size the shards), loading the target, tokenising,
regenerating (``--regenerate``: once per regeneration backend, hf / vllm / server), the capture forward
with its hooks, the top-k teacher, encoding and writing the shards, closing the engines and the
manifest. Its time is cut into those parts by the stage's own clock (``extract.timing``, the same
figures the run's summary line prints), exclusive and adding up to the stage's wall time.

Bare: the target's decoder stack alone (``model.model(input_ids, attention_mask)`` for a Llama: no
lm_head, no logits, no hooks), same weights, dtype, attention implementation and threads, on exactly the
batches the stage forwarded (read back from the dataset it wrote, packed by the same
``redraft.core.batching.pack_batches`` with the same ``--batch-tokens``), padded as the capture pads them. Both
are counted in real (unpadded) tokens. Stage and bare repeats are interleaved (stage then bare, then bare
then stage, ...) so load from elsewhere hits both; reported: median, best and the spread, and the ratio
stage / bare per pair of neighbouring runs. The model load (or engine start) and the engines' close are
fixed costs that a large run amortises, so the ratio is also given without the ``load`` and ``close``
parts. The first stage run in this process (imports, allocator warm-up) is kept apart and reported, not
counted.

Also reports bytes per token for bf16/fp8 x topk/last_hidden, measured from shards the stage writes
(``--sizes-samples`` records) and computed from the same layout for Kimi-K2.5's shapes (H = 7168), next to
SpecForge's 2 bytes x 4H per token.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redraft.core import cli as ending

log = logging.getLogger("bench.extract_throughput")

KIMI_HIDDEN = 7168
SPECFORGE_BYTES_PER_TOKEN = 2 * 4 * KIMI_HIDDEN  # bf16 aux (3H) + last hidden (H)
GOAL = 0.8  # issue 16: the whole stage >= 0.8x the bare backbone forward's tokens/s when not regenerating


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="target: built-in name or local HF folder")
    p.add_argument("--data", default="chitchat", help="input data: built-in name (chitchat, mtbench) or file")
    p.add_argument("--samples", type=int, default=64, help="input records per stage run (extract --max-samples)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved stage/bare repeats without regeneration")
    p.add_argument("--max-length", type=int, default=2048, help="extract --max-length (default: extract's, 2048)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="extract --batch-tokens (default: extract's, 8192)")
    p.add_argument("--topk", type=int, default=64, help="extract --topk (default: extract's, 64)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="target compute dtype")
    p.add_argument("--extract-args", default="", help="more `python -m extract` flags for every stage run, quoted")
    p.add_argument("--regenerate", default="", help="comma-separated regeneration backends to measure as well "
                                                   "(hf, vllm, server); empty: none")
    p.add_argument("--regen-samples", type=int, default=16, help="input records per regenerating run")
    p.add_argument("--regen-repeats", type=int, default=1, help="stage runs per regeneration backend")
    p.add_argument("--max-new-tokens", type=int, default=64, help="regeneration: most new tokens per reply")
    p.add_argument("--max-user-turns", type=int, default=1, help="regeneration: user turns answered (0: all)")
    p.add_argument("--regen-url", default="", help="regeneration backend server: the running server's URL")
    p.add_argument("--sizes-samples", type=int, default=16,
                   help="records per storage variant for the bytes/token table (0: skip it)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
                   help="torch threads for stage and bare, and OMP_NUM_THREADS of engine subprocesses "
                        "(default $OMP_NUM_THREADS; 0: torch's default)")
    p.add_argument("--keep", default="", help="keep the output folders here (default: a temporary folder)")
    p.add_argument("--json", default="", help="write the results here as JSON")
    p.add_argument("--markdown", default="", help="write the tables (with the command) here as Markdown")
    return p.parse_args(argv)


def stage_argv(args: argparse.Namespace, out: Path, samples: int, regen: str = "", extra: list[str] | None = None
               ) -> list[str]:
    """The `python -m extract` flags of one stage run."""
    argv = ["--target", args.target, "--data", args.data, "--out", str(out), "--max-samples", str(samples),
            "--max-length", str(args.max_length), "--batch-tokens", str(args.batch_tokens), "--topk", str(args.topk),
            "--dtype", args.dtype, "--device", "cpu", "--rank", "0", "--world-size", "1"]
    if regen:
        argv += ["--regenerate", "--regen-backend", regen, "--max-new-tokens", str(args.max_new_tokens),
                 "--max-user-turns", str(args.max_user_turns)]
        if regen == "server":
            argv += ["--regen-url", args.regen_url]
    return argv + shlex.split(args.extract_args) + (extra or [])


def run_stage(argv: list[str]) -> dict[str, Any]:
    """One stage run, timed by the pipeline's own clock; its folder is left for the caller."""
    from extract.config import parse_args
    from extract.pipeline import run_extraction

    cfg = parse_args(argv)
    summary = run_extraction(cfg)
    if summary.manifest is None:
        raise RuntimeError(f"{cfg.out}: the stage did not finalise")
    if summary.skipped.get("non_finite"):
        raise RuntimeError(f"{cfg.out}: {summary.skipped['non_finite']} samples skipped as non-finite; the stored "
                           f"samples are not the batches that were forwarded")
    log.info("%s", summary.line())
    return {"seconds": summary.seconds, "parts": dict(summary.parts), "samples": summary.samples,
            "tokens": summary.tokens, "bytes": summary.bytes_written, "line": summary.line()}


def forwarded_batches(out: Path, batch_tokens: int) -> list[list[list[int]]]:
    """The batches the stage forwarded: each shard's stored samples (input order) packed as the pipeline packs them."""
    from safetensors import safe_open

    from redraft.core.batching import pack_batches
    from redraft.core.dataset.format import load_manifest, read_shard_header

    batches = []
    for entry in load_manifest(out)["shards"]:
        path = out / entry["path"]
        hdr = read_shard_header(path)
        if not hdr.samples:
            continue
        with safe_open(str(path), framework="pt") as f:
            ids = f.get_tensor("input_ids").tolist()
        seqs = [ids[a:b] for a, b in zip(hdr.offsets[:-1], hdr.offsets[1:], strict=True)]
        batches += [[seqs[i] for i in b] for b in pack_batches([len(s) for s in seqs], batch_tokens)]
    return batches


class Bare:
    """The target's decoder stack alone, loaded as the stage's hf backend loads it."""

    def __init__(self, target: str, dtype: str) -> None:
        from extract.backends.hf import HFTarget
        from redraft.catalog.builtin import resolve_target

        self.hf = HFTarget(str(resolve_target(target)), name=target, dtype=dtype, device="cpu")
        self.pad = self.hf._pad_id()

    def seconds(self, batches: list[list[list[int]]]) -> float:
        """Wall time of one forward per batch, right-padded like the capture's, no hooks, no lm_head."""
        import torch

        start = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                width = max(len(s) for s in batch)
                ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, seq in enumerate(batch):
                    ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
                    mask[row, : len(seq)] = 1
                self.hf.text_model(input_ids=ids, attention_mask=mask, use_cache=False)
        return time.perf_counter() - start


def _spread(seconds: list[float]) -> dict[str, float]:
    """Median (the lower one of an even count: a run that happened), min and max."""
    return {"median": statistics.median_low(seconds), "min": min(seconds), "max": max(seconds)}


def _rate(tokens: int, seconds: list[float]) -> dict[str, float]:
    """Tokens/s of the median, slowest and fastest run (so the median rate is the median run's)."""
    s = _spread(seconds)
    return {"median": tokens / s["median"], "min": tokens / s["max"], "max": tokens / s["min"]}


def summarise(name: str, argv: list[str], stages: list[dict[str, Any]], bare: list[float],
              batches: list[list[list[int]]], pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """One measured configuration: stage and bare rates, the parts of the median stage run, the ratios."""
    tokens = stages[0]["tokens"]
    if any(s["tokens"] != tokens for s in stages):
        raise RuntimeError(f"{name}: the stage runs stored different token counts {[s['tokens'] for s in stages]}")
    if sum(len(s) for b in batches for s in b) != tokens:
        raise RuntimeError(f"{name}: the batches hold other tokens than the stage stored")
    secs = [s["seconds"] for s in stages]
    # The fixed costs a long run amortises: the model load or engine start, and closing the engines.
    no_load = [s["seconds"] - s["parts"].get("load", 0.0) - s["parts"].get("close", 0.0) for s in stages]
    median_run = secs.index(statistics.median_low(secs))
    parts = stages[median_run]["parts"]
    fwd = [s["parts"].get("capture", 0.0) + s["parts"].get("teacher", 0.0) for s in stages]

    paired = [bare[b] / secs[s] for s, b in pairs]
    paired_no_load = [bare[b] / no_load[s] for s, b in pairs]
    stage_rate, bare_rate = _rate(tokens, secs), _rate(tokens, bare)
    return {
        "name": name, "extract_argv": argv, "samples": stages[0]["samples"], "tokens": tokens,
        "batches": len(batches), "padded_tokens": sum(len(b) * max(len(s) for s in b) for b in batches),
        "stage": {"runs": stages, "tok_s": stage_rate, "seconds": _spread(secs),
                  "tok_s_without_load": _rate(tokens, no_load)},
        "bare": {"seconds_runs": bare, "tok_s": bare_rate, "seconds": _spread(bare)},
        "parts_of_median_run": parts,
        "shares_of_median_run": {k: v / sum(parts.values()) for k, v in parts.items()},
        "ratio": {
            "median": stage_rate["median"] / bare_rate["median"], "best": stage_rate["max"] / bare_rate["max"],
            "paired": paired, "paired_min": min(paired), "paired_max": max(paired),
        },
        "ratio_without_load": {
            "median": _rate(tokens, no_load)["median"] / bare_rate["median"],
            "paired": paired_no_load, "paired_min": min(paired_no_load), "paired_max": max(paired_no_load),
        },
        # capture forward + hooks + copies + teacher, against the bare forward: what the stage's own compute costs
        "ratio_capture_and_teacher": _rate(tokens, fwd)["median"] / bare_rate["median"],
    }


def measure(args: argparse.Namespace, bare: Bare, root: Path, name: str, samples: int, repeats: int,
            regen: str = "") -> dict[str, Any]:
    """Interleaved stage and bare runs of one configuration (a fresh output folder per stage run)."""
    stages: list[dict[str, Any]] = []
    bare_runs: list[float] = []
    pairs: list[tuple[int, int]] = []
    batches: list[list[list[int]]] | None = None
    argv: list[str] = []
    for rep in range(repeats):
        out = root / f"{name.replace(' ', '-')}-{rep}"
        argv = stage_argv(args, out, samples, regen)
        order = ("stage", "bare") if rep % 2 == 0 or batches is None else ("bare", "stage")
        for what in order:
            if what == "stage":
                stages.append(run_stage(argv))
                if batches is None:
                    batches = forwarded_batches(out, args.batch_tokens)
                if not args.keep:
                    shutil.rmtree(out)
            else:
                assert batches is not None
                bare_runs.append(bare.seconds(batches))
            log.info("%s, repeat %d/%d: %s %.2f s", name, rep + 1, repeats, what,
                     stages[-1]["seconds"] if what == "stage" else bare_runs[-1])
        pairs.append((len(stages) - 1, len(bare_runs) - 1))
    assert batches is not None
    return summarise(name, argv, stages, bare_runs, batches, pairs)


def storage(args: argparse.Namespace, root: Path, hidden_size: int, num_aux: int) -> dict[str, Any]:
    """Bytes per token of each storage variant, measured from the shards the stage writes, and from the layout."""
    from redraft.core.dataset.format import bytes_per_token

    sizes = {}
    for dtype in ("bf16", "fp8"):
        for kind in ("topk", "last_hidden"):
            out = root / f"size-{dtype}-{kind}"
            run = run_stage(stage_argv(args, out, args.sizes_samples,
                                       extra=["--hidden-dtype", dtype, "--teacher", kind]))
            shard_bytes = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
            sizes[f"{dtype}+{kind}"] = {
                "measured_bytes_per_token": shard_bytes / run["tokens"],
                "layout_bytes_per_token": bytes_per_token(hidden_size, num_aux, dtype, (kind,), args.topk),
                "kimi_k25_bytes_per_token": bytes_per_token(KIMI_HIDDEN, num_aux, dtype, (kind,), args.topk),
            }
            if not args.keep:
                shutil.rmtree(out)
    return sizes


def format_tables(report: dict[str, Any]) -> str:
    from extract.timing import ordered

    runs = report["runs"]
    m = report["machine"]
    lines = [f"Extraction stage on {report['target']} ({report['data']}), {report['dtype']}, "
             f"{report['threads']} torch thread(s); 1-min load {m['load_1min_at_start']:.1f} at the start and "
             f"{m['load_1min_at_end']:.1f} at the end on {m['cpus']} CPUs", ""]
    head = "| | " + " | ".join(r["name"] for r in runs) + " |"
    lines += [head, "|---|" + "---:|" * len(runs)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("samples / tokens / batches", [f"{r['samples']} / {r['tokens']:,} / {r['batches']}" for r in runs])
    row("stage runs", [str(len(r["stage"]["runs"])) for r in runs])
    row("stage tok/s, median (min-max)",
        [f"{r['stage']['tok_s']['median']:,.0f} ({r['stage']['tok_s']['min']:,.0f}-{r['stage']['tok_s']['max']:,.0f})"
         for r in runs])
    row("stage tok/s without load/close, median",
        [f"{r['stage']['tok_s_without_load']['median']:,.0f}" for r in runs])
    row("bare backbone tok/s, median (min-max)",
        [f"{r['bare']['tok_s']['median']:,.0f} ({r['bare']['tok_s']['min']:,.0f}-{r['bare']['tok_s']['max']:,.0f})"
         for r in runs])
    row("**stage / bare**, median (paired min-max)",
        [f"**{r['ratio']['median']:.2f}** ({r['ratio']['paired_min']:.2f}-{r['ratio']['paired_max']:.2f})"
         for r in runs])
    row("stage without load/close / bare, median (paired min-max)",
        [f"{r['ratio_without_load']['median']:.2f} ({r['ratio_without_load']['paired_min']:.2f}-"
         f"{r['ratio_without_load']['paired_max']:.2f})" for r in runs])
    row("capture + teacher / bare, median", [f"{r['ratio_capture_and_teacher']:.2f}" for r in runs])
    names = list(ordered({k: 0.0 for r in runs for k in r["parts_of_median_run"]}))
    lines += ["", "Parts of the median stage run, seconds (share of the stage's wall time):", "", head,
              "|---|" + "---:|" * len(runs)]
    for part in names:
        row(part, [f"{r['parts_of_median_run'][part]:.2f} ({100 * r['shares_of_median_run'][part]:.0f}%)"
                   if part in r["parts_of_median_run"] else "" for r in runs])
    row("**stage wall**", [f"**{r['stage']['seconds']['median']:.2f}**" for r in runs])
    row("bare forward (same batches)", [f"{r['bare']['seconds']['median']:.2f}" for r in runs])
    first = report["first_run_in_process"]
    lines += ["", f"First stage run in this process (imports, warm-up; not counted): {first['seconds']:.2f} s, "
                  f"of which load {first['parts'].get('load', 0.0):.2f} s."]
    if report.get("bytes_per_token"):
        lines += ["", "| storage | measured B/tok | layout B/tok | Kimi-K2.5 B/tok | vs SpecForge 8H |",
                  "|---|---:|---:|---:|---:|"]
        for name, s in report["bytes_per_token"].items():
            lines.append(f"| {name} | {s['measured_bytes_per_token']:,.0f} | {s['layout_bytes_per_token']:,.0f} | "
                         f"{s['kimi_k25_bytes_per_token']:,.0f} | "
                         f"{s['kimi_k25_bytes_per_token'] / SPECFORGE_BYTES_PER_TOKEN:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet = {name: logging.getLogger(name).level for name in ("extract", "redraft", "httpx")}
    for name in quiet:  # the stage's own progress lines; its summary line is kept
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return _run(args, list(sys.argv[1:] if argv is None else argv))
    finally:  # an in-process caller (a test) gets its loggers back as they were
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # engine subprocesses inherit it
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    regens = [r for r in args.regenerate.split(",") if r]
    load_start = os.getloadavg()[0]
    bare = Bare(args.target, args.dtype)
    info = bare.hf.info
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        first = run_stage(stage_argv(args, root / "first", args.samples))  # imports, allocator: not counted
        shutil.rmtree(root / "first")
        runs = [measure(args, bare, root, "no regeneration", args.samples, args.repeats)]
        for regen in regens:
            runs.append(measure(args, bare, root, f"regenerate {regen}", args.regen_samples, args.regen_repeats,
                                regen))
        sizes = storage(args, root, info.hidden_size, len(info.aux_layer_ids)) if args.sizes_samples else {}
    report = {
        "command": "python benchmarks/extract_throughput.py " + " ".join(shlex.quote(a) for a in
                                                                         argv),
        "target": args.target, "data": args.data, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "goal_ratio_without_regeneration": GOAL,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_1min_at_start": load_start,
                    "load_1min_at_end": os.getloadavg()[0], "torch": torch.__version__},
        "first_run_in_process": {"seconds": first["seconds"], "parts": first["parts"]},
        "runs": runs, "bytes_per_token": sizes, "specforge_kimi_bytes_per_token": SPECFORGE_BYTES_PER_TOKEN,
    }
    tables = format_tables(report)
    print()
    print(tables)
    r0 = runs[0]
    print(f"\nwhole stage / bare backbone forward without regeneration: {r0['ratio']['median']:.2f} "
          f"(goal >= {GOAL}); without the model load and close {r0['ratio_without_load']['median']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(f"```bash\n{report['command']}\n```\n\n{tables}\n")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.extract_throughput")))
