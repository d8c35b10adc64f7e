"""The two kinds of error a command ends on with one line (``redraft.core.cli.run``), and nothing else.

- ``UserError``: the user's input is wrong (an option, a config key, a file, a folder, a value); the message names
  it. Exit code 2, nothing written half-way.
- ``Failure``: something outside redraft's code failed while it ran as asked (an engine, a server, a stage's own
  process, the other side of a stream); the message says what and where its log is. Exit code ``exit_code`` (1
  unless the failure carries another, e.g. a stage's own).

Every other exception is a bug in redraft and keeps its traceback (exit code 1), so a bug never looks like the
user's mistake. The stages' own error types subclass one of the two (``ConfigError``, ``DatasetError``, ...).
``UserError`` is a ``ValueError`` and ``Failure`` a ``RuntimeError`` so that code written against the built-in
types still catches them.
"""

from __future__ import annotations


class UserError(ValueError):
    """The user's input is wrong; the message names the file, key or value (exit code 2)."""

    exit_code = 2


class Failure(RuntimeError):
    """Something redraft ran (an engine, a server, a stage's process) failed; the message says what (exit code 1,
    or the code given)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
