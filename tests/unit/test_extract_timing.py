"""extract.timing: exclusive parts that add up to the clock's wall time (a fake clock, so exact)."""

from __future__ import annotations

import pytest

from extract.timing import StageClock, describe, ordered, span


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_nested_spans_are_exclusive_and_add_up():
    now = FakeTime()
    with StageClock(now) as clock:
        now.t += 1  # in no span: other
        with span("capture"):
            now.t += 2
            with span("teacher"):  # inside capture: its seconds are the teacher's only
                now.t += 4
            now.t += 8
        with span("capture"):  # a part entered twice accumulates
            now.t += 16
        now.t += 32
        parts = clock.stop()
    assert parts == {"capture": 26.0, "teacher": 4.0, "other": 33.0}
    assert list(parts) == ["capture", "teacher", "other"]  # pipeline order, other last
    assert sum(parts.values()) == now.t - 100.0


def test_span_outside_a_clock_does_nothing_and_a_stopped_clock_stops_counting():
    now = FakeTime()
    with span("capture"):
        now.t += 5
    clock = StageClock(now)
    with clock:
        with span("write"):
            now.t += 3
    now.t += 7
    with span("write"):
        now.t += 11
    assert clock.stop() == {"write": 3.0, "other": 0.0}


def test_a_span_closed_by_an_exception_is_charged():
    now = FakeTime()
    with StageClock(now) as clock:
        with pytest.raises(RuntimeError), span("load"):
            now.t += 2
            raise RuntimeError("engine failed")
        now.t += 1
    assert clock.seconds == {"load": 2.0, "other": 1.0}


def test_order_and_description():
    assert list(ordered({"zeta": 1.0, "other": 1.0, "write": 1.0, "load": 1.0})) == ["load", "write", "other", "zeta"]
    assert describe({"capture": 3.0, "write": 0.97, "other": 0.03}) == "capture 3 s (75%), write 0.97 s (24%)"
    assert describe({}) == "none"
