"""One stage as its own process, the way every pipeline command runs them (``python -m STAGE ...``)."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from redraft.core import cli as ending
from redraft.core.errors import Failure

log = logging.getLogger("pipeline")


class StageError(Failure):
    """A stage's process failed; it has said why on stderr (or in its log, named here)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message, code)
        self.code = code


def run_stage(cmd: list[str], *, logfile: Path | None = None, ok_codes: Collection[int] = (0,)) -> int:
    """``cmd`` (``python -m STAGE ...``) as its own process: its stdout passed on line by line (or into
    ``logfile``), its stderr as is; its exit code when that is one of ``ok_codes``, else StageError with it."""
    shown = " ".join(["python", *cmd[1:]])
    log.info("running: %s", shown)
    if logfile is not None:
        logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(logfile, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc not in ok_codes:
            tail = "\n".join("  " + s for s in logfile.read_text(errors="replace").splitlines()[-20:])
            raise StageError(f"{shown} failed (exit {rc}; log {logfile}):\n{tail}", rc)
        return rc
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
    if proc.returncode not in ok_codes:
        raise StageError(f"{shown} failed (exit {proc.returncode}; its message is above)", proc.returncode)
    return proc.returncode


def run_command(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None, logger: logging.Logger) -> int:
    """A pipeline command's end, as redraft.core.cli ends every command (a mistake: one line and exit 2), and a failed
    stage (a ``Failure``): its message and that stage's exit code."""
    return ending.run(lambda: main(argv), logger)
