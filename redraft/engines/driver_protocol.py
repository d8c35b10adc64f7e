"""The line protocol between redraft and an engine driver running under the engine's own interpreter.

Both sides live here, standard library only, because the child side runs inside an engine's venv (vLLM CPU,
SGLang CPU) where nothing of redraft's dependencies is installed; the driver modules
(``redraft/engines/vllm_driver.py``, ``redraft/engines/sglang_driver.py``) are started as ``python -m`` with the
repository on ``PYTHONPATH`` and import this module and their engine, nothing else of redraft.

Protocol: one JSON object per line. The first line on stdin is the engine settings; the driver answers
``{"event": "ready", ...}`` (fields of the driver's choosing: version, load seconds). Each command
(``{"op": ...}``) is answered by ``{"event": "progress", "done", "of"}`` lines and one
``{"event": "result", "results": [...]}``; ``{"op": "exit"}`` ends it. A failure is
``{"event": "error", "error": traceback}``. The protocol goes to a private copy of stdout; fd 1 itself is
pointed at stderr (the log file) before the engine loads, so nothing the engine prints can corrupt it.

:class:`DriverProcess` is the parent's side: the driver in its own process group (engines fork workers and
some kill their parent when one dies: SGLang does), killed as a group on timeouts, interrupts and close, its
log's first traceback quoted when it fails, so that redraft's message survives whatever the engine does.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from redraft.core.errors import Failure

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


class EngineError(Failure):
    """The engine cannot be run as asked (missing venv, failed or stopped engine); the message says what to do."""


# ----------------------------------------------------------------------------------------------- child side


class Driver(Protocol):
    """What :func:`serve` needs of a loaded engine."""

    def ready_fields(self) -> dict[str, Any]: ...

    def run(self, cmd: dict[str, Any], progress: Progress | None = None) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def serve(make_driver: Callable[[dict[str, Any]], Driver], inp: Any, proto: Any) -> int:
    """The driver loop: settings, then commands until exit or end of input."""

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    line = inp.readline()
    if not line:
        return 2
    try:
        driver = make_driver(json.loads(line))
    except Exception:
        send({"event": "error", "error": traceback.format_exc()})
        return 1
    send({"event": "ready", **driver.ready_fields()})
    try:
        for line in inp:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd.get("op") == "exit":
                break
            try:
                rows = driver.run(cmd, progress=lambda done, of: send({"event": "progress", "done": done, "of": of}))
            except Exception:
                send({"event": "error", "error": traceback.format_exc()})
                return 1
            send({"event": "result", "results": rows})
    finally:
        driver.close()
    return 0


def take_engine_down_with_us() -> None:
    """On SIGTERM (sent by the runner, or by the kernel when the runner dies), kill this process group.

    Engines run their cores and workers as child processes that outlive the driver when it dies alone; the
    runner starts the driver as its own group's leader, so the group is the driver and the engine. Run by hand
    in someone else's group, the default SIGTERM stays (it must not kill the caller).
    """
    if os.getpgrp() != os.getpid():
        return

    def _kill_group(signum: int, frame: Any) -> None:
        os.killpg(os.getpid(), signal.SIGKILL)

    signal.signal(signal.SIGTERM, _kill_group)


def driver_main(argv: list[str], make_driver: Callable[[dict[str, Any]], Driver], usage: str) -> int:
    """A driver module's ``main``: the protocol on a private copy of stdout, everything else to the log."""
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    take_engine_down_with_us()
    proto = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout ...
    os.dup2(2, 1)  # ... and everything else that writes to fd 1 (the engine, its workers) goes to the log
    sys.stdout = sys.stderr
    return serve(make_driver, sys.stdin, proto)


# ---------------------------------------------------------------------------------------------- parent side

REPO_ROOT = Path(__file__).resolve().parents[2]


