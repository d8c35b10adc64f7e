"""The user's traffic for ``eval.tune``: one dataset that both the engine and the offline walk read.

The prompts (any input ``python -m extract`` reads, or a built-in name such as ``mtbench``) are answered by
the target itself, greedily, and captured once (``python -m extract --regenerate``, into OUT/traffic; reused
when it is complete). The engine is then sent exactly the dataset's token ids before each answer (chat
template included) and the offline walk scores the same answers, so the tau ``eval.acceptance`` predicts and
the tau the engine counts are about the same tokens. ``--data`` names such a dataset made earlier instead.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class TrafficError(RuntimeError):
    """The traffic could not be built or read; the message names the file or the command's log."""


@dataclass
class Traffic:
    """The requests the engine is sent: prompt ids and the answers' budget, with where they came from."""

    data: Path
    prompts: list[list[int]]
    max_tokens: int
    samples: int
    source: str


def drafter_layer_ids(drafter: str, target: str) -> list[int]:
    """The target layers the drafter reads (redraft's convention, ``core.layers``), so the traffic captures those."""
    from core.drafter.folder import CheckpointError, load_drafter_checkpoint
    from core.target_weights import text_config
    from eval.evaluation_inputs import AcceptanceError, resolve_checkpoint

    tcfg = json.loads((Path(target) / "config.json").read_text())
    try:
        folder = resolve_checkpoint(drafter)
        cfg, _ = load_drafter_checkpoint(folder, target_architecture=(tcfg.get("architectures") or ["?"])[0],
                                         target_num_layers=int(text_config(tcfg)["num_hidden_layers"]))
    except (CheckpointError, AcceptanceError, ValueError) as e:
        raise TrafficError(f"drafter {drafter}: {e}") from None
    return [int(i) for i in cfg.aux_layer_ids]


def extract_command(target: str, prompts: str, out: Path, *, layer_ids: list[int], max_samples: int,
                    max_new_tokens: int, regen_backend: str, max_length: int) -> list[str]:
    """``python -m extract`` answering each first user turn with the target (greedy) and capturing it."""
    return [sys.executable, "-m", "extract", "--target", target, "--data", prompts, "--out", str(out),
            "--aux-layer-ids", ",".join(map(str, layer_ids)), "--teacher", "topk", "--hidden-dtype", "bf16",
            "--max-length", str(max_length), "--dtype", "float32", "--max-samples", str(max_samples),
            "--regenerate", "--max-user-turns", "1", "--temperature", "0", "--max-new-tokens", str(max_new_tokens),
            "--regen-backend", regen_backend]


def _complete(folder: Path) -> bool:
    if not (folder / "manifest.json").is_file():
        return False
    done = subprocess.run([sys.executable, "-m", "extract.verify", str(folder)], capture_output=True, text=True)
    return done.returncode == 0


def build_traffic(target: str, prompts: str, out: Path, *, drafter: str, max_samples: int, max_new_tokens: int,
                  regen_backend: str, max_length: int) -> Path:
    """OUT/traffic: the prompts answered by the target and captured at the drafter's layers (reused when
    complete and made by the same command)."""
    cmd = extract_command(target, prompts, out, layer_ids=drafter_layer_ids(drafter, target),
                          max_samples=max_samples, max_new_tokens=max_new_tokens, regen_backend=regen_backend,
                          max_length=max_length)
    stamp = out.parent / f"{out.name}.command.json"
    if _complete(out) and stamp.is_file() and json.loads(stamp.read_text()) == cmd[1:]:
        log.info("traffic: reusing %s", out)
        return out
    logfile = out.parent / f"{out.name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("traffic: answering %s with the target (%s), log %s", prompts, regen_backend, logfile)
    with open(logfile, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join("  " + s for s in logfile.read_text(errors="replace").splitlines()[-20:])
        raise TrafficError(f"extracting the traffic failed (exit {rc}; log {logfile}):\n{tail}")
    stamp.write_text(json.dumps(cmd[1:]) + "\n")
    return out


def read_traffic(data: Path, max_samples: int = 0) -> tuple[Any, list[int], Traffic]:
    """(reader, indices, Traffic) of a dataset: every sample (or the first max_samples), one request per answer."""
    from core.dataset.reader import DatasetReader
    from eval.online import OnlineError, build_requests

    if not (data / "manifest.json").is_file():
        raise TrafficError(f"--data {data}: no manifest.json (not a dataset written by python -m extract)")
    reader = DatasetReader(data)
    if not reader.has_topk:
        raise TrafficError(f"--data {data}: stores no top-k teacher (extract --teacher topk)")
    indices = list(range(len(reader)))[: max_samples or None]
    gen = reader.manifest.get("generation") or {}
    try:
        reqs = build_requests(reader, indices)
    except OnlineError as e:
        raise TrafficError(str(e)) from None
    budget = int(gen.get("max_new_tokens") or max(r.max_tokens for r in reqs))
    if not gen:
        log.warning("%s was not answered by the target (no generation record): the engine's answers will differ "
                    "from the stored ones and the offline tau is then an estimate", data)
    return reader, indices, Traffic(data=data, prompts=[r.prompt for r in reqs], max_tokens=budget,
                                    samples=len(indices), source=str(gen.get("source") or data))


def offline_tau(drafter: str, reader: Any, indices: list[int], max_steps: int) -> dict[str, Any]:
    """``eval.acceptance`` on the traffic: tau per chain length 1..max_steps (vLLM's walk), per-position rates."""
    from eval.acceptance import evaluate
    from eval.evaluation_inputs import AcceptanceError

    try:
        res = evaluate(drafter, reader, steps=max_steps, indices=indices, engine="vllm", progress=False)
    except AcceptanceError as e:
        raise TrafficError(f"offline acceptance of {drafter} on {reader.root}: {e}") from None
    tau = {int(k): float(v) for k, v in res["tau_per_chain_length"].items()}
    return {"tau": tau, "accept_rate": res["accept_rate"], "samples": res["samples"], "tokens": res["tokens"],
            "evaluation": res["evaluation"], "agreement": res["data_argmax_agreement"]}
