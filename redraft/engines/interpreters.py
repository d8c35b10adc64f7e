"""Which interpreter runs an engine: the one given, this one when it has the engine, else the engine's CPU venv.

Above both runners (``redraft.engines.sglang``, ``redraft.engines.vllm``), so that neither imports the other and the
launch lines (``redraft.engines.launch``) import neither.
"""

from __future__ import annotations

from redraft.engines.sglang import engine_runtime
from redraft.engines.vllm import engine_python


def engine_interpreter(engine: str, python: str | None) -> tuple[str, str]:
    """(interpreter, where it came from) that runs ``engine`` (``python``, else this one if it has the engine, else
    its CPU venv); the runners' EngineError, naming the make target, when there is none."""
    if engine == "sglang":
        runtime = engine_runtime(python)
        return runtime.python, runtime.source
    return engine_python(python)
