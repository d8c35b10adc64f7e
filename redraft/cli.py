"""The ``redraft`` command: every stage's command line under one name.

``redraft NAME ARGS...`` runs the module's own command line with ARGS, in this process: the same options, config
keys, ``--help`` and exit codes as ``python -m MODULE ARGS...`` (0 done, 2 the user's input, 1 a failure; each
module ends through ``redraft.core.cli.run``). The modules are imported only when their command runs, so ``redraft
--help`` is instant.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # has ``cli(argv) -> int``
    group: str
    summary: str


COMMANDS: tuple[Command, ...] = (
    Command("extract", "extract.__main__", "stages",
            "run the target over chat data (optionally regenerating the answers) into a dataset folder"),
    Command("verify", "extract.verify", "stages", "check a dataset folder against its manifest (--deep: every byte)"),
    Command("train", "train.main", "stages",
            "fit the drafter on a dataset (one process; several: accelerate launch train/main.py)"),
    Command("eval", "eval.acceptance", "stages", "offline acceptance (tau) of a checkpoint on a dataset"),
    Command("export", "eval.export", "stages", "a checkpoint as the drafter folder SGLang or vLLM loads"),
    Command("truth", "eval.engine_truth", "engines",
            "serve a drafter in a real engine and hold its own counters to the offline walk, per request"),
    Command("online", "eval.online", "engines", "acceptance measured by a real engine on a dataset's answers"),
    Command("loadcheck", "eval.verify_engine", "engines",
            "load an export with SGLang's and vLLM's own classes and loaders; say what landed"),
    Command("bench", "serve.bench", "serving", "base against speculative servers: tokens/s, TPOT, TTFT, acceptance"),
    Command("tune", "redraft.pipeline.tune", "serving", "from a checkpoint and prompts to the speculative setting to serve"),
    Command("sweep", "serve.tune", "serving", "the settings sweep on an export, its traffic and its offline report"),
    Command("doctor", "serve.doctor", "serving",
            "why a live deployment does not pay, and the flags that fix it (with --target: also the offline walk "
            "over the server's own replies)"),
    Command("config", "redraft.settings", "settings",
            "the settings a stage reads from a config file (a target's one config: FILE#STAGE)"),
)
DOCTOR_WITH_WALK = "redraft.pipeline.doctor"
GROUPS = {"stages": "The stages (extract -> train -> eval/export)", "engines": "In a real engine",
          "serving": "Serving", "settings": "Settings"}


def usage() -> str:
    lines = ["usage: redraft COMMAND [ARGS...]   (redraft COMMAND --help: its options)", ""]
    for group, title in GROUPS.items():
        lines.append(f"{title}:")
        lines += [f"  {c.name:<10} {c.summary}" for c in COMMANDS if c.group == group]
        lines.append("")
    lines.append("Also, unchanged: sbatch slurm/extract.sh, accelerate launch train/main.py, python -m eval.acceptance "
                 "ckpt/ --data DATASET")
    return "\n".join(lines)


def module_for(command: Command, args: Sequence[str]) -> str:
    """The module that runs ``command`` with ``args`` (the doctor with ``--target`` walks the replies offline too)."""
    if command.name == "doctor" and any(a == "--target" or a.startswith("--target=") for a in args):
        return DOCTOR_WITH_WALK
    return command.module


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    by_name = {c.name: c for c in COMMANDS}
    command = by_name.get(args[0])
    if command is None:
        print(f"redraft: unknown command {args[0]!r}; one of: {', '.join(by_name)} (redraft COMMAND --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(module_for(command, args[1:]))
    return module.cli(args[1:])


if __name__ == "__main__":
    sys.exit(main())
