"""How a command ends on a mistake: one line naming the file, key or value, and an exit code, never a traceback.

The project's own errors say what is wrong in their message (``ConfigError``: an option or config key;
``DatasetError``: a dataset file; ``CheckpointError``: a drafter or checkpoint folder; a missing file), so they end
the command with that one line and exit code 2 (the user's input). ``EngineError`` (an engine that failed or is
missing; its message carries the engine log's first traceback) ends it with exit code 1, and ``PeerGone`` (the
other side of a stream is gone) with the code it carries (2 when that side refused the user's input, else 1).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from core.config import ConfigError
from core.dataset.format import DatasetError
from core.dataset.liveness import PeerGone
from core.drafter.folder import CheckpointError
from core.engines.driver_protocol import EngineError

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, DatasetError, CheckpointError, FileNotFoundError,
                                                NotADirectoryError)


def run(main: Callable[[], Any], log: logging.Logger, user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Call ``main``; its exit code when it returns one (an int), else 0; 2 on a user's mistake (one line), 1 when an
    engine failed.

    ``user_errors``: a stage's own error types that also name the problem (e.g. a bad input record)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rc = main()
    except USER_ERRORS + user_errors as e:
        log.error("%s", _one_line(e))
        return 2
    except EngineError as e:
        log.error("%s", e)
        return 1
    except PeerGone as e:
        log.error("%s", e)
        return e.exit_code
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)
