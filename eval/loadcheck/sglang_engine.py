"""SGLang 0.5.23's own draft model and loader, on CPU, in a world-size-1 gloo context.

The path is SGLang's server start-up for a draft model: ``ModelConfig(is_draft_model=True,
speculative_algorithm="EAGLE3")`` resolves the architecture through SGLang's registry
(``LlamaForCausalLMEagle3`` in ``llama_eagle3.py``; ``Eagle3DeepseekV2ForCausalLM`` in
``kimi_k25_eagle3.py``, there is no ``deepseek_eagle3.py`` in this version), then
``DefaultModelLoader.initialize_model_for_startup`` builds it and ``resolve_model_weights`` +
``commit_model_weights`` run the safetensors iterator, ``load_weights`` and post-processing.

The parallel context is set up the way SGLang's own layer tests do (``init_distributed_environment``
with gloo, ``publish`` of a CPU ``ServerArgs``, ``initialize_model_parallel``), written out here
because importing ``sglang.test`` pulls in ``datasets``.

Two patches, both about the rotary embedding, which holds no weights (its cos/sin cache is
computed, not loaded), so neither can change what is loaded:

1. ``sglang.srt.layers.rotary_embedding.base._is_cpu = True``. Without a GPU and without
   ``SGLANG_USE_CPU_ENGINE`` the rope picks ``vllm._custom_ops.rotary_embedding``, which an
   SGLang-only environment lacks (and importing vLLM here would mix the engines); the switch itself
   would route every layer to the ``sgl_kernel`` CPU build, which is not on PyPI.
2. MLA drafters only: ``DeepseekV2AttentionMLA`` builds its rope with ``get_rope_wrapper(device=
   "cpu")``, whose CPU branch (``factory.get_rope_cpu``) knows only ``deepseek_yarn`` scaling and
   asserts on an unscaled rope. For ``rope_scaling=None`` the patched ``get_rope_cpu`` takes
   SGLang's device-independent ``get_rope`` instead (what a GPU server takes); yarn-scaled ropes
   (Kimi-K2.x) go through SGLang's CPU branch unchanged.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import torch

from eval.loadcheck.check import SetupError
from eval.loadcheck.folder import DrafterFolder
from eval.loadcheck.layout import stacked_shards
from eval.loadcheck.probe import Shard

EMBED = "model.embed_tokens.weight"
# kimi_k25_eagle3.py caches q_a_proj until kv_a_proj_with_mqa arrives (and the reverse), then writes
# their concatenation into fused_qkv_a_proj_with_mqa: neither key writes anything alone
FUSED_PAIR = ("q_a_proj", "kv_a_proj_with_mqa")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unscaled_rope_on_cpu() -> None:
    """Patch 2 (module docstring): an unscaled MLA rope through ``get_rope``, not the CPU-only branch."""
    import sglang.srt.layers.rotary_embedding.factory as factory

    if getattr(factory.get_rope_cpu, "_redraft_patched", False):
        return
    cpu_only = factory.get_rope_cpu

    def get_rope_cpu(head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
                     dtype=None, partial_rotary_factor=1.0, device=None):
        if rope_scaling is None:
            return factory.get_rope(head_size, rotary_dim, max_position, base, is_neox_style, None, dtype,
                                    partial_rotary_factor)
        return cpu_only(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                        partial_rotary_factor, device)

    get_rope_cpu._redraft_patched = True  # type: ignore[attr-defined]
    factory.get_rope_cpu = get_rope_cpu


class SGLangEngine:
    name = "sglang"

    def __init__(self, folder: DrafterFolder, context_length: int | None = None) -> None:
        self.folder = folder
        self.context_length = context_length
        self.version = ""

    def _setup(self) -> None:
        try:
            import sglang
            import sglang.srt.layers.rotary_embedding.base as rope_base
            from sglang.srt.distributed import parallel_state
            from sglang.srt.distributed.parallel_state import (
                init_distributed_environment,
                initialize_model_parallel,
            )
            from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
            from sglang.srt.server_args import ServerArgs
        except Exception as e:  # noqa: BLE001 - not installed or broken: the check cannot run
            raise SetupError(f"sglang is not importable here: {type(e).__name__}: {e}") from e
        self.version = f"sglang {sglang.__version__}"
        try:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            reset_context()
            args = ServerArgs(model_path=str(self.folder.path), tp_size=1, pp_size=1, ep_size=1, device="cpu")
            publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
            if parallel_state._WORLD is not None:
                get_parallel().override_permanently(world_group=parallel_state._WORLD)
            initialize_model_parallel(backend="gloo")
        except Exception as e:  # noqa: BLE001 - loader internals moved (another version): cannot run
            raise SetupError(f"sglang parallel context could not be set up: {type(e).__name__}: {e}") from e
        rope_base._is_cpu = True
        _unscaled_rope_on_cpu()

    def build(self) -> torch.nn.Module:
        self._setup()
        try:
            from sglang.srt.configs.device_config import DeviceConfig
            from sglang.srt.configs.load_config import LoadConfig
            from sglang.srt.configs.model_config import ModelConfig
            from sglang.srt.model_loader.loader import DefaultModelLoader
        except Exception as e:  # noqa: BLE001
            raise SetupError(f"sglang's loader is not importable: {type(e).__name__}: {e}") from e
        extra = {"context_length": self.context_length} if self.context_length else {}
        self.model_config = ModelConfig(model_path=str(self.folder.path), is_draft_model=True,
                                        speculative_algorithm="EAGLE3", trust_remote_code=False, **extra)
        self.loader = DefaultModelLoader(LoadConfig())
        return self.loader.initialize_model_for_startup(model_config=self.model_config,
                                                        device_config=DeviceConfig("cpu"))

    def load_all(self, model: torch.nn.Module) -> None:
        sources = self.loader.resolve_model_weights(self.model_config, model)
        self.loader.commit_model_weights(model=model, model_config=self.model_config, resolved_sources=sources,
                                         target_device=torch.device("cpu"), startup_prefetch_active=False)

    def load_keys(self, model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        model.load_weights(iter(items))

    def reset(self, model: torch.nn.Module) -> None:
        model.hot_token_id = None

    def vocab_map(self, model: torch.nn.Module) -> torch.Tensor | None:
        return getattr(model, "hot_token_id", None)  # d2t + arange, set by load_weights

    def vocab_map_required(self, model: torch.nn.Module) -> bool:
        c = model.config
        return int(c.draft_vocab_size) != int(c.vocab_size)

    def target_vocab(self, model: torch.nn.Module) -> int:
        return int(model.config.vocab_size)  # SGLang takes the draft config's vocab_size as the target's

    def provided_by_target(self, name: str, model: torch.nn.Module) -> str | None:
        c = model.config
        if name == EMBED and (getattr(c, "target_hidden_size", None) or c.hidden_size) == c.hidden_size:
            return "the EAGLE worker's set_embed puts the target's embedding here (same hidden size)"
        if name == "lm_head.weight" and getattr(model, "load_lm_head_from_target", False):
            return "draft_vocab_size is null: SGLang loads the target's lm_head"
        return None

    def shards(self, model: torch.nn.Module) -> dict[str, list[Shard]]:
        rows = [(n, p.shape[0]) for n, p in model.named_parameters() if p.dim()]
        return stacked_shards(rows, self.folder.config)

    def partners(self, key: str, keys: Sequence[str]) -> list[str]:
        a, b = FUSED_PAIR
        if self.folder.kind != "mla" or not key.endswith(".weight"):
            return []
        if f".{a}." in key:
            other = key.replace(f".{a}.", f".{b}.")
        elif f".{b}." in key:
            other = key.replace(f".{b}.", f".{a}.")
        else:
            return []
        return [other] if other in keys else []

    def cleanup(self) -> None:
        pass
