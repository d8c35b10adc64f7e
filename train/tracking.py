"""Where training numbers go: OUT/metrics.jsonl always, wandb when asked, a tqdm bar on rank 0.

Per-rank sums are reduced across ranks *before* they reach here (see :class:`StepStats`), so
every number logged is a global one, whatever the world size.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def simulated_acceptance_length(step_acc: Sequence[float] | torch.Tensor) -> float:
    """Expected tokens per verify step of a chain drafter: tau = 1 + sum_k prod_{j<=k} acc_j.

    The leading 1 is the bonus token the target always contributes (SGLang counts it; SpecForge's
    ``simulated_acc_len`` does not). Assumes step k is only reached when steps < k were accepted,
    which is what per-step TTT accuracy measures.
    """
    tau, prod = 1.0, 1.0
    for a in (step_acc.tolist() if isinstance(step_acc, torch.Tensor) else step_acc):
        prod *= float(a)
        tau += prod
    return tau


class StepStats:
    """Sums over micro-batches of the TTT counters; reduced across ranks in one collective."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self.steps = steps
        self.device = device
        self.reset()

    def reset(self) -> None:
        # rows: loss-sum, micro-batches, per-step loss sums, counts, correct, acc counts, accept sums, tokens
        k = self.steps
        self.buf = torch.zeros(2 + 5 * k + 2, dtype=torch.float64, device=self.device)

    def add(self, out: Any, num_tokens: int, num_loss_tokens: int, share: float = 1.0) -> None:
        """``share``: this rank's part of the micro-batch (1 / sequence_parallel: the group's ranks each hold a share of
        one micro-batch, whose loss and step sums are already split between them, so its counts are split too)."""
        k = self.steps
        b = self.buf
        b[0] += out.loss.detach().double()
        b[1] += share
        b[2 : 2 + k] += out.step_loss.double()
        b[2 + k : 2 + 2 * k] += out.step_counts.double()
        b[2 + 2 * k : 2 + 3 * k] += out.step_correct.double()
        b[2 + 3 * k : 2 + 4 * k] += out.step_acc_counts.double()
        b[2 + 4 * k : 2 + 5 * k] += out.step_accept_sum.double()
        b[-2] += num_tokens * share
        b[-1] += num_loss_tokens * share

    def summary(self, accelerator: Any) -> dict[str, Any]:
        """Global metrics (every rank must call this: it is a collective when world > 1)."""
        b = accelerator.reduce(self.buf.clone(), reduction="sum") if accelerator.num_processes > 1 else self.buf
        b = b.cpu()
        k = self.steps
        n = max(float(b[1]), 1.0)
        counts = b[2 + k : 2 + 2 * k]
        acc = (b[2 + 2 * k : 2 + 3 * k] / b[2 + 3 * k : 2 + 4 * k].clamp(min=1)).tolist()
        accept = (b[2 + 4 * k : 2 + 5 * k] / counts.clamp(min=1)).tolist()
        return {
            "loss": float(b[0]) / n,
            "step_loss": [float(x) / n for x in b[2 : 2 + k]],
            "acc": acc,
            "accept": accept,
            "tau": simulated_acceptance_length(acc),
            "tokens": round(float(b[-2])),
            "loss_tokens": round(float(b[-1])),
            "micro_batches": round(float(b[1])),
        }


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


class Tracker:
    """metrics.jsonl + optional wandb + progress bar; only rank 0 writes anything."""

    def __init__(
        self,
        accelerator: Any,
        out: Path,
        *,
        config: Mapping[str, Any],
        total_steps: int,
        start_step: int,
        report_to: str,
        project: str,
        run_name: str,
    ) -> None:
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.path = Path(out) / METRICS_FILE
        self.wandb = report_to == "wandb"
        self.bar = None
        if not self.main:
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        if self.wandb:
            accelerator.init_trackers(
                project,
                config=dict(config),
                init_kwargs={"wandb": {"name": run_name, "dir": str(out)}},
            )
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                        disable=os.environ.get("REDRAFT_NO_PROGRESS") == "1")

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows the killed run logged after the checkpoint (they will be logged again)."""
        if not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by the kill
            if int(row.get("step", 0)) <= step:
                keep.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    def log(self, kind: str, step: int, metrics: Mapping[str, Any]) -> None:
        """One JSON row (kind = train | val) and the same numbers to wandb, flattened."""
        if not self.main:
            return
        row = {"kind": kind, "step": step, **{k: _finite(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb:
            flat: dict[str, Any] = {}
            for k, v in metrics.items():
                if isinstance(v, list):
                    flat.update({f"{kind}/{k}_{i}": x for i, x in enumerate(v)})
                elif isinstance(v, (int, float)):
                    flat[f"{kind}/{k}"] = v
            self.accelerator.log(flat, step=step)

    def progress(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        if self.bar is None:
            return
        self.bar.update(step - self.bar.n)
        if metrics:
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.3f}",
                acc0=f"{metrics['acc'][0]:.3f}",
                lr=f"{metrics['lr']:.2e}",
                tok_s=f"{metrics['tokens_per_s']:.0f}",
                refresh=False,
            )

    def close(self) -> None:
        """Close the bar; wandb is finished by accelerator.end_training(), which every rank calls."""
        if self.bar is not None:
            self.bar.close()
