"""vLLM's hidden-state extraction connector, writing synchronously so that it runs on a CPU.

Loaded by vLLM in its engine and worker processes through ``kv_transfer_config.kv_connector_module_path``
(as ``redraft.engines.vllm_plugins.redraft_capture_connector``: the driver's processes have the repository on
``PYTHONPATH``); it imports vLLM, torch and
safetensors only, since it runs under the engine's interpreter.

Why it exists: vLLM 0.32's ``ExampleHiddenStatesConnector``
(``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) copies each finished
request's hidden states out of the cache-only KV layer on a CUDA stream into pinned memory and writes the
file from a thread pool. On a CPU the worker dies there ("pin_memory=True requires a CUDA or other
accelerator backend"). This subclass keeps every scheduler-side method, the file layout
(``hidden_states`` [T, layers, H] and ``token_ids`` [T]) and the ``.lock`` protocol of the stock one, and
replaces only the copy: a plain gather from the cache and ``save_file`` in the worker's own thread, then
the lock is released. On GPUs the stock connector serves (it overlaps the copy with the next forward).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """What ``get_finished`` polls in place of a CUDA event: the write has already happened."""

    @staticmethod
    def query() -> bool:
        return True


class RedraftCaptureConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, device-agnostic write."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        tmp = pending.filename + ".part"
        try:
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)  # a reader never sees a half-written file, lock or no lock
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH go on
        self._req_copy_events[pending.req_id] = _Done()
