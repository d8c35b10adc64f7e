"""The user's traffic for ``serve.tune``: one dataset that both the engine and the offline walk read, and the
offline acceptance ``eval.acceptance`` reported on it.

The dataset (``--data``) holds the prompts answered by the target itself, greedily (``python -m extract
--regenerate``; ``python -m redraft.pipeline.tune`` makes it from any prompts). The engine is sent exactly the dataset's
token ids before each answer (chat template included, ``redraft.core.answers``) and the offline report (``--offline``,
``python -m eval.acceptance --json`` on the same samples) scores the same answers, so the tau it predicts and the
tau the engine counts are about the same tokens.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.core.answers import AnswersError, build_requests
from redraft.core.dataset.reader import DatasetReader
from redraft.core.errors import UserError

log = logging.getLogger(__name__)


class TrafficError(UserError):
    """The traffic or its offline report cannot be read as asked; the message names the file."""


@dataclass
class Traffic:
    """The requests the engine is sent: prompt ids and the answers' budget, with where they came from."""

    data: Path
    prompts: list[list[int]]
    max_tokens: int
    samples: int
    source: str


def read_traffic(data: Path, max_samples: int = 0) -> Traffic:
    """The Traffic of a dataset: every sample (or the first max_samples), one request per answer."""
    if not (data / "manifest.json").is_file():
        raise TrafficError(f"--data {data}: no manifest.json (not a dataset written by python -m extract; "
                           "python -m redraft.pipeline.tune makes one from prompts)")
    reader = DatasetReader(data)
    if not reader.has_topk:
        raise TrafficError(f"--data {data}: stores no top-k teacher (extract --teacher topk)")
    indices = list(range(len(reader)))[: max_samples or None]
    gen = reader.manifest.get("generation") or {}
    try:
        reqs = build_requests(reader, indices)
    except AnswersError as e:
        raise TrafficError(str(e)) from None
    budget = int(gen.get("max_new_tokens") or max(r.max_tokens for r in reqs))
    if not gen:
        log.warning("%s was not answered by the target (no generation record): the engine's answers will differ "
                    "from the stored ones and the offline tau is then an estimate", data)
    return Traffic(data=data, prompts=[r.prompt for r in reqs], max_tokens=budget, samples=len(indices),
                   source=str(gen.get("source") or data))


def read_offline(path: Path, traffic: Traffic, max_steps: int) -> dict[str, Any]:
    """tau per chain length 1..max_steps and per-position rates from ``eval.acceptance --json`` (one checkpoint,
    vLLM's walk, the traffic's first samples), checked to be about the traffic's samples."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TrafficError(f"--offline {path}: unreadable ({e})") from None
    checkpoints = report.get("checkpoints") if isinstance(report, dict) else None
    if not isinstance(checkpoints, dict) or len(checkpoints) != 1:
        raise TrafficError(f"--offline {path}: not an eval.acceptance --json report of one checkpoint")
    (res,) = checkpoints.values()
    if Path(str(report.get("data"))).resolve() != traffic.data.resolve():
        raise TrafficError(f"--offline {path}: reports on {report.get('data')}, not on --data {traffic.data}")
    if report.get("split") != "all" or int(report.get("samples", -1)) != traffic.samples:
        raise TrafficError(f"--offline {path}: {report.get('samples')} samples of split {report.get('split')!r}; "
                           f"the traffic is the first {traffic.samples} of all (eval.acceptance --split all "
                           f"--max-samples {traffic.samples})")
    settings = res.get("settings") or {}
    if settings.get("engine") not in (None, "vllm") or settings.get("topk", 1) != 1 or settings.get("temperature"):
        raise TrafficError(f"--offline {path}: walked with engine {settings.get('engine')!r}, topk "
                           f"{settings.get('topk')}, temperature {settings.get('temperature')}; greedy chains in "
                           "vLLM's walk are needed (eval.acceptance --engine vllm --topk 1 --temperature 0)")
    tau = {int(k): float(v) for k, v in (res.get("tau_per_chain_length") or {}).items()}
    if max_steps not in tau:
        raise TrafficError(f"--offline {path}: tau for chains up to {max(tau, default=0)} drafts; the sweep needs "
                           f"{max_steps} (eval.acceptance --steps {max_steps})")
    return {"tau": {k: v for k, v in tau.items() if k <= max_steps}, "accept_rate": res["accept_rate"],
            "samples": res["samples"], "tokens": res["tokens"], "evaluation": res["evaluation"],
            "agreement": res["data_argmax_agreement"], "report": str(path)}