class DriverProcess:
    """A driver module started under another interpreter (``python -m module``), spoken to by the protocol.

    timeout_s bounds the load and each command (None: no bound; a driver that dies is noticed either way).
    what: the name used in log lines and errors. env: the child's whole environment; the repository root is
    put first on its ``PYTHONPATH`` (the driver modules import this file).
    """

    def __init__(self, python: str, module: str, settings: dict[str, Any], *, env: dict[str, str],
                 timeout_s: float | None, what: str) -> None:
        self.python, self.module, self.what, self.timeout_s = python, module, what, timeout_s
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"redraft-{what.lower().split()[0]}-")
        self.log_path = Path(self._tmp.name, "engine.log")
        env = dict(env)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *[p for p in env.get("PYTHONPATH", "").split(
            os.pathsep) if p and p != str(REPO_ROOT)]])
        t0 = time.perf_counter()
        logf = open(self.log_path, "w")  # noqa: SIM115 - the child holds it; closed below
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [python, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, env=env,
                text=True, errors="replace", start_new_session=True, preexec_fn=die_with_parent)
        finally:
            logf.close()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self._send(settings)
            self.ready = self._wait("ready", t0, "loading the model")
        except BaseException:
            self.close(graceful=False)
            raise
        self.load_seconds = float(self.ready.get("load_seconds", time.perf_counter() - t0))

    def _pump(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def close(self, graceful: bool = True) -> None:
        """Stop the driver and its engine (the whole process group); safe to call twice. graceful: ask the
        driver to exit first (up to 30 s); else kill it at once (errors, interrupts)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if graceful and proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    proc.stdin.flush()
                    proc.stdin.close()
                    proc.wait(timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            kill_group(proc)
            proc.wait()
        self._tmp.cleanup()

    def call(self, cmd: dict[str, Any], n: int, unit: str) -> list[dict[str, Any]]:
        """Send one command and collect its result, logging progress every 15 s."""
        t0 = time.perf_counter()
        progress = progress_logger(self.what, unit)
        if self._proc is None:
            raise EngineError(f"{self.what}: the engine was closed")
        try:
            self._send(cmd)
            while True:
                msg = self._wait(("progress", "result"), t0, f"{n} {unit}")
                if msg["event"] == "result":
                    return list(msg["results"])
                progress(int(msg["done"]), int(msg["of"]))
        except BaseException:
            self.close(graceful=False)
            raise

    def _send(self, obj: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise self._failure(f"the engine is gone ({e})") from None

    def _wait(self, events: str | tuple[str, ...], t0: float, doing: str) -> dict[str, Any]:
        want = (events,) if isinstance(events, str) else events
        while True:
            left = None if self.timeout_s is None else self.timeout_s - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                raise self._failure(f"{doing}: the engine ran past {self.timeout_s:g} s and was stopped")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                rc = self._proc.wait() if self._proc is not None else None
                raise self._failure(f"{doing}: the engine failed (exit {rc}, {self.python})")
            try:
                msg = json.loads(line)
            except ValueError:
                log.debug("%s: not a protocol line: %s", self.what, line.rstrip())
                continue
            if msg.get("event") == "error":
                raise self._failure(f"{doing}: the engine failed (exit {self._proc.poll() if self._proc else None}, "
                                    f"{self.python}):\n{msg.get('error', '').rstrip()}")
            if msg.get("event") in want:
                return msg

    def _failure(self, what: str) -> EngineError:
        excerpt = log_excerpt(self.log_path)
        if self._proc is not None:
            kill_group(self._proc)
        return EngineError(f"{self.what}: {what}; {excerpt}")


class ServerProcess:
    """An engine's HTTP server on 127.0.0.1 (context manager): started as ``cmd`` in its own process group with
    its output in a log file, ready when ``ready_path`` answers 200, stopped as a group (SIGTERM, then SIGKILL).
    EngineError quoting the log's first traceback when it exits or is not ready within ``timeout_s``."""

    def __init__(self, cmd: list[str], *, env: dict[str, str], url: str, ready_path: str, what: str,
                 timeout_s: float) -> None:
        self.url, self.what = url, what
        self._tmp = tempfile.TemporaryDirectory(prefix=f"redraft-{what.lower().split()[0]}-serve-")
        self.log_path = Path(self._tmp.name, "server.log")
        log.info("%s: %s on %s (log %s)", what, cmd[0], url, self.log_path)
        t0 = time.perf_counter()
        with open(self.log_path, "w") as logf:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=die_with_parent)
        try:
            self._wait_ready(ready_path, t0, timeout_s)
        except BaseException:
            self.close()
            raise
        self.load_seconds = time.perf_counter() - t0
        log.info("%s: ready in %.0f s", what, self.load_seconds)

    def _wait_ready(self, path: str, t0: float, timeout_s: float) -> None:
        import urllib.error
        import urllib.request

        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise EngineError(f"{self.what}: exited with {self._proc.returncode} before it was ready; "
                                  f"{log_excerpt(self.log_path)}")
            if time.perf_counter() - t0 > timeout_s:
                raise EngineError(f"{self.what}: not ready after {timeout_s:g} s; {log_excerpt(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=20)
                except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                    pass
            kill_group(proc)
            proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_logger(what: str, unit: str) -> Progress:
    """A progress callback that logs a line per 15 s and one at the end."""
    t0 = time.perf_counter()
    last = [t0]

    def progress(done: int, of: int) -> None:
        now = time.perf_counter()
        if done == of or now - last[0] >= 15:
            last[0] = now
            log.info("%s: %d/%d %s (%.0f s)", what, done, of, unit, now - t0)

    return progress


def die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the process that started it dies, so that an engine
    whose extraction, test or benchmark was killed does not outlive it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def log_excerpt(path: Path | None, tail: int = 40, traceback: int = 60) -> str:
    """An engine log's first traceback (when its tail does not hold it) and its tail, for an error message.
    Engines report a worker that failed to start as "see root cause above" (vLLM) or die by a signal from a
    dying child (SGLang): the cause is the first traceback, printed long before the log's tail."""
    text = path.read_text(errors="replace").splitlines() if path is not None and path.is_file() else []
    start = next((i for i, s in enumerate(text) if "Traceback (most recent call last)" in s), None)
    quote = "\n".join("  " + s for s in text[-tail:])
    if start is None or start >= len(text) - tail:
        return f"its log ends with:\n{quote}"
    first = "\n".join("  " + s for s in text[start:min(start + traceback, len(text) - tail)])  # not the tail again
    return f"the first error in its log:\n{first}\nand its log ends with:\n{quote}"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
