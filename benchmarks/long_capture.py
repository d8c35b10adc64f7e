"""One long sample of kimi-k25-mini captured through each backend, every engine's capture against HF's (a benchmark).

    python benchmarks/long_capture.py --out docs/results/long-capture --tokens 32768 --backends hf,vllm,sglang

What it measures: one chat of at least ``--tokens`` tokens (chitchat transcripts joined end to end into one user
turn, ``redraft/catalog/long_chats.py``, and a short assistant reply: one chitchat turn not in the prompt), written as a
one-record JSONL file, read, tokenized and captured the way ``extract.pipeline`` does it (``read_records``,
``tokenize_conversation`` at ``max_length`` = the sample's length, ``load_backend`` of a validated
``ExtractConfig`` with ``dtype: float32``, the backend's ``capture_batches``), but kept in fp32 in memory instead of
being stored (the store's bf16 would hide a 1e-5 difference). Against the ``hf`` backend's capture of the same ids
(in chunks of ``capture_chunk_tokens`` through the KV cache): per aux layer, per token ||engine - hf|| / ||hf||,
median and max; the teacher's top-1 agreement and top-k log-probability gap; each backend's seconds (the engine's
start apart), tokens/s and peak memory (this case's process's RSS, and the PSS of it and every process it
started, the engine's, sampled). The goal (issue): median <= 1e-5 per layer and top-1 >= 99.9% at 32,768 tokens
or more. ``--tokens 16384,32768``: each length its own rows.

Each backend and length runs in a child process of its own (a fresh process's peak RSS is that case's), bounded by
``--timeout``; a case that fails, is killed or runs out of time is a row of its own with its error line (the
kernel's out-of-memory line where dmesg shows one: an engine whose worker was killed only says it went away, and
then where that engine's prefill memory grows as T squared), and the longer lengths of that backend are then not
tried.

Whose code: ``hf`` is transformers' DeepSeek-V3 model code; ``vllm`` is vLLM 0.32's own engine on the CPU (its
CPU MLA backend, its ``extract_hidden_states`` capture; vLLM prefills an MLA target whole on a CPU without AMX),
in the vLLM CPU venv, with redraft's capture connector writing its files and the teacher computed here from the
end layer's state; ``sglang`` is SGLang 0.5.23's engine (scheduler, model code, aux capture, input top-k
log-probabilities), in the SGLang CPU venv, with redraft's plain-PyTorch stand-in for its compiled CPU kernels
(``redraft/engines/sglang_cpu``) and chunked prefill off, so its speed is the stand-in's, not SGLang's kernels'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reporting import publish

from redraft.core import cli as ending

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.long_capture")
TARGET = "kimi-k25-mini"
BACKENDS = ("hf", "vllm", "sglang")
GOAL = {"median_rel": 1e-5, "top1": 0.999, "tokens": 32768}
# Where an engine's prefill memory grows as T squared on this CPU: said beside a case the kernel killed for memory.
DENSE_PREFILL = {
    "vllm": "vLLM prefills an MLA target whole on a CPU without AMX (vllm/platforms/cpu.py:516-530: chunked "
            "prefill off, max_num_batched_tokens = max_model_len), and its CPU MLA prefill is dense attention per "
            "request (vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py:65-79): fp32 scores and probabilities of "
            "[heads, T, T] and a [T, T] mask",
    "sglang": "SGLang capture prefills the sample in one pass (chunked prefill off), and redraft's stand-in for the "
              "intel_amx extend kernel passes a [T, T] mask (redraft/engines/sglang_cpu/ops/attention.py:119) to "
              "torch's scaled_dot_product_attention (:45) with MLA's q/k head dim 192 and v head dim 128, which "
              "torch's CPU kernels run on the math path: [heads, T, T] fp32 scores and probabilities (the stand-in's "
              "memory; SGLang's compiled CPU kernel is not measured here)",
}
KV_MARGIN = 256  # SGLang's KV pool beyond the sample: it refuses a prompt within a few tokens of the pool's size


# ----------------------------------------------------------------------------------------------- the sample


def long_record(tokenizer: Any, tokens: int) -> tuple[dict[str, Any], int]:
    """A one-turn chat of at least ``tokens`` tokens as the target's template renders it, and its length. Grown
    from below until it is long enough, at the chars per token measured so far (near 3.7 on chitchat)."""
    from extract.chat import tokenize_conversation
    from extract.records import Message
    from redraft.catalog.builtin import chitchat_records
    from redraft.catalog.long_chats import long_chats, transcripts

    records = chitchat_records()
    texts = transcripts(records)
    first = len(texts) // 2  # the half the demo drafter never trained on, as chitchat-long takes
    reply = str(records[first - 1]["conversations"][1]["value"]).strip()  # a chitchat turn not in the prompt
    chars = tokens * 3
    while True:
        row = long_chats(1, first, texts, chars // 2)[0]  # one chat: (0 + 0.5) * max_prompt_tokens * 4 chars
        row["id"], row["conversations"][1]["value"] = f"long-capture-{tokens}", reply
        msgs = [Message("user", row["conversations"][0]["value"]), Message("assistant", reply)]
        n = len(tokenize_conversation(tokenizer, msgs, 1 << 30).input_ids)
        if n >= tokens:
            return row, n
        chars += (tokens - n) * chars // n + 8


def write_sample(tokenizer: Any, tokens: int, folder: Path) -> tuple[Path, int]:
    """The long chat as a one-record JSONL data file, and its length in tokens."""
    row, n = long_record(tokenizer, tokens)
    path = folder / f"long-{tokens}.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    return path, n


# ----------------------------------------------------------------------------------------------- one case (child)


def extract_config(backend: str, data: Path, max_length: int, work: Path) -> Any:
    """The ExtractConfig run_extraction would get for this capture: fp32, the sample whole (max_length = its
    length); SGLang's KV pool sized to hold it (the CPU stand-in's default pool is 16,384 tokens)."""
    from extract.config import ExtractConfig

    engine_args = {"max_total_tokens": max_length + KV_MARGIN} if backend == "sglang" else {}
    return ExtractConfig(target=TARGET, data=[str(data)], out=str(work / f"unused-{backend}"), backend=backend,
                         dtype="float32", max_length=max_length, batch_tokens=max_length, engine_args=engine_args,
                         capture_dir=str(work / f"files-{backend}") if backend != "hf" else "",
                         rank=0, world_size=1).validate()


def run_case(backend: str, data: Path, max_length: int, save: Path, work: Path) -> dict[str, Any]:
    """Capture the sample as the pipeline would, save the features (fp32) to ``save``; seconds, RSS, facts."""
    from safetensors.torch import save_file

    from extract.backends.base import TeacherSpec
    from extract.chat import tokenize_conversation
    from extract.pipeline import load_backend
    from extract.records import read_records
    from redraft.catalog.builtin import resolve_target

    cfg = extract_config(backend, data, max_length, work)
    record = read_records([data], require_assistant=True, strict=True).records[0]
    t0 = time.perf_counter()
    target = load_backend(cfg, resolve_target(cfg.target))
    load_s = time.perf_counter() - t0
    try:
        ids = tokenize_conversation(target.tokenizer, record.messages, cfg.max_length).input_ids
        teacher = TeacherSpec(kinds=tuple(cfg.teacher), topk=cfg.topk, chunk_tokens=cfg.chunk_tokens)
        t0 = time.perf_counter()
        stream = target.capture_batches([[ids]], teacher)
        cap = next(stream)[0]
        stream.close()
        seconds = time.perf_counter() - t0
        info = target.info
    finally:
        target.close()
    save_file({"aux_hidden": cap.aux_hidden.contiguous(), "topk_ids": cap.topk_ids.contiguous(),
               "topk_logprobs": cap.topk_logprobs.contiguous()}, str(save))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux
    return {"positions": len(ids), "load_s": load_s, "seconds": seconds, "tokens_per_s": len(ids) / seconds,
            "peak_rss_gib": peak, "hidden_size": info.hidden_size, "aux_layer_ids": list(info.aux_layer_ids),
            "architecture": info.architecture, "engine_args": cfg.engine_args, "topk": cfg.topk,
            "capture_chunk_tokens": cfg.capture_chunk_tokens if backend == "hf" else None}


# ----------------------------------------------------------------------------------------------- the parent


def error_line(text: str) -> str:
    """The line of a child's log that says why it failed: the last exception line, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(w in ln for w in ("Error", "Exception", "error:", "Killed", "refused", "exceeds", "longer than")):
            return ln[:500]
    return lines[-1][:500] if lines else "(no output)"


