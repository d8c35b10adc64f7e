"""Are the stored assistant tokens the ids the target generated? (a measurement, not a test)

Runs the extraction stage with regeneration, records every (prompt ids, generated ids) pair the
backend returns, then reads the written dataset back through the store's reader and compares,
for each generated turn, the masked run of tokens that starts right after its prompt with the
generated ids (stop token included when the target wrote one). It counts:

  * mismatched: the stored run is not exactly the generated ids (any difference);
  * ids_differ: the run differs in the reply's own ids (decode -> re-encode drift);
  * eot_added: a reply cut at --max-new-tokens is stored with an end-of-turn the target never wrote;
  * not_found: no stored sample starts with the turn's prompt (the reply is not trained on as generated);
  * cut: replies that hit --max-new-tokens.

`--code DIR` runs the extraction code of another checkout (e.g. an export of main) with this
same script, so before and after are measured the same way:

    git archive 7d2ee4a | tar -x -C /tmp/redraft-main
    OMP_NUM_THREADS=1 python benchmarks/regen_exactness.py --code /tmp/redraft-main --out runs/exact-main \\
        --json exact-main.json
    OMP_NUM_THREADS=1 python benchmarks/regen_exactness.py --out runs/exact-branch --json exact-branch.json

`--regen-backend vllm|server` measures the other regeneration engines the same way (`--regen-url`
for a running server).

Defaults: the embedded target, the 80 MT-bench first turns, greedy, 128 new tokens, the hf engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redraft.core import cli as ending

log = logging.getLogger("bench.exactness")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                   help="checkout whose extract package runs (default: this one)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target model (built-in name or folder)")
    p.add_argument("--data", default="mtbench", help="prompts (built-in name or file)")
    p.add_argument("--out", required=True, help="dataset folder to write (a new one per run)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="regeneration budget per turn")
    p.add_argument("--max-user-turns", type=int, default=1, help="answer only the first N user turns (0: all)")
    p.add_argument("--max-samples", type=int, default=0, help="first N records only (0: all)")
    p.add_argument("--teacher", default="topk", help="teacher kinds, as extract's --teacher")
    p.add_argument("--regen-backend", default="hf", choices=("hf", "vllm", "server"),
                   help="regeneration engine, as extract's --regen-backend")
    p.add_argument("--regen-url", default="", help="server URL for --regen-backend server")
    p.add_argument("--json", default=None, help="write the counts here")
    p.add_argument("--show", type=int, default=3, help="print this many mismatched turns in full")
    return p.parse_args(argv)


def recording_loader(load: Callable[..., Any], calls: list[tuple[list[int], list[int]]]) -> Callable[..., Any]:
    """Wrap extract.pipeline.load_backend so the loaded backend's generate appends (prompt, output) pairs
    to `calls`; the backend itself runs unchanged."""

    def load_and_record(cfg: Any, path: Any) -> Any:
        backend = load(cfg, path)
        generate = backend.generate

        def record(prompts, gen, stop_ids):
            outputs = generate(prompts, gen, stop_ids)
            calls.extend((list(p), list(o)) for p, o in zip(prompts, outputs, strict=True))
            return outputs

        backend.generate = record
        return backend

    return load_and_record


def recording_regenerators(make: Callable[..., Any], calls: list[tuple[list[int], list[int]]]) -> Callable[..., Any]:
    """Wrap extract.pipeline.make_regenerator so every regenerator (hf, vllm, server) appends the (prompt, output)
    pairs its engine returned to `calls`; the regenerator itself runs unchanged."""

    def make_and_record(cfg: Any, backend: Any, path: Any) -> Any:
        regen = make(cfg, backend, path)
        generate = regen.generate

        def record(prompts, budgets, gen, stops):
            outputs = generate(prompts, budgets, gen, stops)
            calls.extend((list(p), list(o)) for p, o in zip(prompts, outputs, strict=True))
            return outputs

        regen.generate = record
        return regen

    return make_and_record


def _masked_run(ids: list[int], mask: list[bool], start: int) -> list[int]:
    end = start
    while end < len(ids) and mask[end]:
        end += 1
    return ids[start:end]


def compare(samples: list[tuple[str, list[int], list[bool]]], generated: list[tuple[list[int], list[int]]],
            stops: set[int]) -> dict[str, Any]:
    """Counts of generated turns stored as generated, over every (prompt, output) the backend returned."""
    counts = {"generated_turns": len(generated), "stored_samples": len(samples), "exact": 0, "mismatched": 0,
              "ids_differ": 0, "eot_added": 0, "not_found": 0, "cut": 0}
    examples: list[dict[str, Any]] = []
    for prompt, output in generated:
        cut = not output or output[-1] not in stops
        counts["cut"] += cut
        hits = [(sid, ids, mask) for sid, ids, mask in samples if ids[: len(prompt)] == prompt]
        if not hits:
            counts["not_found"] += 1
            continue
        sid, ids, mask = hits[0]
        run = _masked_run(ids, mask, len(prompt))
        if run == output:
            counts["exact"] += 1
            continue
        counts["mismatched"] += 1
        body = run
        if cut and run and run[-1] in stops:
            counts["eot_added"] += 1
            body = run[:-1]
        if body != output:
            counts["ids_differ"] += 1
        if len(examples) < 20:
            first = next((i for i, (a, b) in enumerate(zip(run, output, strict=False)) if a != b), min(len(run), len(output)))
            examples.append({"sample": sid, "first_difference_at": first, "stored": run, "generated": output})
    counts["examples"] = examples
    return counts


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    code = Path(args.code).resolve()
    if code != Path(__file__).resolve().parents[1] and os.environ.get("REDRAFT_BENCH_CODE") != str(code):
        # another checkout's extraction: this script again, with that checkout first on the path
        paths = [str(code), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "REDRAFT_BENCH_CODE": str(code)}
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()),
                                   *(sys.argv[1:] if argv is None else argv)], env)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import extract
    import extract.pipeline as pipeline
    from extract.chat import stop_token_ids
    from extract.config import parse_args
    from redraft.core.dataset.reader import DatasetReader

    log.info("extraction code: %s", Path(extract.__file__).parent)
    recorded: list[tuple[list[int], list[int]]] = []
    cli = ["--target", args.target, "--data", args.data, "--out", args.out, "--regenerate",
           "--max-user-turns", str(args.max_user_turns), "--max-new-tokens", str(args.max_new_tokens),
           "--teacher", args.teacher, "--rank", "0", "--world-size", "1"]
    if hasattr(pipeline, "make_regenerator"):  # this checkout: record whichever engine regenerates
        pipeline.make_regenerator = recording_regenerators(pipeline.make_regenerator, recorded)
        cli += ["--regen-backend", args.regen_backend]
        if args.regen_url:
            cli += ["--regen-url", args.regen_url]
    elif args.regen_backend != "hf":
        raise SystemExit(f"{args.code}: that checkout has no --regen-backend")
    else:  # older checkouts: the backend's generate is the only engine
        pipeline.load_backend = recording_loader(pipeline.load_backend, recorded)
    if args.max_samples:
        cli += ["--max-samples", str(args.max_samples)]
    start = time.perf_counter()
    summary = pipeline.run_extraction(parse_args(cli))
    seconds = time.perf_counter() - start
    log.info("%s", summary.line())

    reader = DatasetReader(args.out)
    stops = set(stop_token_ids(reader_tokenizer(args.out)))
    samples = []
    for i in range(len(reader)):
        s = reader.get(i)
        samples.append((reader.sample_ids[i], s.input_ids.tolist(), s.loss_mask.bool().tolist()))
    counts = compare(samples, recorded, stops)
    manifest = json.loads((Path(args.out) / "manifest.json").read_text())
    result = {"code": str(Path(extract.__file__).parent.parent), "regen_backend": args.regen_backend,
              "target": args.target, "data": args.data,
              "max_new_tokens": args.max_new_tokens, "max_user_turns": args.max_user_turns,
              "seconds": round(seconds, 1), "manifest_regeneration": manifest.get("regeneration"), **counts}

    print()
    print("| generated turns | stored as generated | mismatched | of which ids differ | eot added to a cut reply "
          "| prompt not found | cut at limit |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {counts['generated_turns']} | {counts['exact']} | {counts['mismatched']} | {counts['ids_differ']} "
          f"| {counts['eot_added']} | {counts['not_found']} | {counts['cut']} |")
    print(f"manifest regeneration: {manifest.get('regeneration')}")
    for ex in counts["examples"][: args.show]:
        print(f"  {ex['sample']}: first difference at reply token {ex['first_difference_at']}; "
              f"stored tail {ex['stored'][-4:]}, generated tail {ex['generated'][-4:]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def reader_tokenizer(out: str) -> Any:
    """The target's tokenizer, from the path the manifest records (no model load)."""
    from transformers import AutoTokenizer

    manifest = json.loads((Path(out) / "manifest.json").read_text())
    return AutoTokenizer.from_pretrained(manifest["target"]["path"], local_files_only=True)


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.regen_exactness")))
