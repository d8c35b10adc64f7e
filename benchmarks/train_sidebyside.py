"""Training steps side by side on one case (same weights, same inputs): redraft vs SpecForge, or vs another checkout.

Used by ``benchmarks/train_throughput.py --specforge PY`` and ``--code DIR``; not run on its own.
A case (one drafter shape at one sequence length) is written once: random drafter weights as a
redraft drafter folder and in SpecForge's layout, and the raw inputs (ids, fp32 aux features,
the target embedding, loss mask, the teacher as top-k ids/log-probs with distinct ids per row).
Each side then runs in its own fresh process, ``warmup`` untimed steps followed by ``repeats``
timed steps (forward, backward, clip at 0.5, AdamW at the same thread count), and the sides
alternate in rounds (A B, then B A, ...) so that the machine's load reaches both. Memory per side:
VmRSS after its set-up and VmHWM over its steps (reset once set-up is done), so neither side's
loading counts; a side whose RSS passes ``mem_limit`` is stopped and reported as not fitting.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from redraft.core import cli as ending

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the case


def write_case(case: Path, shape_json: str, seed: int = 0) -> None:
    """Drafter folders (redraft's and SpecForge's layout) and inputs.safetensors for one shape."""
    from safetensors.torch import save_file
    from train_case import Shape, _drafter_and_batch, drafter_config

    from redraft.core.drafter.folder import write_drafter_folder

    s = Shape(**json.loads(shape_json))
    model, batch = _drafter_and_batch(s, seed)
    drafter = model.drafter
    case.mkdir(parents=True, exist_ok=True)
    ours = case / "ours-ckpt"
    ours.mkdir(exist_ok=True)
    write_drafter_folder(ours, drafter_config(s), drafter.serving_state_dict(), {"format": "redraft-benchmark"})
    theirs = case / "specforge-ckpt"
    theirs.mkdir(exist_ok=True)
    try:
        os.link(ours / "model.safetensors", theirs / "model.safetensors")
    except OSError:
        shutil.copy(ours / "model.safetensors", theirs / "model.safetensors")
    config = json.loads((ours / "config.json").read_text())
    config.pop("norm_output", None)  # SpecForge reads this switch otherwise (see conformance/check_specforge.py)
    (theirs / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed + 7)
    topk_ids = _distinct_topk(drafter.t2d, batch.input_ids.shape, s.topk, g)
    save_file({
        "input_ids": batch.input_ids.contiguous(),
        "aux_hidden_states": batch.aux_hidden.float().contiguous(),
        "embed_weight": drafter.embed_tokens.weight.detach().float().contiguous(),
        "loss_mask": batch.loss_mask.contiguous(),
        "attention_mask": batch.attention_mask.contiguous(),
        "topk_ids": topk_ids,
        "topk_logprobs": batch.topk_logprobs.float().contiguous(),  # sorted, a log_softmax over the k entries
    }, str(case / "inputs.safetensors"))
    (case / "shape.json").write_text(json.dumps(asdict(s)))


def _distinct_topk(t2d: torch.Tensor, bt: tuple[int, int], k: int, g: torch.Generator) -> torch.Tensor:
    """int64 [B, T, k] distinct ids per row, ~90% of them draft tokens, in random order.

    Distinct, so that the top-k and the dense full-vocab teacher SpecForge gets are one distribution.
    """
    draft, other = torch.nonzero(t2d).squeeze(-1), torch.nonzero(~t2d).squeeze(-1)
    k_other = min(max(k // 10, 1), other.numel()) if other.numel() else 0
    rows = bt[0] * bt[1]
    picks = [draft[torch.rand(rows, draft.numel(), generator=g).topk(k - k_other, dim=-1).indices]]
    if k_other:
        picks.append(other[torch.rand(rows, other.numel(), generator=g).topk(k_other, dim=-1).indices])
    ids = torch.cat(picks, dim=-1)
    order = torch.rand(rows, k, generator=g).argsort(-1)
    return ids.gather(-1, order).view(*bt, k).contiguous()


# ----------------------------------------------------------------------------- redraft's side


def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def ours_worker(case: Path, threads: int, warmup: int, repeats: int) -> dict[str, Any]:
    """redraft's training step on the case, exactly as train/main.py runs a micro-batch; under another
    checkout's core/ and train/ when PYTHONPATH names it (the helpers here only call TTTModel and Batch)."""
    import resource

    from safetensors.torch import load_file
    from train_case import (  # this checkout's, from the script's folder
        Shape,
        _train_step,
        drafter_config,
    )

    import train.ttt  # another checkout's when its side was started with PYTHONPATH=DIR (side_commands)
    from redraft.core.dataset.batch import Batch
    from redraft.core.drafter.modeling import Eagle3Drafter
    from train.ttt import TTTModel

    torch.set_num_threads(threads)
    s = Shape(**json.loads((case / "shape.json").read_text()))
    x = load_file(str(case / "inputs.safetensors"))
    drafter = Eagle3Drafter(drafter_config(s))
    drafter.load_serving_state_dict(load_file(str(case / "ours-ckpt" / "model.safetensors")))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(x["embed_weight"])
    model = TTTModel(drafter, steps=s.ttt_steps, decay=0.8)
    bsz = x["input_ids"].shape[0]
    batch = Batch(input_ids=x["input_ids"], attention_mask=x["attention_mask"], loss_mask=x["loss_mask"],
                  aux_hidden=x["aux_hidden_states"], topk_ids=x["topk_ids"], topk_logprobs=x["topk_logprobs"],
                  last_hidden=None, sample_ids=[f"s{i}" for i in range(bsz)])
    del x
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rss_before = _status_kb("VmRSS") * 1024
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak below is the steps' own
    losses, step_times, cpu_times = [], [], []
    for i in range(warmup + repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(float(_train_step(model, optimizer, batch).loss))
        if i >= warmup:
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    return {"side": "redraft", "code": str(Path(train.ttt.__file__).parents[1]), "step_times": step_times, "cpu_times": cpu_times,
            "losses": losses, "rss_before": rss_before, "step_peak": _status_kb("VmHWM") * 1024,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# ----------------------------------------------------------------------------- running the sides


def _proc_rss(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_watched(cmd: list[str], env: dict[str, str], mem_limit: int | None) -> dict[str, Any]:
    """Run a side's process; its last stdout line is its JSON. Stopped (and reported) past ``mem_limit`` bytes."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=ROOT)
        seen = 0
        try:
            while proc.poll() is None:
                rss = _proc_rss(proc.pid)
                seen = max(seen, rss)
                if mem_limit is not None and rss > mem_limit:
                    proc.kill()
                    proc.wait()
                    return {"killed": True, "rss_seen": seen, "mem_limit": mem_limit,
                            "wall_s": time.perf_counter() - t0}
                time.sleep(0.2)
        finally:
            if proc.poll() is None:  # interrupted: do not leave the side running
                proc.kill()
                proc.wait()
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{errors[-4000:]}")
    return {**json.loads(text.strip().splitlines()[-1]), "rss_seen": seen}


def side_commands(case: Path, sides: list[dict[str, Any]], threads: int, warmup: int, repeats: int,
                  ) -> list[list[str]]:
    """Each side's command line: {"kind": "redraft", "code": DIR|None} or {"kind": "specforge", "python"}."""
    cmds = []
    for side in sides:
        common = ["--threads", str(threads), "--warmup", str(warmup), "--repeats", str(repeats)]
        if side["kind"] == "specforge":
            # SpecForge's venv has no redraft installed: the step imports conformance/ from the repository
            cmds.append(["env", f"PYTHONPATH={ROOT}", side["python"], str(HERE / "specforge_train_step.py"), str(case),
                         *common])
        else:
            # another checkout's code goes first on the child's path: ahead of this one's installed packages
            code = ["env", f"PYTHONPATH={Path(side['code']).resolve()}"] if side.get("code") else []
            cmds.append([*code, sys.executable, str(Path(__file__)), "--_ours", str(case), *common])
    return cmds


def compare(shape_json: str, sides: list[dict[str, Any]], *, threads: int, rounds: int, warmup: int, repeats: int,
            mem_limit: int | None, env: dict[str, str], peaks: list[float], log) -> dict[str, Any]:
    """Write the case, run the sides in alternating rounds; per side: every timed step and its memory."""
    from train_case import matmul_peak

    with tempfile.TemporaryDirectory(prefix="bench-case-") as tmp:
        case = Path(tmp) / "case"
        subprocess.run([sys.executable, str(Path(__file__)), "--_write-case", str(case), shape_json], check=True,
                       env=env, cwd=ROOT)
        cmds = side_commands(case, sides, threads, warmup, repeats)
        runs: list[list[dict[str, Any]]] = [[] for _ in sides]
        load = [os.getloadavg()[0]]
        for r in range(rounds):
            order = list(range(len(sides))) if r % 2 == 0 else list(reversed(range(len(sides))))
            for i in order:
                if runs[i] and runs[i][-1].get("killed"):
                    continue  # it did not fit: do not try again
                peaks.append(matmul_peak(threads))
                res = run_watched(cmds[i], env, mem_limit)
                runs[i].append(res)
                load.append(os.getloadavg()[0])
                log.info("round %d %s: %s", r + 1, sides[i]["name"],
                         "stopped at the memory limit" if res.get("killed") else
                         "steps " + ", ".join(f"{t:.2f}" for t in res["step_times"]) + " s")
    return {"sides": [summarise(side, rs) for side, rs in zip(sides, runs, strict=True)], "load_1min": load}


def summarise(side: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    killed = [r for r in runs if r.get("killed")]
    done = [r for r in runs if not r.get("killed")]
    steps = [t for r in done for t in r["step_times"]]
    cpu = [t for r in done for t in r["cpu_times"]]
    out: dict[str, Any] = {"name": side["name"], "runs": runs, "fits": not killed}
    if killed:
        out["rss_seen"] = max(r["rss_seen"] for r in killed)
        out["mem_limit"] = killed[0]["mem_limit"]
    if done:
        out.update(step_s_median=statistics.median(steps), step_s_min=min(steps), step_s_max=max(steps),
                   step_times=steps, cpu_s_median=statistics.median(cpu), per_round_median=[
                       statistics.median(r["step_times"]) for r in done],
                   step_peak=max(r["step_peak"] for r in done), rss_before=max(r["rss_before"] for r in done),
                   first_loss=done[0]["losses"][0])
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="internal worker of benchmarks/train_throughput.py")
    ap.add_argument("--_write-case", nargs=2, metavar=("CASE", "SHAPE_JSON"), dest="write_case")
    ap.add_argument("--_ours", type=Path, dest="ours")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    if a.write_case:
        write_case(Path(a.write_case[0]), a.write_case[1])
    elif a.ours:
        print(json.dumps(ours_worker(a.ours, a.threads, a.warmup, a.repeats)))
    else:
        ap.error("nothing to do")


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("benchmarks.train_sidebyside")))
