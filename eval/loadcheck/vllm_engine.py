"""vLLM 0.33.0's own draft model and loader, on vLLM's CPU platform, with no patch.

The path is vLLM's engine start-up for EAGLE-3: ``EngineArgs(model=TARGET, speculative_config=
{"method": "eagle3", "model": DRAFT}).create_engine_config()`` wraps the draft config in
``EAGLEConfig`` and resolves its architecture through the registry (``Eagle3LlamaForCausalLM`` in
``llama_eagle3.py``; ``Eagle3DeepseekV2ForCausalLM`` in ``deepseek_eagle3.py``), then
``model_loader.utils.initialize_model`` builds it and ``DefaultModelLoader.load_weights`` +
``process_weights_after_loading`` load it.

vLLM validates the draft config against its own rules on the way: a draft whose ``model_type`` is
``deepseek_v3`` is rewritten to DeepSeek MTP (so MLA EAGLE-3 drafters say ``deepseek_v2``), and a
draft with MoE keys is not a dense EAGLE-3 layer. Those refusals surface as build failures (FAIL).
``VLLM_TARGET_DEVICE=cpu`` selects vLLM's own CPU platform; the target config is a file in a
temporary folder (given or synthesised, ``targets.py``), removed afterwards.

One patch, for CPUs with AMX tiles only: ``torch.cpu._is_amx_tile_supported`` answers False. The
engine venv carries vLLM's CUDA wheel (the loaders are the same Python on every device), whose C
extension has none of vLLM's CPU kernels; on an AMX CPU, vLLM's CPU linear dispatch
(``layers/utils.py``, ``check_cpu_sgl_kernel``) would pack small bf16 weights with
``torch.ops._C.convert_weight_packed``, which that wheel lacks, and the check would fail on the
machine instead of the checkpoint. No kernel runs here, so the portable path loads the same keys
into the same shapes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eval.loadcheck.check import SetupError
from eval.loadcheck.folder import DrafterFolder
from eval.loadcheck.layout import stacked_shards
from eval.loadcheck.probe import Shard, sentinel_fill, written_spans
from eval.loadcheck.sglang_engine import free_port
from eval.loadcheck.targets import target_config
from redraft.engines.launch import vllm_speculative_config

EMBED = "model.embed_tokens.weight"
MASK_HIDDEN = "mask_hidden"  # P-EAGLE's learned state: a buffer of the top-level model in vLLM (llama_eagle3.py)


def _mask_hidden_as_parameter(model: torch.nn.Module) -> torch.nn.Module:
    """vLLM keeps P-EAGLE's ``mask_hidden`` as a buffer, which the check (over parameters) would not see: make
    it a parameter of the same name, shape and dtype, so its load is checked as every other tensor's is."""
    buf = model._buffers.get(MASK_HIDDEN)
    if buf is not None:
        del model._buffers[MASK_HIDDEN]
        model.register_parameter(MASK_HIDDEN, torch.nn.Parameter(buf, requires_grad=False))
    return model


