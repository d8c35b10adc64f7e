"""The CPU ops SGLang 0.5.23's own CPU path calls, written in plain PyTorch from SGLang's op semantics.

SGLang's real CPU kernels (``sgl_kernel`` built from ``sgl-kernel/csrc/cpu``) are not on any package index,
so the SGLang CPU venv (``make sglang-cpu-venv``) puts a module named ``sgl_kernel`` on the engine's path that
re-exports these functions (``redraft/engines/sglang_cpu/site/sgl_kernel``). Each is tested against SGLang's own
Triton kernel of the same job, run by the Triton interpreter (``tests/engine/sglang/test_sglang_cpu_ops.py``).

- :mod:`.cache`: request-to-token bookkeeping and KV-cache slot moves (scheduler and EAGLE worker);
- :mod:`.tree`: the EAGLE draft tree and its greedy verification (the acceptance rule itself);
- :mod:`.attention`: paged extend (prefill, verify) and decode attention behind SGLang's ``intel_amx`` backend.
"""
