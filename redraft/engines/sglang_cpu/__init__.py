"""SGLang 0.5.23 on a CPU: SGLang's own engine, with redraft's stand-in for its compiled CPU kernels.

What is SGLang's: the scheduler, the model code, the aux-hidden-state capture, the EAGLE worker, the
``intel_amx`` attention backend and every counter it reports. What is redraft's: the ``sgl_kernel`` module the
engine imports (``site/sgl_kernel``: the few CPU ops SGLang's CPU path calls, in plain PyTorch, tested against
SGLang's own Triton kernels) and an import hook that lets the index's CUDA-only torchvision import
(``site/sitecustomize.py``). Both are on the path of the SGLang CPU venv's processes only (``SITE``), never on a
GPU machine, where ``pip install 'redraft[sglang]'`` brings SGLang's real kernels.
"""

from __future__ import annotations

from pathlib import Path

SGLANG_VERSION = "0.5.23"  # the SGLang the stand-in was written against, and the only one it accepts
REDRAFT_STAND_IN = f"redraft-cpu-stand-in-for-sglang-{SGLANG_VERSION}"
SITE = Path(__file__).resolve().with_name("site")  # goes on PYTHONPATH of the engine's processes
