"""What an engine failure quotes of the engine's log: the worker's traceback, not only vLLM's "see root cause above"."""

from __future__ import annotations

from redraft.engines.driver_protocol import log_excerpt as _log_excerpt


def test_the_first_traceback_is_quoted_when_the_tail_does_not_hold_it(tmp_path):
    log = tmp_path / "engine.log"
    lines = ["(Worker) Traceback (most recent call last):", "(Worker) RuntimeError: expect weight to be bfloat16"]
    log.write_text("\n".join(["starting"] + lines + [f"shutdown {i}" for i in range(50)]) + "\n")
    excerpt = _log_excerpt(log)
    assert "RuntimeError: expect weight to be bfloat16" in excerpt and "shutdown 49" in excerpt
    assert excerpt.index("the first error") < excerpt.index("its log ends with") < excerpt.index("shutdown 10")


def test_a_short_log_is_quoted_once(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("a\nTraceback (most recent call last):\nValueError: x\n")
    assert _log_excerpt(log) == "its log ends with:\n  a\n  Traceback (most recent call last):\n  ValueError: x"
    assert _log_excerpt(tmp_path / "missing.log") == "its log ends with:\n"
