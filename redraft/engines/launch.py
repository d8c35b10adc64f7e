"""How each engine is told to serve a target with a redraft drafter: the launch lines, and which engine an
export folder was written for.

The one home of these engine rules: ``eval.export`` prints them, ``serve.tune`` recommends them.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from redraft.core.errors import UserError

log = logging.getLogger(__name__)

CAP_NOTE = ("# --max-running-requests and --cuda-graph-max-bs are explicit on purpose: without them SGLang "
            "caps speculative serving at 48 concurrent requests.")



class LaunchError(UserError):
    """Serving flags an engine would refuse or silently change; the message names the flag."""


@dataclass
class LaunchPlan:
    """Speculative-decoding flags for the printed serving command."""

    steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None  # None: steps + 1 when topk is 1 (SGLang forces that)
    tp: int = 1
    max_running_requests: int = 128
    cuda_graph_max_bs: int | None = None  # None: max_running_requests
    trust_remote_code: bool = False
    method: str | None = None  # the drafter's method (DrafterConfig.method); None: read from its folder's config.json

    def resolved(self) -> LaunchPlan:
        """Validated copy with the defaults filled; SGLang's own rules become errors, not silent changes."""
        for name in ("steps", "topk", "tp", "max_running_requests"):
            if int(getattr(self, name)) < 1:
                raise LaunchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        tokens = self.num_draft_tokens
        if self.topk == 1:
            if tokens is not None and tokens != self.steps + 1:
                raise LaunchError(
                    f"--num-draft-tokens {tokens}: with --topk 1 SGLang forces it to steps + 1 = {self.steps + 1}"
                )
            tokens = self.steps + 1
        elif tokens is None:
            raise LaunchError(f"--topk {self.topk} (tree drafting) needs an explicit --num-draft-tokens")
        elif tokens < 2:
            raise LaunchError(f"--num-draft-tokens must be >= 2, got {tokens}")
        graph_bs = self.cuda_graph_max_bs if self.cuda_graph_max_bs is not None else self.max_running_requests
        if graph_bs < 1:
            raise LaunchError(f"--cuda-graph-max-bs must be >= 1, got {graph_bs}")
        if graph_bs > self.max_running_requests:
            log.warning("--cuda-graph-max-bs %d exceeds --max-running-requests %d: graphs above %d are never used",
                        graph_bs, self.max_running_requests, self.max_running_requests)
        return replace(self, num_draft_tokens=tokens, cuda_graph_max_bs=graph_bs)


def sglang_command(target: str, draft: str, plan: LaunchPlan) -> str:
    """``python -m sglang.launch_server ...`` serving ``target`` with the EAGLE-3 drafter at ``draft``."""
    p = plan.resolved()
    args = [
        "python", "-m", "sglang.launch_server", "--model-path", target,
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
        "--speculative-num-steps", str(p.steps), "--speculative-eagle-topk", str(p.topk),
        "--speculative-num-draft-tokens", str(p.num_draft_tokens), "--tp", str(p.tp),
        "--max-running-requests", str(p.max_running_requests), "--cuda-graph-max-bs", str(p.cuda_graph_max_bs),
    ]
    if p.trust_remote_code:
        args.append("--trust-remote-code")
    return " ".join(shlex.quote(a) for a in args)


def folder_method(draft: str | Path) -> str | None:
    """The method of the drafter folder at ``draft``, by the one reading of a config.json
    (:func:`redraft.core.drafter.serving_format.served_method`). None for a folder without a readable config.json or
    whose keys name no method (nothing to tell from; the engine then says what is wrong with it)."""
    from redraft.core.drafter.serving_format import served_method

    try:
        config = json.loads((Path(draft) / "config.json").read_text())
        return served_method(config) if isinstance(config, dict) else None
    except (OSError, ValueError):  # ServingFormatError is a ValueError
        return None


def vllm_speculative_config(draft: str | Path, steps: int, method: str | None = None) -> dict:
    """vLLM's ``speculative_config`` for the drafter at ``draft`` (``method``: its DrafterConfig.method; None: read
    from the folder, :func:`folder_method`): ``steps`` drafts with method eagle3, plus ``parallel_drafting`` for a
    P-EAGLE drafter (vLLM takes that switch from the launch, not from the folder; without it the drafter would be
    run step by step, reading its own drafts, which it was not trained to); method dflash for a DFlash drafter
    (one block of ``steps`` drafts; parallel drafting is implied)."""
    method = folder_method(draft) if method is None else method
    spec: dict = {"method": "dflash" if method == "dflash" else "eagle3", "model": str(draft),
                  "num_speculative_tokens": int(steps)}
    if method == "p-eagle":
        spec["parallel_drafting"] = True
    return spec


def vllm_command(target: str, draft: str, plan: LaunchPlan) -> str:
    """``vllm serve ...`` with an eagle3 speculative config (vLLM drafts a chain of ``steps`` tokens)."""
    p = plan.resolved()
    spec = json.dumps(vllm_speculative_config(draft, p.steps, p.method))
    args = ["vllm", "serve", target, "--speculative-config", spec, "--tensor-parallel-size", str(p.tp),
            "--max-num-seqs", str(p.max_running_requests)]
    if p.trust_remote_code:
        args.append("--trust-remote-code")
    return " ".join(shlex.quote(a) for a in args)


def launch_command(fmt: str, target: str, draft: str, plan: LaunchPlan) -> str:
    """The serving command for ``fmt``, preceded by a comment line saying why the limits are explicit."""
    if fmt == "sglang":
        return CAP_NOTE + "\n" + sglang_command(target, draft, plan)
    if plan.topk != 1:
        log.warning("--topk %d/--num-draft-tokens apply to SGLang only; vLLM drafts a chain of --steps tokens",
                    plan.topk)
    return vllm_command(target, draft, plan)


ENGINES = ("sglang", "vllm")


def export_engine(folder: Path) -> str | None:
    """The engine an ``eval.export`` folder was written for (its ``redraft.json``), None for any other folder."""
    rec = Path(folder) / "redraft.json"
    if not rec.is_file():
        return None
    try:
        data = json.loads(rec.read_text())
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != "redraft-export":
        return None
    return data.get("serving_format") if data.get("serving_format") in ENGINES else None


def is_export(folder: Path, engine: str) -> bool:
    """Whether ``folder`` is an ``eval.export`` folder in ``engine``'s layout (layer ids in its convention)."""
    return export_engine(folder) == engine
