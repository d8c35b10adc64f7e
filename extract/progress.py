"""Progress of the long extraction stages in the log, at least every ``every`` seconds, whatever they are doing.

A stage (self-prompt sampling, regeneration, capture) opens a :class:`Heartbeat`; code below it reports work
with :func:`advance` (a context variable finds the open heartbeat, as ``extract.timing.span`` finds the clock,
so no counter is passed down). A timer thread writes ``what: done/total unit, tokens/s, time left`` every
``every`` seconds, also while one long engine call is running (the line then says how long since the last
advance), and a last line when the stage ends: in a log file, where tqdm bars are off, a stage is never
silent for longer than that.
"""

from __future__ import annotations

import logging
import threading
import time
from contextvars import ContextVar
from typing import Any

log = logging.getLogger("extract.progress")

EVERY_S = 15.0
_CURRENT: ContextVar[Heartbeat | None] = ContextVar("redraft_heartbeat", default=None)


def advance(items: int = 0, tokens: int = 0) -> None:
    """Count finished work towards the innermost open heartbeat (a no-op outside one)."""
    beat = _CURRENT.get()
    if beat is not None:
        beat.advance(items, tokens)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Heartbeat:
    """Counts ``items`` (of ``total`` when known) and generated or captured tokens; logs them on a timer."""

    def __init__(self, what: str, total: int | None = None, unit: str = "items", every: float = EVERY_S) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.items = 0
        self.tokens = 0
        self._start = self._last = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: Any = None

    def advance(self, items: int = 0, tokens: int = 0) -> None:
        with self._lock:
            self.items += int(items)
            self.tokens += int(tokens)
            self._last = time.perf_counter()

    def line(self) -> str:
        """``what: 12/40 prompts, 850 tok/s, 1m10s left`` (the parts that are known)."""
        with self._lock:
            items, tokens, last = self.items, self.tokens, self._last
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        parts = [f"{items}/{self.total} {self.unit}" if self.total is not None else f"{items} {self.unit}"]
        if tokens:
            parts.append(f"{tokens / elapsed:,.0f} tok/s")
        if self.total and items and items < self.total:
            parts.append(f"{_duration(elapsed / items * (self.total - items))} left")
        parts.append(f"{_duration(elapsed)} so far")
        if now - last >= self.every:
            parts.append(f"last progress {_duration(now - last)} ago")
        return f"{self.what}: " + ", ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            log.info("%s", self.line())

    def __enter__(self) -> Heartbeat:
        self._token = _CURRENT.set(self)
        self._thread = threading.Thread(target=self._run, name="redraft-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _CURRENT.reset(self._token)
        if exc[0] is None:
            log.info("%s (done)", self.line())
