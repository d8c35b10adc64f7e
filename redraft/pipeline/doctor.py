"""The doctor with the offline walk over the server's own replies: is the drafter served as trained, or does it
not fit this target?

    python -m redraft.pipeline.doctor --url http://HOST:PORT --target TARGET_FOLDER --out WORK [--drafter DIR] \\
        [serve.doctor's options]

Each stage runs as its own process, exactly as a user would type it (the commands are logged), and they meet
only in the files they write under OUT:

1. ``python -m serve.doctor``: what runs, the static checks and the bounded probe (OUT/doctor.json);
2. ``python -m extract --regenerate --regen-backend server``: the probe's prompts answered again by the same
   server, greedily (speculation does not change a greedy reply), and the target's hidden states of those
   replies captured on this machine from TARGET_FOLDER at the layers the drafter was trained on (OUT/replies);
3. ``python -m eval.acceptance``: the drafter's offline walk over those replies with the server's own draft
   steps (OUT/offline.json).

Then the verdict (``serve.doctor_findings.acceptance_finding``): the engine's tokens per verify round at one
stream against the walk's. Far below it, the deployment does not serve the drafter as it was trained (layers,
norms, template, target); both low, the drafter does not fit this target. OUT/report.json and report.md; exit
status as ``serve.doctor``'s (0 healthy, 3 findings, 2 cannot examine).

The capture runs the target with transformers on this machine (``extract``'s HF backend): for a target this
machine cannot hold, give ``--offline-tau`` to ``serve.doctor`` from a walk made where it can.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.catalog.builtin import resolve_target
from redraft.core import options
from redraft.core.atomic import atomic_write_text
from redraft.core.config import ConfigError
from redraft.core.drafter.folder import CheckpointError, load_drafter_checkpoint
from redraft.core.options import option
from redraft.core.target_weights import text_config
from redraft.pipeline.stages import StageError, run_command, run_stage
from serve import doctor_findings as rules
from serve.doctor import FINDINGS, HEALTHY, DoctorOptions, render

log = logging.getLogger("redraft.pipeline.doctor")
PROG = "python -m redraft.pipeline.doctor"
DESCRIPTION = " ".join(__doc__.split("\n\n")[0].split())
WALK_CODES = ("drafter-does-not-fit", "served-not-as-trained")  # the findings the walk decides between


@dataclass(kw_only=True)
class PipelineDoctorOptions(DoctorOptions):
    """serve.doctor's options, with the target folder the replies are captured from and a work folder."""

    target: str = option(help="the target's folder (or a built-in name): the replies' hidden states are captured "
                              "from it on this machine", group="offline walk")
    out: str = option(help="work folder: the doctor's evidence, the replies, the walk and the report",
                      group="offline walk")
    max_length: int = option(4096, "longest prompt + reply captured", group="offline walk")

    def validate(self) -> None:
        if self.before_launch is not None:
            raise ConfigError("--before-launch: no server to walk; run python -m serve.doctor --before-launch")
        super().validate()
        if self.offline_tau is not None:
            raise ConfigError("--offline-tau: this command computes the offline walk itself (python -m serve.doctor "
                              "takes a number made elsewhere)")
        if self.max_length < self.max_tokens + 1:
            raise ConfigError(f"--max-length {self.max_length}: shorter than a reply (--max-tokens {self.max_tokens})")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(PipelineDoctorOptions, prog=PROG, description=DESCRIPTION)


def doctor_command(opts: PipelineDoctorOptions, out: Path) -> list[str]:
    """``python -m serve.doctor`` with the user's options (the work folder's outputs in place of theirs)."""
    cmd = [sys.executable, "-m", "serve.doctor", "--url", opts.url, "--concurrency", ",".join(map(str, opts.concurrency)),
           "--num-prompts", str(opts.num_prompts), "--max-tokens", str(opts.max_tokens),
           "--max-seconds", str(opts.max_seconds), "--tokenizer", opts.tokenizer or str(resolve_target(opts.target)),
           "--json", str(out / "doctor.json"), "--markdown", str(out / "doctor.md")]
    for flag, value in (("--base-url", opts.base_url), ("--drafter", opts.drafter),
                        ("--target-architecture", opts.target_architecture), ("--prompts", opts.prompts)):
        if value is not None:
            cmd += [flag, value]
    return cmd + (["--trust-remote-code"] if opts.trust_remote_code else [])


