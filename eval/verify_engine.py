"""Load an exported drafter with the serving engine installed HERE and prove every weight landed.

``python -m eval.verify_engine OUT --engine sglang`` (or ``python -m eval.export ... --verify-with
sglang``) builds the engine's own EAGLE-3 draft model (SGLang ``LlamaForCausalLMEagle3`` /
vLLM ``Eagle3LlamaForCausalLM``, or for the MLA drafter ``Eagle3DeepseekV2ForCausalLM`` in both) on CPU
and runs the engine's own ``load_weights``. Why: SGLang
skips weight names it does not know and leaves the parameter as uninitialised memory, vLLM
rejects ``model.``-prefixed names, and a missing ``d2t`` makes both use draft ids as target ids;
none of that raises at serve time. Our own table (``core.drafter.serving_format``) is only as right as
our reading of the engines, so this runs the engines' code:

- every parameter is filled with a sentinel (NaN, ``iinfo.min``) before loading; any still holding
  it afterwards was never written (except what the target provides by design: the embedding);
- each checkpoint key is then loaded alone; a key that writes nothing was ignored (``t2d`` is
  dropped by both engines by design). SGLang's MLA drafter fuses ``q_a_proj`` and ``kv_a_proj_with_mqa``
  and writes neither until both arrived, so each is sent with its partner holding the sentinel: the
  key's own rows must then be written;
- the ``d2t`` map the engine took must be one-to-one into ``[0, vocab)``.

No forward pass runs. Engine internals used here are those of sglang 0.5.23 / vllm 0.33.0; a
different version may fail in setup, which is reported as "could not run", never as a PASS.
The CI conformance lane runs the fuller check in conformance/engine_load.py (MLA drafters, shard names,
per-key values and overlaps) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.config import parse_hyphenated
from core.drafter.folder import WEIGHTS_NAME

log = logging.getLogger(__name__)

ENGINES = ("sglang", "vllm")
SKIPPED_BY_DESIGN = ("t2d",)  # both loaders drop it; only d2t is used
# keys a loader takes only together (SGLang kimi_k25_eagle3.py caches one a-projection until the other arrives)
LOADED_TOGETHER = {"sglang": (("q_a_proj", "kv_a_proj_with_mqa"),)}
EMBED_PARAM = "model.embed_tokens.weight"


class EngineNotInstalled(RuntimeError):
    """The requested engine cannot be imported in this Python environment."""


class EngineSetupError(RuntimeError):
    """The engine is installed but its loader could not be set up (version drift, broken install)."""


@dataclass
class VerifyReport:
    """What one engine did with one drafter folder; ``ok`` only when nothing was lost or ignored."""

    engine: str
    folder: str
    version: str = ""
    params: int = 0
    by_design: dict[str, str] = field(default_factory=dict)  # parameter -> why it may stay unwritten
    problems: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    keys: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        """One line, the same shape as conformance/engine_load.py's: ``VERDICT <engine> PASS|FAIL ...``."""
        if self.ok:
            design = f" ({len(self.by_design)} provided by the target by design)" if self.by_design else ""
            skipped = f" ({', '.join(self.skipped_keys)} skipped by design)" if self.skipped_keys else ""
            return (f"VERDICT {self.engine} PASS: {self.params}/{self.params} parameters loaded{design}, "
                    f"{self.keys}/{self.keys} checkpoint keys used{skipped}")
        n = len(self.problems)
        shown = [msg if len(msg) <= 160 else msg[:157] + "..." for msg in self.problems[:4]]
        if n > 4:
            shown.append(f"... {n - 4} more")
        return f"VERDICT {self.engine} FAIL ({n} problem{'s' if n > 1 else ''}): " + "; ".join(shown)


# ----------------------------------------------------------------------------- pure helpers