class VLLMEngine:
    name = "vllm"

    def __init__(self, folder: DrafterFolder, context_length: int | None = None,
                 target: str | Path | None = None) -> None:
        self.folder = folder
        self.context_length = context_length
        self.target: dict[str, Any] = target_config(folder, target, context_length)
        self.version = ""
        self.tmp: str | None = None

    def build(self) -> torch.nn.Module:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        torch.cpu._is_amx_tile_supported = lambda: False
        try:
            import vllm
            from vllm.config import set_current_vllm_config
            from vllm.distributed.parallel_state import (
                ensure_model_parallel_initialized,
                init_distributed_environment,
            )
            from vllm.engine.arg_utils import EngineArgs
            from vllm.model_executor.model_loader import get_model_loader
            from vllm.model_executor.model_loader.utils import get_draft_load_config, initialize_model
            from vllm.utils.torch_utils import set_default_torch_dtype
        except Exception as e:  # noqa: BLE001 - not installed or broken: the check cannot run
            raise SetupError(f"vllm is not importable here: {type(e).__name__}: {e}") from e
        self.version = f"vllm {vllm.__version__}"
        self._set_config = set_current_vllm_config
        self.tmp = tempfile.mkdtemp(prefix="redraft_engine_load_target_")
        Path(self.tmp, "config.json").write_text(json.dumps(self.target, indent=1))
        positions = int(self.folder.config.get("max_position_embeddings") or 2048)
        max_len = self.context_length or min(2048, positions)
        args = EngineArgs(model=self.tmp, skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_len,
                          speculative_config=vllm_speculative_config(self.folder.path, 3))
        self.vllm_config = args.create_engine_config()  # a draft config vLLM refuses raises here: FAIL
        try:
            with set_current_vllm_config(self.vllm_config):
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
                ensure_model_parallel_initialized(1, 1)
        except Exception as e:  # noqa: BLE001
            raise SetupError(f"vllm parallel context could not be set up: {type(e).__name__}: {e}") from e
        self.draft_config = self.vllm_config.speculative_config.draft_model_config
        self._target_vocab = int(self.vllm_config.model_config.get_vocab_size())
        self._target_hidden = int(self.vllm_config.model_config.get_hidden_size())
        self.loader = get_model_loader(get_draft_load_config(self.vllm_config))
        with set_current_vllm_config(self.vllm_config), set_default_torch_dtype(self.draft_config.dtype), \
                torch.device("cpu"):
            model = initialize_model(vllm_config=self.vllm_config, model_config=self.draft_config)
        return _mask_hidden_as_parameter(model)

    def load_all(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        with self._set_config(self.vllm_config):
            self.loader.load_weights(model, self.draft_config)
            process_weights_after_loading(model, self.draft_config, torch.device("cpu"))

    def load_keys(self, model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        """``load_weights`` on ``items``. A parallel-drafting model refuses any load without ``mask_hidden``, so
        a key tried alone carries the folder's along; what that wrote is then reset, not credited to the key."""
        along = []
        mask = self.folder.tensors().get(MASK_HIDDEN) if isinstance(getattr(model, MASK_HIDDEN, None),
                                                                     torch.nn.Parameter) else None
        if mask is not None and all(MASK_HIDDEN not in key for key, _ in items):
            along = [(MASK_HIDDEN, mask)]
        with self._set_config(self.vllm_config):
            model.load_weights(iter(items + along))
        if along:
            sentinel_fill([getattr(model, MASK_HIDDEN)])

    def reset(self, model: torch.nn.Module) -> None:
        pass  # the map is a parameter here (draft_id_to_target_id): the sentinel resets it

    def vocab_map(self, model: torch.nn.Module) -> torch.Tensor | None:
        p = getattr(model, "draft_id_to_target_id", None)
        if p is None or not written_spans(p):
            return None
        return p.detach() + torch.arange(p.shape[0])

    def vocab_map_required(self, model: torch.nn.Module) -> bool:
        return getattr(model, "draft_id_to_target_id", None) is not None

    def target_vocab(self, model: torch.nn.Module) -> int:
        return self._target_vocab

    def provided_by_target(self, name: str, model: torch.nn.Module) -> str | None:
        c = model.config
        if name == EMBED and not getattr(model, "has_own_embed_tokens", False) \
                and self._target_hidden == int(c.hidden_size):
            return "no embed_tokens in the checkpoint: the proposer shares the target's (same hidden size)"
        if name == "lm_head.weight" and not getattr(model, "has_own_lm_head", False) \
                and int(c.draft_vocab_size) == self._target_vocab:
            return "no lm_head in the checkpoint and draft vocab = target vocab: the proposer shares the target's"
        return None

    def shards(self, model: torch.nn.Module) -> dict[str, list[Shard]]:
        rows = [(n, p.shape[0]) for n, p in model.named_parameters() if p.dim()]
        return stacked_shards(rows, self.folder.config)

    def partners(self, key: str, keys: Sequence[str]) -> list[str]:
        return []  # vLLM's stacked mapper loads q_a_proj and kv_a_proj_with_mqa into their shards one by one

    def cleanup(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