def process_tree(root: int) -> list[int]:
    """Process ``root`` and all its descendants (the engine's driver starts a session of its own, so the tree is
    followed by parent ids)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # ppid
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    tree = []
    for pid in parent:
        p = pid
        while p not in (root, 0, 1) and p in parent:
            p = parent[p]
        if p == root:
            tree.append(pid)
    return tree


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size summed over ``pids``: pages shared between the engine's processes counted once."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


def uptime() -> float:
    """Seconds since boot: the clock of the kernel's log."""
    return float(Path("/proc/uptime").read_text().split()[0])


def oom_kills(since: float) -> list[str]:
    """The kernel's out-of-memory kills logged since ``since`` (seconds since boot), where dmesg can be read: an
    engine whose worker the kernel killed reports only that its worker went away."""
    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = (re.match(r"\[\s*([\d.]+)\]\s+(Out of memory: Killed process .*)", ln) for ln in text.splitlines())
    return [m.group(2)[:300] for m in found if m and float(m.group(1)) >= since - 1]


def spawn_case(backend: str, data: Path, length: int, work: Path, timeout: float) -> dict[str, Any]:
    """One case in a child process of its own session, its log kept in ``work`` and the memory of its process tree
    (the engine's processes too, PSS) sampled every 0.5 s; a failure comes back as {error, rc, log, log_tail}."""
    save, logfile, outfile = (work / f"{backend}-{length}.{ext}" for ext in ("safetensors", "log", "out"))
    cmd = [sys.executable, __file__, "--case", backend, "--data", str(data), "--max-length", str(length),
           "--save", str(save), "--work", str(work)]
    log.info("%s at %d tokens: %s (log %s)", backend, length, " ".join(cmd), logfile)
    t0, since, peak, rc = time.perf_counter(), uptime(), 0, None
    with open(logfile, "w") as err, open(outfile, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        while (rc := proc.poll()) is None and time.perf_counter() - t0 < timeout:
            peak = max(peak, pss_bytes(process_tree(proc.pid)))
            time.sleep(0.5)
        if rc is None:
            for pid in process_tree(proc.pid):  # the engine's processes too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            proc.wait()
    wall = time.perf_counter() - t0
    text = logfile.read_text(errors="replace").replace(f"{ROOT}/", "")  # the report names files of the repository
    if rc == 0:
        got = json.loads(outfile.read_text().strip().splitlines()[-1])
        return {**got, "tree_peak_pss_gib": peak / (1 << 30), "save": str(save), "wall_s": wall, "log": str(logfile)}
    kills = oom_kills(since)
    why = (kills[-1] if kills else f"timed out after {timeout:.0f} s (killed)" if rc is None
           else f"killed by signal {-rc}" if rc < 0 else error_line(text))
    return {"error": why, "out_of_memory": bool(kills), "engine_error": error_line(text), "rc": rc, "wall_s": wall,
            "tree_peak_pss_gib": peak / (1 << 30), "log": str(logfile), "log_tail": text.splitlines()[-40:]}


def compare(hf: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """The engine's saved capture against HF's, per aux layer and teacher (benchmarks.capture_speed's rule)."""
    from capture_speed import _row_rel, compare_captures
    from safetensors.torch import load_file

    from extract.backends.base import Captured

    a, b = (Captured(**load_file(x["save"])) for x in (hf, engine))
    out = compare_captures([a], [b], hf["hidden_size"], len(hf["aux_layer_ids"]))
    h = hf["hidden_size"]
    for k, layer in enumerate(out["layers"]):  # is a large max one position or many (an MoE near-tie or a drift)
        rel = _row_rel(a.aux_hidden[:, k * h:(k + 1) * h], b.aux_hidden[:, k * h:(k + 1) * h])
        layer.update(worst_position=int(rel.argmax()), over_1e_4=int((rel > 1e-4).sum()))
    return out


def measure(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Every backend at every length, HF first at each (the reference); a backend that failed is not tried
    longer."""
    from transformers import AutoTokenizer

    from redraft.catalog.builtin import resolve_target

    tok = AutoTokenizer.from_pretrained(str(resolve_target(TARGET)), local_files_only=True)
    rows: list[dict[str, Any]] = []
    failed: dict[str, int] = {}
    for tokens in args.tokens:
        data, length = write_sample(tok, tokens, work)
        ref: dict[str, Any] | None = None
        for backend in args.backends:
            row: dict[str, Any] = {"backend": backend, "asked_tokens": tokens, "sample_tokens": length}
            if backend in failed:
                rows.append({**row, "error": f"not run: failed at {failed[backend]:,} tokens"})
                continue
            got = spawn_case(backend, data, length, work, args.timeout)
            row.update(got)
            if "error" in got:
                failed[backend] = tokens
            elif backend == "hf":
                ref = got
            elif ref is not None:
                row["equality"] = compare(ref, got)
            rows.append(row)
            log.info("%s at %d: %s", backend, tokens, got.get("error") or f"{got['seconds']:.0f} s")
    return rows


def dense_gib(heads: int, tokens: int) -> float:
    """One fp32 [heads, T, T] tensor: what a dense attention prefill holds per copy."""
    return heads * tokens * tokens * 4 / (1 << 30)


def format_table(report: dict[str, Any]) -> str:
    g = report["goal"]
    lines = [f"`{report['command']}`", "",
             f"{TARGET} (DeepSeek-V3 MLA + MoE + YaRN, 4 layers, hidden 256), fp32, one chat of chitchat transcripts "
             "joined into one user turn plus a short reply, captured as extract.pipeline does (fp32 kept in "
             "memory). Each engine against the hf backend's capture of the same ids: per aux layer, per token "
             "||engine - hf|| / ||hf||, median / max over positions; teacher top-1 equal. Goal: median <= "
             f"{g['median_rel']:.0e} per layer, top-1 >= {g['top1']:.1%}, at >= {g['tokens']:,} tokens. "
             f"{report['cpus']} CPUs ({report['processor']}), {report['date']}.", "",
             "| backend | tokens | aux layers: median / max | top-1 equal | top-k log-prob gap med / max | seconds "
             "| tokens/s | engine start s | peak GiB: case RSS / with engine PSS |",
             "|---|---:|---|---:|---|---:|---:|---:|---|"]
    notes: list[str] = []
    for r in report["rows"]:
        head = f"| {r['backend']} | {r['sample_tokens']:,} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'].replace('|', '/')} | | | | | | |")
            if r.get("out_of_memory"):
                notes.append(f"- {r['backend']} at {r['sample_tokens']:,}: {DENSE_PREFILL[r['backend']]}; one "
                             f"[heads, T, T] fp32 copy is {dense_gib(report['heads'], r['sample_tokens']):.1f} GiB "
                             f"here. The engine's own last error: `{r['engine_error']}`")
            continue
        e = r.get("equality")
        per = "reference" if e is None else "; ".join(
            f"{i}: {x['median']:.1e} / {x['max']:.1e}" for i, x in zip(r["aux_layer_ids"], e["layers"], strict=True))
        top1 = "" if e is None else f"{e['top1_equal']:.4%}"
        gap = "" if e is None else f"{e['topk_logprob_gap']['median']:.1e} / {e['topk_logprob_gap']['max']:.1e}"
        lines.append(f"{head} {per} | {top1} | {gap} | {r['seconds']:.0f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['load_s']:.0f} | {r['peak_rss_gib']:.2f} / {r['tree_peak_pss_gib']:.2f} |")
    if notes:
        lines += ["", f"Out of memory ({report['memory_gib']:.0f} GiB host, shared with other work), where the "
                  "memory goes:", "", *notes]
    lines += ["", "Seconds: the capture of the sample (the engine's prefill and file, the teacher), the engine's "
              "start apart. Peak: the case's own process's RSS (getrusage), and the proportional set size summed "
              "over it and every process it started (the engine's), sampled every 0.5 s."]
    compared = [r for r in report["rows"] if r.get("equality")]
    if compared:
        lines += ["", "Positions past 1e-4 per aux layer (and the position of the max):", ""]
    for r in compared:
        lines.append(f"- {r['backend']} at {r['sample_tokens']:,}: " + "; ".join(
            f"layer {i}: {x['over_1e_4']} (max at {x['worst_position']:,})"
            for i, x in zip(r["aux_layer_ids"], r["equality"]["layers"], strict=True)))
    return "\n".join(lines) + "\n"


def target_heads() -> int:
    """The target's attention heads (from its config.json)."""
    from redraft.catalog.builtin import resolve_target

    return int(json.loads((resolve_target(TARGET) / "config.json").read_text())["num_attention_heads"])


def cpu_model() -> str:
    """The CPU's model name (platform.processor() is empty on Linux)."""
    for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="write long-capture.json and long-capture.md here")
    p.add_argument("--tokens", default=str(GOAL["tokens"]),
                   help="the sample's least length in tokens; comma-separated for several, each its own rows")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: hf (the reference), vllm, sglang")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one backend's case may take, start included")
    p.add_argument("--work", default="", help="keep the samples, captures and logs here (default: a temporary folder)")
    p.add_argument("--case", default="", help=argparse.SUPPRESS)  # the child: one backend on one sample
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--max-length", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--save", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tokens = sorted(int(t) for t in str(args.tokens).split(",") if t.strip())
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad:
        p.error(f"--backends: unknown {bad}; expected some of {list(BACKENDS)}")
    args.backends = sorted(set(args.backends), key=BACKENDS.index)  # hf first: the engines' reference
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.case:
        got = run_case(args.case, Path(args.data), args.max_length, Path(args.save), Path(args.work))
        print(json.dumps(got))
        return 0
    with tempfile.TemporaryDirectory(prefix="redraft-long-capture-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [{k: v for k, v in r.items() if k != "save"} for r in measure(args, work)]
    report = {"command": " ".join(["python benchmarks/long_capture.py", *(argv or sys.argv[1:])]),
              "target": TARGET, "goal": GOAL, "host": platform.node(), "cpus": os.cpu_count(),
              "processor": cpu_model(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "date": time.strftime("%Y-%m-%d"), "heads": target_heads(),
              "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), "rows": rows}
    publish(report, format_table(report), args.out, "long-capture")
    return 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.long_capture")))
