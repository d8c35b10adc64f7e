"""Where the extraction stage's time goes: named parts, each second counted once.

A run's wall time is cut into parts (model load, tokenisation, regeneration, capture forward,
teacher, writing, manifest, ...) so the one-line summary and ``benchmarks/extract_throughput.py``
can say what the stage spends its time on. Parts are exclusive: a span opened inside another
(the engine start inside the first regeneration call, the teacher inside the capture) takes its
seconds away from the outer one, and time in no span is ``other``; so the parts add up to the
clock's wall time by construction, and a large ``other`` means a span is missing.

Code below the pipeline marks its parts with :func:`span`, which does nothing unless a clock is
running (``with StageClock() as clock:``), so the backends need no clock passed down. On a GPU the
spans measure when the host got there: the capture's copy to the CPU waits for the device, so the
device's time lands in the capture and teacher parts, not in the part that queued it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token

OTHER = "other"

# The order parts are reported in (pipeline order); a part not listed here comes after them.
PART_ORDER = ("self_prompts", "read", "plan", "load", "tokenize", "regenerate", "capture", "teacher", "write", "finalize", "close",
              OTHER)

class StageClock:
    """Exclusive wall time per named part, from entering the clock to :meth:`stop`."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = {}
        self._now = now
        self._stack: list[str] = [OTHER]
        self._mark = now()
        self._token: Token | None = None

    def _charge(self) -> None:
        now = self._now()
        top = self._stack[-1]
        self.seconds[top] = self.seconds.get(top, 0.0) + (now - self._mark)
        self._mark = now

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def __enter__(self) -> StageClock:
        self._mark = self._now()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> dict[str, float]:
        """Charge the time up to now and detach the clock; returns the parts (seconds), in report order."""
        if self._token is not None:
            self._charge()
            _ACTIVE.reset(self._token)
            self._token = None
        return ordered(self.seconds)


_ACTIVE: ContextVar[StageClock | None] = ContextVar("redraft_stage_clock", default=None)


@contextmanager
def span(name: str) -> Iterator[None]:
    """Count the time inside as part ``name`` of the running stage clock (nothing when none runs)."""
    clock = _ACTIVE.get()
    if clock is None:
        yield
        return
    with clock.span(name):
        yield


def ordered(parts: dict[str, float]) -> dict[str, float]:
    """The parts in pipeline order (unknown names last, by name)."""
    rank = {name: i for i, name in enumerate(PART_ORDER)}
    return {k: parts[k] for k in sorted(parts, key=lambda k: (rank.get(k, len(rank)), k))}


def describe(parts: dict[str, float]) -> str:
    """``capture 4.12 s (55%), teacher 1.3 s (18%), ...``: the parts of at least 1% with their share of the total."""
    total = sum(parts.values())
    if total <= 0:
        return "none"
    return ", ".join(f"{k} {v:.3g} s ({100 * v / total:.0f}%)" for k, v in ordered(parts).items() if v >= 0.01 * total)
