"""The rope a serving engine's EAGLE-3 drafter class builds from a drafter's config.json, read off the engine.

Run by the engine's own interpreter: the standard library, torch and the engine, nothing of redraft, so that
the vLLM CPU venv can run it as a script (``conformance.rope_check`` compares what it returns with our
training rope):

    python conformance/rope_probe.py REQUEST.json OUT.pt

REQUEST.json: ``{"engine": "sglang" | "vllm", "cases": [{"name", "folder", "target_folder" (vLLM only),
"positions", "apply_positions"}, ...]}``; OUT.pt (``torch.save``) holds one dict per case (:func:`probe_case`),
or ``{"error": ...}`` for a case the engine refused to build, with the engine's own message.

Each engine reads the folder with its own config machinery and builds its own drafter class on CPU, without
weights (nothing is loaded; the rope is computed, not stored):

- SGLang: ``ModelConfig(is_draft_model=True, speculative_algorithm="EAGLE3")`` and
  ``DefaultModelLoader.initialize_model_for_startup`` (``LlamaForCausalLMEagle3`` / ``Eagle3DeepseekV2ForCausalLM``),
  in a world-size-1 gloo context, as SGLang's single-process layer tests set one up;
- vLLM: ``EngineArgs(speculative_config={"method": "eagle3", ...}).create_engine_config()`` and
  ``initialize_model`` on the draft model config (``Eagle3LlamaForCausalLM`` / ``Eagle3DeepseekV2ForCausalLM``).

The probe then reads the drafter layer's attention module: its ``rotary_emb`` (class, ``is_neox_style``,
``rotary_dim``, ``cos_sin_cache`` rows) and its softmax scale (the module's ``scaling`` and what it handed the
attention kernels), and rotates the unit vectors with the engine's own ``rotary_emb.forward_native``.

What is set so that this runs on a CPU and shows what a GPU serves (each named where it is done):

- the tables are built in fp32 (vLLM ``dtype="float32"``; SGLang ``SGLANG_ROPE_CACHE_FP32=1``, which is what
  SGLang does on CUDA): the serving dtype's rounding of the tables is not a config key's doing;
- SGLang ``rotary_embedding.base._is_cpu = True``: the rope kernel choice at init (no weights involved);
- SGLang MLA: ``get_rope_wrapper`` is told a non-CPU device, so it takes its GPU branch (``get_rope``), not
  ``get_rope_cpu`` (which only builds ``deepseek_yarn`` and asserts on a default rope); the tensors stay on CPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import sys
from typing import Any

os.environ.setdefault("SGLANG_ROPE_CACHE_FP32", "1")  # SGLang keeps the cache fp32 on CUDA; on CPU only with this
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

ENGINES = ("sglang", "vllm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def quiet(verbose: bool = False):
    """The engines log a great deal while importing and building; keep it out of the way unless asked."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            yield
    finally:
        logging.disable(level)


# ----------------------------------------------------------------------------- SGLang