def trained_layers(drafter: Path, target: Path) -> list[int]:
    """The target layers the drafter was trained on (redraft's convention): what the replies are captured at."""
    tcfg = json.loads((target / "config.json").read_text())
    try:
        cfg, _ = load_drafter_checkpoint(drafter, target_architecture=(tcfg.get("architectures") or ["?"])[0],
                                         target_num_layers=int(text_config(tcfg)["num_hidden_layers"]))
    except (CheckpointError, ValueError) as e:
        raise ConfigError(f"drafter {drafter}: {e}") from None
    return list(cfg.aux_layer_ids)


def replies_command(opts: PipelineDoctorOptions, target: Path, out: Path, layers: list[int]) -> list[str]:
    """``python -m extract``: the probe's prompts answered by the server again, captured from the target."""
    return [sys.executable, "-m", "extract", "--target", str(target), "--data", opts.prompts or "mtbench",
            "--out", str(out), "--aux-layer-ids", ",".join(map(str, layers)), "--teacher", "topk",
            "--hidden-dtype", "bf16", "--max-length", str(opts.max_length), "--max-samples", str(opts.num_prompts),
            "--regenerate", "--max-user-turns", "1", "--temperature", "0", "--max-new-tokens", str(opts.max_tokens),
            "--regen-backend", "server", "--regen-url", opts.url, "--regen-concurrency", "1",
            *(["--trust-remote-code"] if opts.trust_remote_code else [])]


def walk_command(drafter: Path, data: Path, running: dict[str, Any], out: Path) -> list[str]:
    """``python -m eval.acceptance``: the walk with the server's own steps (and tree, for SGLang)."""
    steps = running.get("speculative_num_steps")
    if not steps:
        raise ConfigError("the server did not say how many draft steps it runs; the walk needs them")
    cmd = [sys.executable, "-m", "eval.acceptance", str(drafter), "--data", str(data), "--split", "all",
           "--steps", str(steps), "--no-progress", "--json", str(out)]
    topk = running.get("speculative_eagle_topk") or 1
    if topk > 1:
        cmd += ["--topk", str(topk), "--num-draft-tokens", str(running["speculative_num_draft_tokens"])]
    return cmd


def judge(result: dict[str, Any], walk: dict[str, Any]) -> dict[str, Any]:
    """The doctor's result with the acceptance verdict decided by the walk (its other findings as they were)."""
    drafter = next(iter(walk["checkpoints"].values()))
    levels = result["probe"]["levels"]
    finding = rules.acceptance_finding(levels, result["running"].get("speculative_num_steps"), drafter["tau"])
    findings = [f for f in result["findings"] if f["code"] not in WALK_CODES]
    findings += [finding.to_dict()] if finding is not None else []
    engine = next((lv["accept_length"] for lv in levels if lv["concurrency"] == 1), None)
    return {**result, "findings": findings, "healthy": not findings,
            "offline_walk": {"tau": drafter["tau"], "estimator": drafter["evaluation"], "samples": walk["samples"],
                             "engine_tau_one_stream": engine, "data": walk["data"]}}


def main(argv: Sequence[str] | None = None) -> int:
    opts = options.parse(PipelineDoctorOptions, argv, prog=PROG, description=DESCRIPTION, section="doctor")
    out = Path(opts.out)
    target = resolve_target(opts.target)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        run_stage(doctor_command(opts, out), ok_codes=(HEALTHY, FINDINGS))
    except StageError:
        if created:  # the server could not be examined: nothing of this run is left behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    result = json.loads((out / "doctor.json").read_text())
    if not result.get("drafter"):
        raise ConfigError("the walk needs the drafter's folder: the server's draft model path is not on this "
                          "machine; give --drafter DIR")
    drafter = Path(result["drafter"]["folder"])
    replies = out / "replies"
    run_stage(replies_command(opts, target, replies, trained_layers(drafter, target)), logfile=out / "replies.log")
    run_stage(walk_command(drafter, replies, result["running"], out / "offline.json"), logfile=out / "offline.log")
    report = judge(result, json.loads((out / "offline.json").read_text()))
    text = render(report)
    print(text, end="")
    bodies = {"json": json.dumps(report, indent=1, default=str) + "\n", "md": text}
    for path, kind in ((out / "report.json", "json"), (out / "report.md", "md"), (opts.json, "json"),
                       (opts.markdown, "md")):
        if path is not None:
            atomic_write_text(Path(path), bodies[kind])
    return HEALTHY if report["healthy"] else FINDINGS


def cli(argv: list[str] | None = None) -> int:
    """The command line: a mistake is one line and exit 2; a failed stage ends with that stage's exit code."""
    return run_command(main, argv, log)


if __name__ == "__main__":
    sys.exit(cli())
