"""`python -m extract`: the extraction stage's command line (see `--help`).

A streamed run (``--window-bytes`` / ``--window-shards``) also tells its trainer how it ended: the end state
(finished, refused, failed, stopped) goes into the folder before the process exits in every way it can still act
on, and a heartbeat runs while it works (``redraft.core.dataset.liveness``), so a trainer never waits on an extraction
that is gone.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

from extract.config import ExtractConfig, parse_args, resolve_rank
from redraft.core import cli as ending
from redraft.core.config import ConfigError
from redraft.core.dataset.liveness import (
    Heartbeat,
    PeerGone,
    clear_end,
    extractor_name,
    heartbeat_interval,
    write_end,
)
from redraft.core.errors import Failure, UserError

log = logging.getLogger("extract")


class Stopped(BaseException):
    """A signal asked this process to stop (SIGTERM: Slurm's preemption and scancel). A BaseException, so that
    no ``except Exception`` on the way swallows it; the engines close in their ``finally`` blocks."""


def _stop(signum: int, _frame: Any) -> None:
    raise Stopped(f"{signal.Signals(signum).name} received")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_args(argv)
    except ConfigError as e:  # one line naming the option; a streamed run's trainer is told too
        log.error("%s", e)
        _refused_before_start(argv, str(e))
        return 2
    heartbeat = None
    if cfg.streaming:
        clear_end(cfg.out, cfg.rank)  # a rank starting again: its last end no longer holds
        heartbeat = Heartbeat(cfg.out, extractor_name(cfg.rank), heartbeat_interval(cfg.stream_peer_timeout)).start()
    previous = _on_sigterm(_stop)
    try:
        rc, state, reason = _run(cfg)
    finally:
        _on_sigterm(previous)
        if heartbeat is not None:
            heartbeat.stop()
    if cfg.streaming:
        write_end(cfg.out, cfg.rank, state, reason, rc)
    return rc


def _on_sigterm(handler: Any) -> Any:
    """Install a SIGTERM handler where Python allows one (the main thread); the one it replaces."""
    if handler is None:
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (a library caller): the signal keeps its meaning
        return None


def _run(cfg: ExtractConfig) -> tuple[int, str, str]:
    """(exit code, end state, one line): the stage, with every way it can end that it can still report."""
    try:
        from extract.pipeline import run_extraction  # heavy imports after argument checks

        summary = run_extraction(cfg)
    except (UserError, FileNotFoundError) as e:  # the user's input, by name
        return _said(2, "refused", str(e))
    except PeerGone as e:  # the trainer stopped beating while this waited for room
        return _said(e.exit_code, "stopped", str(e))
    except Failure as e:  # the engine failed (its log's first traceback is in the message), or is missing
        return _said(e.exit_code, "failed", str(e))
    except OSError as e:  # disk full, quota, I/O error: shards written so far are complete and kept
        return _said(1, "failed", f"write failed: {e}; complete shards are kept: free space and rerun the same "
                     "command to resume")
    except Stopped as e:
        return _said(128 + signal.SIGTERM, "stopped", f"{e}: the shards written so far are kept; run the same "
                     "command again to resume")
    except KeyboardInterrupt:
        return _said(128 + signal.SIGINT, "stopped", "interrupted (SIGINT): the shards written so far are kept; "
                     "run the same command again to resume")
    except BaseException as e:  # a bug: the trainer is told it failed, and the traceback stays
        if cfg.streaming:
            write_end(cfg.out, cfg.rank, "failed", f"{type(e).__name__}: {e} (a bug in redraft: see the "
                      "extraction's log)", 1)
        raise
    log.info("%s", summary.line())
    return 0, "finished", summary.line()


def _said(rc: int, state: str, reason: str) -> tuple[int, str, str]:
    log.error("%s", reason)
    return rc, state, reason


def _refused_before_start(argv: list[str] | None, reason: str) -> None:
    """A streamed run refused while its options were checked: the end state goes where the trainer looks, when the
    options say where that is (else there is no folder to tell)."""
    try:
        raw = parse_args(argv, validate=False)
        if not raw.out or not raw.streaming:
            return
        rank, _ = resolve_rank(raw.rank, raw.world_size)
    except (ConfigError, ValueError, SystemExit):
        return
    write_end(raw.out, rank, "refused", reason, 2)


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("extract"))


if __name__ == "__main__":
    sys.exit(cli())
