"""How every command ends: one line and exit 2 on the user's mistake, one line and the failure's code when
something it ran failed, a traceback and exit 1 on a bug in redraft (``redraft.core.errors``).

Every command line of redraft (the stages, the pipelines, the benchmarks, the conformance checks, the ``redraft``
command) ends through :func:`run`. A missing file or folder the user named (``FileNotFoundError``,
``NotADirectoryError`` with a file name) is the user's input too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redraft.core.errors import Failure, UserError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_RUN_HANDLERS: list[logging.Handler] = []  # the handler run() installed, which configure_logging may retune


def run(main: Callable[[], Any], log: logging.Logger) -> int:
    """Call ``main``; its exit code when it returns one (an int), else 0; 2 on a ``UserError`` (one line), the
    failure's code on a ``Failure`` (one line); anything else is raised (a bug: its traceback, exit 1).

    Logging is set up here, before ``main`` (INFO, :data:`LOG_FORMAT`), unless something already did, so that even a
    mistake found while parsing gets its line. A command that learns its level or format later (``-q``, a rank)
    calls :func:`configure_logging`, which retunes this set-up; a ``basicConfig`` inside ``main`` would not count."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        _RUN_HANDLERS[:] = root.handlers[:1]
    try:
        rc = main()
    except (UserError, FileNotFoundError, NotADirectoryError) as e:
        log.error("%s", _one_line(e))
        return 2
    except Failure as e:
        log.error("%s", e)
        return e.exit_code
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def configure_logging(level: int = logging.INFO, log_format: str = LOG_FORMAT) -> None:
    """A command's own level and format, once it knows them (a quiet flag, a rank's tag): set up when nothing is,
    retuned when :func:`run` set it up; a set-up someone else made (pytest, a program calling ``main``) is theirs."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format=log_format)
    elif any(h in root.handlers for h in _RUN_HANDLERS):
        root.setLevel(level)
        for handler in _RUN_HANDLERS:
            handler.setFormatter(logging.Formatter(log_format))
