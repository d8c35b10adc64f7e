"""The real SmolLM2-135M-Instruct target, converted at most once per test session.

Conversion takes ~25-40 s, so every slow test that needs the real model calls :func:`smollm2_dir`.
When ``REDRAFT_CACHE`` is set by the environment the real cache is used (and kept); otherwise a
temporary cache is created and removed when the interpreter exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from core.embedded import CACHE_ENV, resolve_target

SMOLLM2 = "smollm2-135m-instruct"
_CONVERTED: dict[str, Path] = {}
_TMP_CACHE: list[str] = []


def _session_cache() -> str:
    if not _TMP_CACHE:
        tmp = tempfile.mkdtemp(prefix="redraft-test-cache-")
        atexit.register(shutil.rmtree, tmp, True)
        _TMP_CACHE.append(tmp)
    return _TMP_CACHE[0]


def smollm2_dir(dtype: str = "float32") -> Path:
    """The converted HF folder of the built-in SmolLM2 target (converted once per session and dtype)."""
    if dtype in _CONVERTED:
        return _CONVERTED[dtype]
    if os.environ.get(CACHE_ENV):
        path = resolve_target(SMOLLM2, dtype=dtype)
    else:
        old = os.environ.get(CACHE_ENV)
        os.environ[CACHE_ENV] = _session_cache()
        try:
            path = resolve_target(SMOLLM2, dtype=dtype)
        finally:
            if old is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = old
    _CONVERTED[dtype] = path
    return path
