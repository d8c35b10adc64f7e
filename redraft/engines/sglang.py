"""The one SGLang runner: find the engine's python, start ``sglang.Engine`` in a driver subprocess, speak to it.

Used by ``extract --backend sglang`` (aux-hidden-state capture, regeneration) and by evaluation
(``eval.online --engine sglang``: generation with SGLang's own per-request speculative counters).

Where the engine runs, in this order:

1. ``python=`` (``--engine-python``): that interpreter;
2. SGLang importable in this interpreter (a GPU machine with ``pip install 'redraft[sglang]'``): this one;
3. the SGLang CPU venv (``$SGLANG_CPU_VENV``, default ``~/.cache/redraft/sglang-cpu``, built by
   ``make sglang-cpu-venv``): its interpreter, with redraft's stand-in for SGLang's CPU kernels on the path
   (:mod:`redraft.engines.sglang_cpu`) and the engine told to run on the CPU (:func:`cpu_engine_kwargs`).

Always a subprocess (:mod:`redraft.engines.sglang_driver`): SGLang kills its parent when a scheduler process dies,
and that parent must be the driver, so that redraft survives to say what failed (the engine log's first
traceback) instead of dying by SIGKILL with nothing of its own printed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from redraft.engines.driver_protocol import DriverProcess, EngineError, ServerProcess, free_port
from redraft.engines.request import TokenRequest
from redraft.engines.sglang_cpu import SGLANG_VERSION, SITE

log = logging.getLogger(__name__)

DRIVER = "redraft.engines.sglang_driver"
DEFAULT_VENV = Path.home() / ".cache" / "redraft" / "sglang-cpu"  # where `make sglang-cpu-venv` builds it
STAMP = ".redraft-sglang-cpu"  # written by scripts/make_sglang_cpu_venv.sh: marks the CPU venv
MAKE_HINT = ("build it with `make sglang-cpu-venv` (scripts/make_sglang_cpu_venv.sh: SGLang 0.5.23 on the CPU "
             "build of torch, about 2 min and 3.5 GB), set SGLANG_CPU_VENV to where it is, or pass --engine-python")

# On the CPU stand-in the attention runs on SGLang's intel_amx backend, whose two ops the stand-in provides;
# its other CPU choices fail here: torch_native refuses EAGLE and cannot run MLA, triton needs the (slow)
# interpreter. SGLang 0.5.23 falls back from intel_amx to torch_native when the machine reports no AMX packing
# (the stand-in reports none), so the backend is named for prefill and decode, which that fallback leaves alone.
CPU_ATTENTION = "intel_amx"
ATTENTION_KEYS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                  "speculative_draft_attention_backend")
CPU_KV_TOKENS = 16384  # the KV pool on the CPU stand-in, unless max_total_tokens is given (SGLang's default
# takes a fraction of the host's memory and spends tens of seconds allocating it)
CPU_REFUSED = {
    "enable_torch_compile": "torch.compile of SGLang's CPU path is not part of what the stand-in was tested with",
    "tp_size": "one CPU process serves here; tensor parallelism needs SGLang's CPU all-reduce kernels",
}


class EngineRuntime:
    """Which interpreter runs SGLang and whether it is the CPU venv (the stand-in's)."""

    def __init__(self, python: str, source: str, stand_in: bool) -> None:
        self.python, self.source, self.stand_in = python, source, stand_in


def installed_version(python: str) -> str | None:
    """The SGLang version in a venv, read from its site-packages without starting it (None: not found)."""
    root = Path(python).absolute().parent.parent
    for dist in sorted(root.glob("lib/python*/site-packages/sglang-*.dist-info")):
        return dist.name[len("sglang-"):-len(".dist-info")]
    return None


def engine_runtime(explicit: str | None = None) -> EngineRuntime:
    """Where SGLang runs; EngineError naming the make target when there is nowhere, or when the CPU venv holds an
    SGLang other than the one the stand-in was written for."""
    if explicit:
        if not Path(explicit).is_file():
            raise EngineError(f"--engine-python {explicit}: no such file")
        runtime = EngineRuntime(explicit, "--engine-python", (Path(explicit).absolute().parent.parent / STAMP).is_file())
    elif importlib.util.find_spec("sglang") is not None:
        runtime = EngineRuntime(sys.executable, "this interpreter (sglang installed)", False)
    else:
        venv = Path(os.environ.get("SGLANG_CPU_VENV") or DEFAULT_VENV)
        py = venv / "bin" / "python"
        if not py.is_file():
            raise EngineError(f"no SGLang to run: sglang is not installed here and the SGLang CPU venv {venv} is "
                              "missing; " + MAKE_HINT)
        runtime = EngineRuntime(str(py), f"SGLang CPU venv {venv}", True)
    if runtime.stand_in:
        version = installed_version(runtime.python)
        if version != SGLANG_VERSION:
            raise EngineError(f"{runtime.python}: SGLang {version or '(none)'} is installed, but redraft's CPU "
                              f"stand-in for SGLang's kernels was written for SGLang {SGLANG_VERSION} only; rebuild "
                              "the venv with `make sglang-cpu-venv`")
    return runtime


def engine_env(runtime: EngineRuntime, threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: offline hub; on the CPU venv, SGLang's CPU engine and the stand-in's folder."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if runtime.stand_in:
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it, --device cpu imports vllm in SGLang's rotary embedding
        env.setdefault("OMP_NUM_THREADS", str(threads or os.cpu_count() or 2))
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE)]
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), *paths])
    env.update(extra or {})
    return env


