"""vLLM target: capture through vLLM's own hidden-state extraction, the tensors the serving engine computes.

vLLM 0.32's ``extract_hidden_states`` speculative method keeps the residual stream at the configured layers
in a cache-only KV layer, and a KV connector writes each finished request's prompt states to a safetensors
file (``hidden_states`` [T, layers, H], ``token_ids`` [T]) whose path comes back in the request's
``kv_transfer_params``. The stock ``ExampleHiddenStatesConnector`` does that on GPUs; on a CPU redraft's own
(``redraft/engines/vllm_plugins/redraft_capture_connector.py``) makes the same write synchronously. The engine
runs through :mod:`redraft.engines.vllm` (in-process where vllm is installed, else the vLLM CPU venv).

What is asked of the engine: the aux layers in vLLM's convention (``redraft.core.layers``) plus the end layer
(engine id L: the last layer's output before the final norm). The teacher is computed here from that
state with the target's final norm and lm_head, read from its weight files (fp32, in chunks): the
same top-k rule as the HF backend (``extract.teacher``), or the post-norm state itself for ``last_hidden``.

Overlap: :meth:`VLLMTarget.capture_batches` sends batch n+1 to the engine before it computes batch n's
teacher, so the engine's processes prefill while this one runs the norm and the lm_head. Sent one after the
other instead, the engine's worker spends the gap busy-polling its queue (vLLM's ``shm_broadcast``,
``busy_loop_s=1``), on a core this process needs (measured: ``docs/results/capture-speed``).

Memory and disk: prompts go to the engine one capture batch at a time (``--batch-tokens``), so at most two
batches of files exist (the one being prefilled, the one being read); each is read, checked against the
prompt's ids and removed before its features are computed, and an abandoned stream still waits for the
batch in flight and removes its files.
Regeneration (``--regen-backend hf`` with this backend) runs in the same engine; the states it also writes
for those requests are removed by the driver.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from extract.backends.base import Captured, GenerationConfig, TargetBackend, TeacherSpec
from extract.backends.sglang import read_target_info
from extract.teacher import topk_per_sequence
from extract.timing import span
from redraft.core import layers
from redraft.core.drafter.modeling import RMSNorm
from redraft.core.target_weights import final_norm_key_candidates, read_target_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CapturePlan:
    """Which engine layer ids to capture and where each of ours sits in the captured [T, layers, H] block."""

    engine_ids: tuple[int, ...]  # sorted, unique: the order vLLM stacks them in
    aux_index: tuple[int, ...]  # rows of the block holding our aux layers, ascending
    end_index: int  # row holding the last layer's pre-norm output

    @classmethod
    def for_target(cls, aux_layer_ids: Sequence[int], num_layers: int, architecture: str) -> CapturePlan:
        aux_engine = layers.to_engine_layer_ids(aux_layer_ids, "vllm", architecture)
        end = int(num_layers)  # vLLM: id L is the output of layer L-1, before the final norm
        ids = sorted({*aux_engine, end})
        return cls(engine_ids=tuple(ids), aux_index=tuple(ids.index(i) for i in aux_engine), end_index=ids.index(end))


def read_capture_file(path: str | Path, expected_ids: Sequence[int], num_layers: int,
                      hidden_size: int) -> torch.Tensor:
    """The [T, layers, H] block of one capture file, after its writer released the ``.lock`` (the stock
    connector writes from a thread); refused unless its ``token_ids`` are the prompt's. Removes both files."""
    from redraft.engines.vllm_driver import remove_capture, wait_for_capture

    path = str(path)
    wait_for_capture(path)
    try:
        data = load_file(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read vLLM's hidden-state file: {e}") from e
    finally:
        remove_capture(path)
    hidden, ids = data.get("hidden_states"), data.get("token_ids")
    if hidden is None or ids is None:
        raise ValueError(f"{path}: expected tensors hidden_states and token_ids, found {sorted(data)}")
    n = len(expected_ids)
    if ids.tolist() != [int(t) for t in expected_ids]:
        raise ValueError(f"{path}: token_ids ({ids.numel()} ids) are not the {n} prompt ids sent")
    if tuple(hidden.shape) != (n, num_layers, hidden_size):
        raise ValueError(f"{path}: hidden_states has shape {tuple(hidden.shape)}, expected {(n, num_layers, hidden_size)}")
    return hidden


class VLLMTarget(TargetBackend):
    """A target loaded by vLLM (its own processes), features through the engine's hidden-state extraction."""

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        dtype: str = "float32",
        max_length: int = 2048,
        python: str | None = None,
        kv_cache_bytes: int = 2 << 30,
        gpu_memory_utilization: float | None = None,
        capture_dir: str | None = None,
        connector: str = "auto",
        teacher_device: str = "cpu",
        trust_remote_code: bool = False,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from redraft.engines.vllm import EngineSettings, VLLMEngine

        self.info = read_target_info(path, name=name, aux_layer_ids=aux_layer_ids, trust_remote_code=trust_remote_code)
        folder = Path(self.info.path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                       trust_remote_code=trust_remote_code)
        self.max_length = int(max_length)
        self.plan = CapturePlan.for_target(self.info.aux_layer_ids, self.info.num_layers, self.info.architecture)
        self.device = torch.device(teacher_device)
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        norm_weight, norm_key = read_target_tensor(folder, final_norm_key_candidates(raw))
        self.final_norm = RMSNorm(self.info.hidden_size, self.info.rms_norm_eps)
        self.final_norm.weight.data = norm_weight.to(torch.float32)
        self.final_norm.to(self.device)
        head, _ = read_target_tensor(folder, [self.info.lm_head_key])
        self.lm_head_weight = head.to(self.device, torch.float32)
        self._own_dir = capture_dir is None
        self.capture_dir = Path(capture_dir or tempfile.mkdtemp(prefix="redraft-vllm-capture-"))
        self.capture_dir.mkdir(parents=True, exist_ok=True)
        settings = EngineSettings(
            # a capture request also asks for one output token, and vLLM refuses a prompt of max_model_len tokens:
            # one more position, so that a sample cut at exactly max_length is captured
            target=str(folder), dtype=dtype, max_model_len=self.max_length + 1, kv_cache_bytes=int(kv_cache_bytes),
            gpu_memory_utilization=gpu_memory_utilization, capture_layer_ids=list(self.plan.engine_ids),
            capture_dir=str(self.capture_dir), capture_connector=connector, engine_args=engine_args or None)
        log.info("vLLM capture of %s: aux layers %s as engine ids %s (+ end layer %d for the teacher; final norm %s), "
                 "files under %s", self.info.name, list(self.info.aux_layer_ids),
                 [self.plan.engine_ids[i] for i in self.plan.aux_index], self.info.num_layers, norm_key,
                 self.capture_dir)
        with span("load"):
            self.engine: Any = VLLMEngine(settings, python=python, timeout_s=None, what="capture (vLLM)")

    def capture(self, batch: list[list[int]], teacher: TeacherSpec) -> list[Captured]:
        """The batch's prompts prefilled together by the engine; each file read, checked and removed."""
        if not batch:
            return []
        return self._features(self._engine_states(batch), [len(seq) for seq in batch], teacher)

    def capture_batches(self, batches: Iterable[list[list[int]]], teacher: TeacherSpec) -> Iterator[list[Captured]]:
        """Each batch's features, in order, with the engine prefilling the next batch (in a helper thread that
        only waits on the engine and reads its files) while this thread computes the current one's."""
        pending: tuple[list[list[int]], Future] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="redraft-vllm-capture") as pool:
            try:
                todo = iter(batches)

                def send() -> tuple[list[list[int]], Future] | None:
                    batch = next(todo, None)
                    return None if batch is None else (batch, pool.submit(self._engine_states, batch))

                pending = send()
                while pending is not None:
                    batch, states = pending[0], pending[1].result()
                    pending = send()
                    yield self._features(states, [len(seq) for seq in batch], teacher) if batch else []
            finally:
                if pending is not None:  # abandoned mid-stream: let the batch in flight finish, files removed
                    pending[1].exception()

    def _engine_states(self, batch: list[list[int]]) -> torch.Tensor:
        """The engine's part of one batch: the prefill, then every request's file read, checked, removed;
        the [sum T, layers, H] block of the batch."""
        if not batch:
            return torch.empty(0, len(self.plan.engine_ids), self.info.hidden_size)
        bad = [i for i, seq in enumerate(batch) if not 0 < len(seq) <= self.max_length]
        if bad:
            i = bad[0]
            raise ValueError(f"sequence #{i} has {len(batch[i])} tokens; expected 1..max_length={self.max_length}")
        rows = self._engine().capture(batch)
        if len(rows) != len(batch):
            raise ValueError(f"vLLM returned {len(rows)} captures for {len(batch)} prompts")
        n_layers, hidden = len(self.plan.engine_ids), self.info.hidden_size
        return torch.cat([read_capture_file(r["hidden_states_path"], seq, n_layers, hidden)
                          for r, seq in zip(rows, batch, strict=True)])

    @torch.inference_mode()
    def _features(self, block: torch.Tensor, lengths: list[int], teacher: TeacherSpec) -> list[Captured]:
        """The batch's [sum T, layers, H] block -> per-sequence Captured; the norm and the teacher run once for
        the whole batch (one large matmul, not one per sequence)."""
        aux = block[:, list(self.plan.aux_index)].to(torch.float32).reshape(block.shape[0], -1)
        final = self.final_norm(block[:, self.plan.end_index].to(self.device, torch.float32))
        ids = lps = None
        if "topk" in teacher.kinds:
            ids, lps = topk_per_sequence(final, lengths, self.lm_head_weight, teacher.topk, teacher.chunk_tokens)
        lasts = final.to("cpu").split(lengths) if "last_hidden" in teacher.kinds else None
        return [Captured(aux_hidden=a, topk_ids=None if ids is None else ids[i],
                         topk_logprobs=None if lps is None else lps[i],
                         last_hidden=None if lasts is None else lasts[i])
                for i, a in enumerate(aux.split(lengths))]

    def generate(self, prompts: list[list[int]], gen: GenerationConfig, stop_ids: list[int],
                 seeds: list[int] | None = None) -> list[list[int]]:
        """Regeneration in the capturing engine: every prompt at once, stopping at exactly ``stop_ids``."""
        from extract.regen_engines import token_requests

        if not prompts:
            return []
        reqs = token_requests(prompts, [gen.max_new_tokens] * len(prompts), gen, stop_ids, seeds)
        return [list(r["output_token_ids"]) for r in self._engine().generate(reqs)]

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("the vLLM engine was shut down (close() was called)")
        return self.engine

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()
        if getattr(self, "_own_dir", False) and self.capture_dir.exists():
            shutil.rmtree(self.capture_dir, ignore_errors=True)
