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


def run(main: Callable[[], Any], log: logging.Logger, log_format: str = LOG_FORMAT) -> int:
    """Call ``main``; its exit code when it returns one (an int), else 0; 2 on a ``UserError`` (one line), the
    failure's code on a ``Failure`` (one line); anything else is raised (a bug: its traceback, exit 1).

    Logging is set up here, before ``main`` (INFO, ``log_format``), unless something already did: a command with
    a format of its own passes it, since a ``basicConfig`` inside ``main`` is then too late to count."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=log_format)
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