def cpu_engine_kwargs(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``sglang.Engine`` arguments for the CPU stand-in: the device and the attention backend set, settings that
    would break capture or speculation there refused by key (before the engine starts)."""
    for key in ATTENTION_KEYS:
        value = engine_kwargs.get(key)
        if value not in (None, CPU_ATTENTION):
            raise ValueError(f"engine_args[{key!r}]={value!r}: on a CPU redraft runs SGLang's {CPU_ATTENTION} "
                             "attention backend (its two ops are the stand-in's); torch_native refuses EAGLE and "
                             "cannot run MLA targets, and triton needs the Triton interpreter")
    for key, why in CPU_REFUSED.items():
        value = engine_kwargs.get(key)
        if value not in (None, False, 1):
            raise ValueError(f"engine_args[{key!r}]={value!r} is not supported on the CPU stand-in: {why}")
    if engine_kwargs.get("device") not in (None, "cpu"):
        raise ValueError(f"engine_args['device']={engine_kwargs['device']!r}: the SGLang CPU venv runs on the CPU")
    # sleep_on_idle: an idle scheduler otherwise polls its sockets in a loop and holds a core (measured here: 1.0
    # CPU-second per second idle, 0.02 with it), which halves whatever runs beside it on a 2-core machine, such as a
    # second server the doctor measures against; a request still wakes it at once (zmq poll on the same sockets)
    return {"max_total_tokens": CPU_KV_TOKENS, "sleep_on_idle": True, **engine_kwargs, "device": "cpu",
            "prefill_attention_backend": CPU_ATTENTION, "decode_attention_backend": CPU_ATTENTION}


class SGLangEngine:
    """A started ``sglang.Engine`` in its driver (context manager); ``close`` stops it and its processes.

    engine_kwargs: ``sglang.Engine`` arguments (on the CPU venv completed by :func:`cpu_engine_kwargs`).
    capture_dir / aux_width: for :meth:`capture`. timeout_s bounds the load and each call (None: no bound).
    """

    def __init__(self, engine_kwargs: Mapping[str, Any], *, python: str | None = None,
                 capture_dir: str | None = None, aux_width: int | None = None, timeout_s: float | None = 3600,
                 extra_env: dict[str, str] | None = None, what: str = "SGLang") -> None:
        self.runtime = engine_runtime(python)
        self.what = what
        kwargs = cpu_engine_kwargs(engine_kwargs) if self.runtime.stand_in else dict(engine_kwargs)
        self.engine_kwargs = kwargs
        settings = {"engine_kwargs": kwargs, "capture_dir": capture_dir, "aux_width": aux_width,
                    "sglang_version": SGLANG_VERSION if self.runtime.stand_in else None}
        log.info("%s: engine %s (%s%s)", what, self.runtime.python, self.runtime.source,
                 "; SGLang's own engine, redraft's stand-in for its CPU kernels" if self.runtime.stand_in else "")
        self._process: DriverProcess | None = DriverProcess(
            self.runtime.python, DRIVER, settings, env=engine_env(self.runtime, extra=extra_env),
            timeout_s=timeout_s, what=what)
        ready = self._process.ready
        self.version: str | None = ready.get("sglang_version")
        self.load_seconds = float(ready.get("load_seconds", 0.0))
        self.max_running_requests = ready.get("max_running_requests")
        self.max_total_num_tokens = ready.get("max_total_num_tokens")
        log.info("%s: SGLang %s loaded in %.0f s (max_running_requests %s)", what, self.version, self.load_seconds,
                 self.max_running_requests)

    def capture(self, prompts: list[list[int]], top_k: int) -> list[dict[str, Any]]:
        """Prefill each prompt once; one row per prompt, in order: ``path`` (a safetensors file of ``aux_hidden``,
        ``topk_ids``, ``topk_logprobs``, ``input_ids``; the caller reads and removes it) and ``tokens``."""
        payload = [{"id": str(i), "input_ids": [int(t) for t in p], "top_k": int(top_k)} for i, p in enumerate(prompts)]
        return self._call({"op": "capture", "requests": payload}, len(payload), "prompts")

    def generate(self, requests: list[TokenRequest], *, sequential: bool = False) -> list[dict[str, Any]]:
        """One row per request, in order: ``id``, ``output_token_ids`` (the stop id included), ``finish_reason``,
        ``seconds``, and on a speculating engine SGLang's own counters of that request
        (:func:`redraft.engines.sglang_driver.spec_counters`)."""
        payload = [asdict(r) for r in requests]
        return self._call({"op": "generate", "requests": payload, "sequential": sequential}, len(payload),
                          "requests")

    def _call(self, cmd: dict[str, Any], n: int, unit: str) -> list[dict[str, Any]]:
        if self._process is None:
            raise EngineError(f"{self.what}: the engine was closed")
        return self._process.call(cmd, n, unit)

    def close(self, graceful: bool = True) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.close(graceful=graceful)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(graceful=exc[0] is None)


def server_flags(kwargs: Mapping[str, Any]) -> list[str]:
    """``sglang.Engine`` keyword arguments as ``launch_server`` flags (the same ``ServerArgs`` fields): ``a_b=v``
    is ``--a-b v``, True a bare flag, False and None left out."""
    out: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


class SGLangServer(ServerProcess):
    """``python -m sglang.launch_server`` on 127.0.0.1 (context manager), with the same runtime, CPU settings and
    refusals as :class:`SGLangEngine`; ready when ``/model_info`` answers (its own warm-up is skipped: the
    benchmark warms up itself). For ``serve.tune --engine sglang`` and tests of the server path."""

    def __init__(self, engine_kwargs: Mapping[str, Any], *, python: str | None = None, port: int = 0,
                 timeout_s: float = 900, extra_env: dict[str, str] | None = None) -> None:
        self.runtime = engine_runtime(python)
        kwargs = cpu_engine_kwargs(engine_kwargs) if self.runtime.stand_in else dict(engine_kwargs)
        self.port = port or free_port()
        kwargs.update(host="127.0.0.1", port=self.port, skip_server_warmup=True)
        self.engine_kwargs = kwargs
        super().__init__([self.runtime.python, "-m", "sglang.launch_server", *server_flags(kwargs)],
                         env=engine_env(self.runtime, extra=extra_env), url=f"http://127.0.0.1:{self.port}",
                         ready_path="/model_info", what="SGLang server", timeout_s=timeout_s)

    def __enter__(self) -> SGLangServer:
        return self