def engine_installed(engine: str) -> bool:
    """True when ``engine`` is importable here (checked without importing it)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    return importlib.util.find_spec(engine) is not None


def require_engine(engine: str) -> None:
    if not engine_installed(engine):
        raise EngineNotInstalled(
            f"{engine} is not installed in this environment ({sys.executable}): --verify-with {engine} runs "
            f"{engine}'s own loader, so run it where {engine} is installed (the serving box), e.g. "
            f"`python -m eval.verify_engine OUT --engine {engine}` there"
        )


def sentinel_fill(params: Iterable[torch.Tensor]) -> None:
    """NaN for float tensors, ``iinfo.min`` for integer ones (bool cannot hold a sentinel)."""
    with torch.no_grad():
        for p in params:
            if p.dtype.is_floating_point:
                p.fill_(float("nan"))
            elif p.dtype != torch.bool:
                p.fill_(torch.iinfo(p.dtype).min)


def unwritten_rows(p: torch.Tensor) -> tuple[int, int] | None:
    """(elements still holding the sentinel, rows touched by them); None for bool tensors."""
    if p.dtype == torch.bool:
        return None
    flat = p.detach().reshape(max(p.shape[0], 1) if p.dim() else 1, -1)
    mask = torch.isnan(flat) if p.dtype.is_floating_point else flat == torch.iinfo(p.dtype).min
    return int(mask.sum()), int(mask.any(dim=1).sum())


def written_anything(p: torch.Tensor) -> bool:
    found = unwritten_rows(p)
    return found is not None and found[0] < p.numel()


def vocab_map_problems(target_ids: torch.Tensor | None, required: bool, draft_vocab: int, vocab: int,
                       in_checkpoint: bool = True) -> list[str]:
    """Problems of the draft->target id map an engine took (``target_ids`` = d2t + arange, or None)."""
    if target_ids is None:
        if not required:
            return []
        if in_checkpoint:
            return ["d2t is in the checkpoint but the engine did not take it"]
        return ["no d2t although draft_vocab_size != vocab_size (draft ids would be used as target ids)"]
    ids = target_ids.to(torch.int64).flatten()
    out = []
    if ids.numel() != draft_vocab:
        out.append(f"d2t has {ids.numel()} entries, draft_vocab_size is {draft_vocab}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        out.append(f"d2t maps outside the target vocab [0, {vocab}): min {int(ids.min())}, max {int(ids.max())}")
    if ids.unique().numel() != ids.numel():
        out.append("d2t is not one-to-one")
    return out


def synth_target_config(draft: Mapping[str, Any], context_length: int | None = None) -> dict[str, Any]:
    """A Llama target config for vLLM, sized from the draft (vLLM sizes d2t and the layers from the target)."""
    ids = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [1, 2, 3]
    heads = int(draft["num_attention_heads"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": int(draft.get("target_hidden_size") or draft["hidden_size"]),
        "num_attention_heads": heads, "num_key_value_heads": int(draft.get("num_key_value_heads") or heads),
        "head_dim": int(draft.get("head_dim") or int(draft["hidden_size"]) // heads),
        "intermediate_size": int(draft.get("intermediate_size") or 4 * int(draft["hidden_size"])),
        "num_hidden_layers": max(max(ids) + 1, 4), "vocab_size": int(draft["vocab_size"]),
        "rms_norm_eps": draft.get("rms_norm_eps", 1e-6), "rope_theta": draft.get("rope_theta", 10000.0),
        "max_position_embeddings": int(context_length or draft.get("max_position_embeddings") or 2048),
        "torch_dtype": draft.get("torch_dtype", "bfloat16"), "tie_word_embeddings": False, "hidden_act": "silu",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- engines


class _SGLang:
    """SGLang's draft ModelConfig + DefaultModelLoader, in a world-size-1 gloo context."""

    def __init__(self, folder: str, config: Mapping[str, Any], context_length: int | None) -> None:
        self.folder, self.config, self.context_length = folder, config, context_length

    def build(self) -> torch.nn.Module:
        try:
            import sglang
            import sglang.srt.layers.rotary_embedding.base as rope_base
            from sglang.srt.configs.device_config import DeviceConfig
            from sglang.srt.configs.load_config import LoadConfig
            from sglang.srt.configs.model_config import ModelConfig
            from sglang.srt.distributed import parallel_state
            from sglang.srt.distributed.parallel_state import (
                init_distributed_environment,
                initialize_model_parallel,
            )
            from sglang.srt.model_loader.loader import DefaultModelLoader
            from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
            from sglang.srt.server_args import ServerArgs

            self.version = f"sglang {sglang.__version__}"
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            reset_context()
            publish(ServerArgs(model_path=self.folder, tp_size=1, pp_size=1, ep_size=1, device="cpu"),
                    role="scheduler", ranks=SpawnRanks(world_rank=0))
            if parallel_state._WORLD is not None:
                get_parallel().override_permanently(world_group=parallel_state._WORLD)
            initialize_model_parallel(backend="gloo")
            # the rope kernel is chosen by platform at init; its cache is computed, not loaded
            rope_base._is_cpu = True
            # SGLang's CPU rope factory builds only deepseek_yarn for MLA layers (it asserts a rope_scaling); an
            # unscaled MLA rope has no weights and is built as the plain rope the Llama layers get here
            import sglang.srt.models.deepseek_v2 as deepseek_v2
            from sglang.srt.layers.rotary_embedding.factory import get_rope

            cpu_factory = deepseek_v2.get_rope_wrapper

            def mla_rope(*args: Any, rope_scaling: Any = None, device: Any = None, **kw: Any) -> Any:
                if rope_scaling is None:
                    return get_rope(*args, rope_scaling=None, **kw)
                return cpu_factory(*args, rope_scaling=rope_scaling, device=device, **kw)

            deepseek_v2.get_rope_wrapper = mla_rope
        except Exception as e:  # noqa: BLE001 - any failure here is the environment's, not the checkpoint's
            raise EngineSetupError(f"sglang setup failed: {type(e).__name__}: {e}") from e
        kw = {"context_length": self.context_length} if self.context_length else {}
        self.model_config = ModelConfig(model_path=self.folder, is_draft_model=True,
                                        speculative_algorithm="EAGLE3", trust_remote_code=False, **kw)
        self.loader = DefaultModelLoader(LoadConfig())
        return self.loader.initialize_model_for_startup(model_config=self.model_config,
                                                        device_config=DeviceConfig("cpu"))

    def full_load(self, model: torch.nn.Module) -> None:
        resolved = self.loader.resolve_model_weights(self.model_config, model)
        self.loader.commit_model_weights(model=model, model_config=self.model_config, resolved_sources=resolved,
                                         target_device=torch.device("cpu"), startup_prefetch_active=False)

    def load(self, model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        model.load_weights(iter(items))

    def reset(self, model: torch.nn.Module) -> None:
        model.hot_token_id = None

    def vocab_map(self, model: torch.nn.Module) -> tuple[torch.Tensor | None, bool]:
        c = model.config
        return getattr(model, "hot_token_id", None), c.draft_vocab_size != c.vocab_size

    def by_design(self, name: str, model: torch.nn.Module) -> str | None:
        c = model.config
        if name == EMBED_PARAM and getattr(c, "target_hidden_size", c.hidden_size) == c.hidden_size:
            return "SGLang replaces it with the target's embedding"
        if name == "lm_head.weight" and getattr(model, "load_lm_head_from_target", False):
            return "draft_vocab_size is null: SGLang takes the target's lm_head"
        return None

    def cleanup(self) -> None:
        pass


class _VLLM:
    """vLLM's EngineArgs(speculative_config=eagle3) + its draft model loader, on the CPU platform."""

    def __init__(self, folder: str, config: Mapping[str, Any], context_length: int | None) -> None:
        self.folder, self.config, self.context_length = folder, config, context_length
        self.tdir: str | None = None

    def build(self) -> torch.nn.Module:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
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
        except Exception as e:  # noqa: BLE001
            raise EngineSetupError(f"vllm setup failed: {type(e).__name__}: {e}") from e
        self.version = f"vllm {vllm.__version__}"
        self.set_config = set_current_vllm_config
        self.tdir = tempfile.mkdtemp(prefix="redraft_verify_target_")
        Path(self.tdir, "config.json").write_text(json.dumps(synth_target_config(self.config, self.context_length)))
        max_len = self.context_length or min(2048, int(self.config.get("max_position_embeddings") or 2048))
        args = EngineArgs(model=self.tdir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_len,
                          speculative_config={"method": "eagle3", "model": self.folder, "num_speculative_tokens": 3})
        self.vc = args.create_engine_config()
        with set_current_vllm_config(self.vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            ensure_model_parallel_initialized(1, 1)
        self.target_vocab = self.vc.model_config.get_vocab_size()
        self.target_hidden = self.vc.model_config.get_hidden_size()
        self.dmc = self.vc.speculative_config.draft_model_config
        self.loader = get_model_loader(get_draft_load_config(self.vc))
        with set_current_vllm_config(self.vc), set_default_torch_dtype(self.dmc.dtype), torch.device("cpu"):
            return initialize_model(vllm_config=self.vc, model_config=self.dmc)

    def full_load(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        with self.set_config(self.vc):
            self.loader.load_weights(model, self.dmc)
            process_weights_after_loading(model, self.dmc, torch.device("cpu"))

    def load(self, model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
        with self.set_config(self.vc):
            model.load_weights(iter(items))

    def reset(self, model: torch.nn.Module) -> None:
        pass

    def vocab_map(self, model: torch.nn.Module) -> tuple[torch.Tensor | None, bool]:
        p = getattr(model, "draft_id_to_target_id", None)
        if p is None or not written_anything(p):  # an unwritten one is already reported as a parameter
            return None, False
        return p.detach() + torch.arange(p.shape[0]), True

    def by_design(self, name: str, model: torch.nn.Module) -> str | None:
        c = model.config
        if name == EMBED_PARAM and self.target_hidden == c.hidden_size:
            return "vLLM shares the target's embedding"
        if name == "lm_head.weight" and c.draft_vocab_size == self.target_vocab:
            return "vLLM shares the target's lm_head (draft vocab = target vocab)"
        return None

    def cleanup(self) -> None:
        if self.tdir:
            shutil.rmtree(self.tdir, ignore_errors=True)


@contextlib.contextmanager
def _quiet(verbose: bool):
    """Engines log a lot at import and build; keep it unless asked."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(level)


def verify_export(folder: str | Path, engine: str, *, context_length: int | None = None,
                  verbose: bool = False) -> VerifyReport:
    """Run ``engine``'s loader on ``folder``; raises EngineNotInstalled / EngineSetupError when it cannot run."""
    from safetensors import safe_open

    require_engine(engine)
    folder = str(Path(folder).resolve())
    config = json.loads(Path(folder, "config.json").read_text())
    rep = VerifyReport(engine=engine, folder=folder)
    with safe_open(str(Path(folder, WEIGHTS_NAME)), framework="pt") as f:
        ckpt = {k: f.get_tensor(k) for k in f.keys()}
    rep.keys = len(ckpt)
    eng: Any = (_SGLang if engine == "sglang" else _VLLM)(folder, config, context_length)
    try:
        with _quiet(verbose):
            try:
                model = eng.build()
            except EngineSetupError:
                raise
            except Exception as e:  # noqa: BLE001 - a config the engine refuses is the checkpoint's failure
                rep.problems.append(f"{engine} could not build the draft model: {type(e).__name__}: {e}"[:400])
                return rep
            rep.version = eng.version
            params = dict(model.named_parameters())
            rep.params = len(params)
            sentinel_fill(params.values())
            eng.reset(model)
            try:
                eng.full_load(model)
            except Exception as e:  # noqa: BLE001
                rep.problems.append(f"loader raised {type(e).__name__}: {e}"[:400])
            for name, p in model.named_parameters():
                found = unwritten_rows(p)
                if found is None or found[0] == 0:
                    continue
                why = eng.by_design(name, model) if found[0] == p.numel() else None
                if why:
                    rep.by_design[name] = why
                else:
                    rep.problems.append(f"parameter {name} not loaded ({found[0]}/{p.numel()} elements, "
                                        f"{found[1]} rows unwritten)")
            target_ids, required = eng.vocab_map(model)
            rep.problems += vocab_map_problems(target_ids, required, int(model.config.draft_vocab_size),
                                               int(model.config.vocab_size), in_checkpoint="d2t" in ckpt)
            for key, tensor in sorted(ckpt.items()):
                if key.rsplit(".", 1)[-1] in SKIPPED_BY_DESIGN:
                    rep.skipped_keys.append(key)
                    continue
                sentinel_fill(model.parameters())
                eng.reset(model)
                try:
                    eng.load(model, [(key, tensor), *_partners(engine, key, ckpt)])
                except Exception as e:  # noqa: BLE001
                    rep.problems.append(f"key {key} rejected: {type(e).__name__}: {e}"[:300])
                    continue
                took_map = engine == "sglang" and getattr(model, "hot_token_id", None) is not None
                if not took_map and not any(written_anything(p) for p in model.parameters()):
                    rep.problems.append(f"key {key} ignored (the loader matched no parameter)")
    finally:
        eng.cleanup()
    return rep


def _partners(engine: str, key: str, ckpt: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The keys ``engine`` loads together with ``key`` (LOADED_TOGETHER), each as a sentinel-filled tensor: what
    they write stays the sentinel, so only ``key``'s own rows count as written."""
    out = []
    for group in LOADED_TOGETHER.get(engine, ()):
        for part in group:
            if f".{part}." not in key:
                continue
            for other in group:
                name = key.replace(f".{part}.", f".{other}.")
                if other != part and name in ckpt:
                    filler = ckpt[name].clone()
                    sentinel_fill([filler])
                    out.append((name, filler))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.verify_engine",
                                description="Load an exported drafter folder with the serving engine installed "
                                            "here and report parameters left unwritten and keys ignored.")
    p.add_argument("folder", help="an exported drafter folder (config.json + model.safetensors)")
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--context-length", type=int, metavar="N",
                   help="behave like a target with this context (SGLang refuses a shorter drafter)")
    p.add_argument("--verbose", action="store_true", help="show the engine's own output")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parse_hyphenated(build_parser(), argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_verification(a.folder, a.engine, context_length=a.context_length, verbose=a.verbose)


def run_verification(folder: str | Path, engine: str, *, context_length: int | None = None,
                     verbose: bool = False) -> int:
    """CLI body shared with ``eval.export --verify-with``: 0 PASS, 1 FAIL, 2 could not run."""
    try:
        rep = verify_export(folder, engine, context_length=context_length, verbose=verbose)
    except (EngineNotInstalled, EngineSetupError) as e:
        log.error("%s", e)
        print(f"VERDICT {engine} ERROR: {e}")
        return 2
    print(rep.verdict())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
