"""Imported at start-up by the engine venv's python in the conformance lane (check_engines.py puts
this folder on PYTHONPATH): vLLM sees no AMX tiles, so it loads weights with its portable CPU path.

Why: the engine venv carries vLLM's CUDA wheel (the loaders under test are the same Python code on
every device), whose C extension has none of vLLM's CPU kernels. On CPUs with AMX, vLLM's CPU
linear dispatch (vllm/model_executor/layers/utils.py, check_cpu_sgl_kernel) packs small bf16
weights with ``torch.ops._C.convert_weight_packed``, which that wheel lacks, and the load check
would fail on the CPU instead of the checkpoint. The check loads weights and runs no kernels, so
the portable path checks exactly the same key set and shapes.
"""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