class SGLangBuilder:
    """SGLang's draft ModelConfig and model class, built on CPU without weights."""

    engine = "sglang"

    def __init__(self) -> None:
        import sglang

        self.version = f"sglang {sglang.__version__}, torch {torch.__version__}"
        self._dist = False

    def _context(self, folder: str) -> None:
        """Once per process: a world-size-1 gloo group and a published ServerArgs (SGLang's single-process set-up;
        re-publishing drops the model-parallel groups). The ServerArgs name the first folder; what a drafter
        builds is read from its own ModelConfig."""
        if self._dist:
            return
        from sglang.srt.distributed import parallel_state
        from sglang.srt.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
        from sglang.srt.server_args import ServerArgs

        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        reset_context()
        publish(ServerArgs(model_path=folder, tp_size=1, pp_size=1, ep_size=1, device="cpu"), role="scheduler",
                ranks=SpawnRanks(world_rank=0))
        if parallel_state._WORLD is not None:
            get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
        self._dist = True
        import sglang.srt.layers.rotary_embedding.base as rope_base

        rope_base._is_cpu = True  # the rope kernel choice at init: vllm._custom_ops otherwise; no weights involved

    def build(self, case: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
        import sglang.srt.models.deepseek_v2 as deepseek_v2
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader.loader import DefaultModelLoader

        self._context(case["folder"])
        mc = ModelConfig(model_path=case["folder"], is_draft_model=True, speculative_algorithm="EAGLE3",
                         trust_remote_code=False)
        wrapper = deepseek_v2.get_rope_wrapper

        def gpu_branch(*args: Any, device: Any = None, **kw: Any) -> Any:
            # factory.get_rope_wrapper: `if device != "cpu": ... return get_rope(...)`, what a GPU serves
            return wrapper(*args, device="gpu", **kw)

        deepseek_v2.get_rope_wrapper = gpu_branch
        variant = sys.modules["sglang.srt.layers.rotary_embedding.rope_variant"]
        get_device = variant.get_device
        variant.get_device = lambda *a, **k: "cpu"  # DeepseekScalingRotaryEmbedding's tensors: placement only
        try:
            model = DefaultModelLoader(LoadConfig()).initialize_model_for_startup(
                model_config=mc, device_config=DeviceConfig("cpu"))
        finally:
            deepseek_v2.get_rope_wrapper = wrapper
            variant.get_device = get_device
        return model, mc.hf_config


# ----------------------------------------------------------------------------- vLLM


class VLLMBuilder:
    """vLLM's speculative config (EAGLE-3) and draft model class, built on CPU without weights."""

    engine = "vllm"

    def __init__(self) -> None:
        import vllm

        self.version = f"vllm {vllm.__version__}, torch {torch.__version__}"
        self._dist = False

    def build(self, case: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        args = EngineArgs(model=case["target_folder"], skip_tokenizer_init=True, enforce_eager=True,
                          max_model_len=2048, dtype="float32",
                          speculative_config={"method": "eagle3", "model": case["folder"],
                                              "num_speculative_tokens": 3})
        vc = args.create_engine_config()
        if not self._dist:
            with set_current_vllm_config(vc):
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
                ensure_model_parallel_initialized(1, 1)
            self._dist = True
        dmc = vc.speculative_config.draft_model_config
        with set_current_vllm_config(vc), set_default_torch_dtype(dmc.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=dmc)
        return model, dmc.hf_config


BUILDERS = {"sglang": SGLangBuilder, "vllm": VLLMBuilder}


# ----------------------------------------------------------------------------- reading the built drafter


def attention_module(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """(name, module) of the drafter's one attention layer: the module holding ``rotary_emb`` and ``scaling``."""
    found = [(n, m) for n, m in model.named_modules()
             if getattr(m, "rotary_emb", None) is not None and isinstance(getattr(m, "scaling", None), float)]
    if len(found) != 1:
        raise RuntimeError(f"expected one attention module with rotary_emb and scaling, found {[n for n, _ in found]}")
    return found[0]


def kernel_scales(attn: torch.nn.Module) -> dict[str, float]:
    """The softmax scale each attention kernel under ``attn`` was given (``scaling`` / ``scale`` attributes)."""
    out = {"scaling": float(attn.scaling)}
    for name, sub in attn.named_modules():
        if not name or sub is attn.rotary_emb:
            continue
        for obj, where in ((sub, name), (getattr(sub, "impl", None), f"{name}.impl")):
            for attr in ("scaling", "scale"):
                value = getattr(obj, attr, None) if obj is not None else None
                if isinstance(value, float):
                    out[f"{where}.{attr}"] = value
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else repr(value)


def rotate_units(rope: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """The engine's rotation of every unit vector: [P, R, R], row j = the rotated e_j at each position."""
    r = int(rope.rotary_dim)
    eye = torch.eye(r, dtype=torch.float32).expand(len(positions), r, r).contiguous()
    q, k = rope.forward_native(positions, eye.clone(), eye.clone())
    q, k = q.reshape(len(positions), r, r), k.reshape(len(positions), r, r)
    if not torch.equal(q, k):
        raise RuntimeError("the engine's rope rotated q and k differently")
    return q.float()


def probe_case(builder: Any, case: dict[str, Any]) -> dict[str, Any]:
    """What the engine's drafter serves for one config.json: its rope module's tables and its softmax scale."""
    model, hf_config = builder.build(case)
    name, attn = attention_module(model)
    rope = attn.rotary_emb
    cache = rope.cos_sin_cache.detach().float().cpu()
    n = int(cache.shape[0])
    positions = sorted({int(p) for p in case["positions"] if 0 <= int(p) < n} | {n - 1})
    apply_at = sorted({int(p) for p in case.get("apply_positions", []) if 0 <= int(p) < n})
    pos = torch.tensor(positions, dtype=torch.long)
    return {
        "engine": builder.engine,
        "version": builder.version,
        "model_class": type(model).__name__,
        "attention": name,
        "attention_class": type(attn).__name__,
        "rope_class": type(rope).__name__,
        "rope_parameters": _plain(getattr(hf_config, "rope_parameters", None)),
        "rope_scaling": _plain(getattr(hf_config, "rope_scaling", None)),
        "is_neox_style": bool(rope.is_neox_style),
        "head_size": int(rope.head_size),
        "rotary_dim": int(rope.rotary_dim),
        "cache_rows": n,
        "cache_dtype": str(rope.cos_sin_cache.dtype),
        "mscale": float(rope.mscale) if isinstance(getattr(rope, "mscale", None), float) else None,
        "scales": kernel_scales(attn),
        "positions": pos,
        "cos_sin": cache.index_select(0, pos),
        "apply_positions": torch.tensor(apply_at, dtype=torch.long),
        "rotated": rotate_units(rope, torch.tensor(apply_at, dtype=torch.long)) if apply_at else None,
    }


def probe_all(engine: str, cases: list[dict[str, Any]], verbose: bool = False) -> dict[str, dict[str, Any]]:
    """{case name: probe_case's dict, or {"error": the engine's message}} for every case, in one engine."""
    if engine not in BUILDERS:
        raise ValueError(f"engine {engine!r} is not one of {ENGINES}")
    with quiet(verbose):
        builder = BUILDERS[engine]()
    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        with quiet(verbose), torch.no_grad():
            try:
                out[case["name"]] = probe_case(builder, case)
            except Exception as e:  # noqa: BLE001 - an engine refusing a config is a result, reported as such
                out[case["name"]] = {"error": f"{type(e).__name__}: {e}", "engine": engine,
                                     "version": builder.version}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    request = json.loads(open(argv[0]).read())
    torch.set_num_threads(int(request.get("threads", 1)))
    result = probe_all(request["engine"], request["cases"], bool(request.get("verbose")))
    torch.save(result, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
