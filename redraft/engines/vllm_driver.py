"""vLLM behind a line protocol: ``python -m redraft.engines.vllm_driver`` (started by :mod:`redraft.engines.vllm`).

Runs under the engine's interpreter (the vLLM CPU venv, never the project's ``.venv``: vLLM pins its
own torch and transformers), so it imports the standard library, vLLM, tqdm (a vLLM dependency) and
:mod:`redraft.engines.driver_protocol` (the protocol's two sides, standard library) only. :class:`Driver` is
also used in-process when the running python has ``vllm``.

Protocol (:mod:`redraft.engines.driver_protocol`): one JSON object per line. The first line on stdin is the engine settings (``target``,
``drafter`` or null, ``steps``, ``dtype``, ``max_model_len``, ``kv_cache_bytes``, ``max_num_seqs``,
``gpu_memory_utilization``, ``seed``); the driver answers ``{"event": "ready", "vllm_version", "load_seconds"}``. Then each
``{"op": "generate", "requests": [...], "sequential": bool, "counters": bool}`` (or, for an engine started with
``capture_layer_ids``, ``{"op": "capture", "requests": [{"id", "prompt_token_ids"}]}``: rows name the file
holding each prompt's hidden states) is answered by
``{"event": "progress", "done", "of"}`` lines and one ``{"event": "result", "results": [...]}``;
``{"op": "exit"}`` ends it. A failure is ``{"event": "error", "error": traceback}``. The protocol
goes to a private copy of stdout; fd 1 itself is pointed at stderr before vLLM loads, so nothing
the engine prints can corrupt it.

A request is token ids in, token ids out: ``prompt_token_ids``, ``max_tokens``, ``temperature``,
``top_p``, ``seed`` (sampled runs reproduce), and ``stop_token_ids``: when given, the engine stops
at exactly those ids (``ignore_eos``, so the model's own eos list adds none) and the output keeps
the stop id. Nothing is decoded (``detokenize=False``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from redraft.engines.driver_protocol import driver_main
from redraft.engines.launch import vllm_speculative_config

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm: Any, steps: int) -> dict[str, Any]:
    """The global speculative-decoding counters now: {name: value}, the per-position vector as K values."""
    out: dict[str, Any] = {name: 0 for name in COUNTERS}
    out[PER_POS] = [0] * steps
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = int(m.value)
        elif m.name == PER_POS:
            vals = list(getattr(m, "values", []))
            out[PER_POS] = [int(v) for v in vals] + [0] * (steps - len(vals))
    return out


CAPTURE_KEYS = ("speculative_config", "kv_transfer_config")
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# class, module: imported by vLLM in its engine and worker processes, which inherit the repository on PYTHONPATH
OWN_CONNECTOR = ("RedraftCaptureConnector", "redraft.engines.vllm_plugins.redraft_capture_connector")


def capture_kwargs(engine_layer_ids: list[int], storage: str, connector: str, on_cpu: bool) -> dict[str, Any]:
    """``LLM`` arguments for vLLM's hidden-state extraction: ``extract_hidden_states`` keeps the states of
    ``engine_layer_ids`` (vLLM's convention) in a cache-only KV layer, and the connector writes each finished
    request's prompt states to ``storage``. connector "auto": the stock one on GPUs, redraft's own
    (``vllm_plugins/redraft_capture_connector.py``, a synchronous write) on a CPU, where the stock one's CUDA
    streams and pinned memory fail."""
    if connector not in ("auto", "redraft", "stock"):
        raise ValueError(f"capture_connector: expected auto, redraft or stock, got {connector!r}")
    own = connector == "redraft" or (connector == "auto" and on_cpu)
    transfer: dict[str, Any] = {"kv_connector": STOCK_CONNECTOR, "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": storage}}
    if own:
        transfer.update(kv_connector=OWN_CONNECTOR[0], kv_connector_module_path=OWN_CONNECTOR[1])
    return {
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {
                                   "eagle_aux_hidden_state_layer_ids": sorted(engine_layer_ids)}}},
        "kv_transfer_config": transfer,
    }


def wait_for_capture(path: str) -> None:
    """Return once a capture file's writer is done: it holds LOCK_EX on ``path + ".lock"`` while writing (the
    stock connector writes from a thread), so a shared lock sleeps until then, as vLLM's ``load_hidden_states``."""
    import fcntl

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)


def remove_capture(path: str) -> None:
    """Remove a capture file and its lock (whichever exist)."""
    for p in (path, path + ".lock"):
        if os.path.exists(p):
            os.remove(p)


def release_capture(path: str) -> None:
    """Wait for a capture file's writer and remove it: for requests whose states nobody reads (regeneration in
    a capturing engine)."""
    wait_for_capture(path)
    remove_capture(path)


def sampling_params(req: dict[str, Any]) -> Any:
    """vLLM SamplingParams for one request; every knob explicit (no model generation_config defaults)."""
    from vllm import SamplingParams

    temperature = float(req.get("temperature", 0.0))
    kw: dict[str, Any] = {"temperature": temperature, "max_tokens": int(req["max_tokens"])}
    if temperature > 0:
        kw["top_p"] = float(req.get("top_p", 1.0))
        kw["seed"] = int(req.get("seed") or 0)  # sampled runs reproduce
    stops = req.get("stop_token_ids")
    if stops:  # stop at exactly these ids, whatever the model's generation_config lists as eos
        kw.update(stop_token_ids=[int(t) for t in stops], ignore_eos=True, detokenize=False)
    else:
        kw["ignore_eos"] = False
    return SamplingParams(**kw)


def _row(req: dict[str, Any], out: Any, seconds: float) -> dict[str, Any]:
    path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
    if path:  # a capturing engine also wrote this request's prompt states: nobody asked for them
        release_capture(str(path))
    o = out.outputs[0]
    ids = [int(t) for t in o.token_ids]
    stop = getattr(o, "stop_reason", None)
    if isinstance(stop, int) and not isinstance(stop, bool) and (not ids or ids[-1] != stop):
        ids.append(stop)  # defensive: the id that stopped the request is part of what was generated
    return {"id": req["id"], "output_token_ids": ids, "finish_reason": o.finish_reason, "seconds": seconds}


FLOAT32 = ("float32", "fp32", "float")


def uses_mla(folder: str | None) -> bool:
    """Whether a model folder (target or EAGLE-3 drafter) declares DeepSeek's latent attention, in its decoder's
    config: multimodal wrappers (Kimi-K2.5) nest it as text_config, as ``redraft.core.target_weights.text_config`` reads
    it (not imported: this file stays standard library and vLLM)."""
    config = os.path.join(folder, "config.json") if folder else ""
    if not config or not os.path.isfile(config):
        return False
    with open(config) as f:
        raw = json.load(f)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return text.get("kv_lora_rank") is not None


def cpu_attention_backend(dtype: str, model: str | None, on_cpu: bool) -> str | None:
    """The attention backend to ask vLLM for on behalf of one model (target or drafter), or None for its choice.

    vLLM 0.32's CPU platform serves MLA with its AMX kernels whenever the CPU has AMX tiles (Intel Sapphire
    Rapids and later), and those pack only bf16/fp16/int8/fp8 weights: a float32 MLA target or drafter then
    fails to load ("expect weight to be bfloat16, float16, int8, ..."). Its reference kernels (CPU_MLA) run
    float32 on any x86 CPU; without AMX vLLM picks them itself, so asking changes nothing there. vLLM selects
    the drafter's backend apart from the target's (``speculative_config.attention_backend``), hence per model.
    """
    return "CPU_MLA" if on_cpu and dtype in FLOAT32 and uses_mla(model) else None


class Driver:
    """One loaded vLLM engine: batched or sequential generation from prompt ids."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from vllm import LLM

        self.steps = int(settings.get("steps") or 0)
        self.drafter = settings.get("drafter")
        kwargs: dict[str, Any] = dict(model=settings["target"], dtype=settings.get("dtype", "float32"),
                                      max_model_len=int(settings["max_model_len"]), enforce_eager=True,
                                      disable_log_stats=not self.drafter, seed=int(settings.get("seed", 0)),
                                      kv_cache_memory_bytes=int(settings.get("kv_cache_bytes", 1 << 30)))
        if settings.get("max_num_seqs"):
            kwargs["max_num_seqs"] = int(settings["max_num_seqs"])
        if settings.get("gpu_memory_utilization"):
            kwargs["gpu_memory_utilization"] = float(settings["gpu_memory_utilization"])
        from vllm.platforms import current_platform

        capture_chunks = bool(settings.get("capture_layer_ids")) and not uses_mla(settings["target"])
        if current_platform.is_cpu() and not self.drafter and not capture_chunks:
            # A prompt prefilled in pieces has the token sampled after a piece discarded, and vLLM 0.32's
            # CPU runner then rewinds the request's seeded generator, which CPU generators refuse ("CPU
            # Generator does not use offset"): every seeded sampled batch larger than one step's token
            # budget died. Whole-prompt prefill avoids the rewind; the budget must then hold a prompt.
            # A capture engine keeps chunked prefill: its requests are greedy and unseeded, and every chunk's
            # states land in the request's own cache slots (vLLM's extract_hidden_states writes each scheduled
            # token's row), so a prompt longer than one step's budget is captured whole. Not an MLA target:
            # vLLM turns chunked prefill off for MLA on a CPU without AMX, and a prompt longer than the step's
            # budget: a kimi-k25-mini capture engine given 64-token steps made no progress in 6 minutes.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(4096, int(settings["max_model_len"]))
        on_cpu = current_platform.is_cpu()
        if backend := cpu_attention_backend(kwargs["dtype"], settings["target"], on_cpu):
            kwargs["attention_backend"] = backend
        if self.drafter:
            kwargs["speculative_config"] = vllm_speculative_config(self.drafter, self.steps)
            if backend := cpu_attention_backend(kwargs["dtype"], self.drafter, on_cpu):
                kwargs["speculative_config"]["attention_backend"] = backend
        self.capture_dir: str | None = None
        if settings.get("capture_layer_ids"):
            if self.drafter:
                raise ValueError("capture_layer_ids and a drafter exclude each other (both are speculative methods)")
            self.capture_dir = str(settings["capture_dir"])
            kwargs.update(capture_kwargs([int(i) for i in settings["capture_layer_ids"]], self.capture_dir,
                                         settings.get("capture_connector", "auto"), current_platform.is_cpu()))
        for key, value in (settings.get("engine_args") or {}).items():
            if key in kwargs and key in CAPTURE_KEYS and self.capture_dir:
                raise ValueError(f"engine_args[{key!r}] would change the hidden-state capture; redraft sets it")
            kwargs[key] = value
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.load_seconds = time.perf_counter() - t0
        import vllm

        self.version = vllm.__version__

    def ready_fields(self) -> dict[str, Any]:
        return {"vllm_version": self.version, "load_seconds": self.load_seconds}

    def close(self) -> None:
        """Shut the engine's processes down now (in-process use: before another engine loads)."""
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        import gc

        gc.collect()

    def run(self, cmd: dict[str, Any], progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
        """One protocol command (``generate`` or ``capture``) -> its result rows."""
        if cmd.get("op") == "capture":
            return self.capture(cmd["requests"], progress=progress)
        if cmd.get("op") == "generate":
            return self.generate(cmd["requests"], sequential=bool(cmd.get("sequential")),
                                 counters=bool(cmd.get("counters")), progress=progress)
        raise ValueError(f"unknown op {cmd.get('op')!r}")

    def capture(self, requests: list[dict[str, Any]],
                progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
        """Prefill every prompt once (one greedy token, which is discarded); rows carry the connector's file."""
        if self.capture_dir is None:
            raise ValueError("capture: this engine was not started with capture_layer_ids")
        from vllm import SamplingParams

        if not requests:
            return []
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params,
                                 use_tqdm=_progress_bar(progress, len(requests)))
        rows = []
        for req, out in zip(requests, outs, strict=True):
            path = (getattr(out, "kv_transfer_params", None) or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError(f"request {req['id']}: vLLM returned no hidden_states_path (kv_transfer_params "
                                   f"{getattr(out, 'kv_transfer_params', None)!r})")
            rows.append({"id": req["id"], "hidden_states_path": str(path),
                         "num_prompt_tokens": len(out.prompt_token_ids or [])})
        return rows

    def generate(self, requests: list[dict[str, Any]], *, sequential: bool = False, counters: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
        """Rows in request order. sequential: one request at a time (per-request counters and wall time);
        else one batch, scheduled by the engine (wall time is the batch's, on every row)."""
        if not requests:
            return []
        n = len(requests)
        if sequential or counters:
            rows = []
            for i, req in enumerate(requests):
                before = read_counters(self.llm, self.steps) if counters and self.drafter else None
                t0 = time.perf_counter()
                out = self.llm.generate([{"prompt_token_ids": req["prompt_token_ids"]}], sampling_params(req),
                                        use_tqdm=False)
                row = _row(req, out[0], time.perf_counter() - t0)
                if before is not None:
                    after = read_counters(self.llm, self.steps)
                    row["num_drafts"] = after[COUNTERS[0]] - before[COUNTERS[0]]
                    row["num_draft_tokens"] = after[COUNTERS[1]] - before[COUNTERS[1]]
                    row["num_accepted_tokens"] = after[COUNTERS[2]] - before[COUNTERS[2]]
                    row["num_accepted_tokens_per_pos"] = [a - b for a, b in zip(after[PER_POS], before[PER_POS],
                                                                                strict=True)]
                rows.append(row)
                if progress is not None:
                    progress(i + 1, n)
            return rows
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests],
                                 [sampling_params(r) for r in requests], use_tqdm=_progress_bar(progress, n))
        wall = time.perf_counter() - t0
        if len(outs) != n:
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {n} requests")
        return [_row(req, out, wall) for req, out in zip(requests, outs, strict=True)]


def _progress_bar(progress: Callable[[int, int], None] | None, total: int) -> Any:
    """A tqdm factory for LLM.generate that reports finished requests to ``progress`` (False: none)."""
    if progress is None:
        return False
    from tqdm import tqdm

    step = max(1, total // 16)

    class _Bar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(file=open(os.devnull, "w"), disable=False)  # noqa: SIM115 - closed with the bar
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            res = super().update(n)
            if self.n == total or int(self.n) % step == 0:
                progress(int(self.n), total)
            return res

        def close(self) -> None:
            f = self.fp
            super().close()
            f.close()

    return _Bar


def main(argv: list[str]) -> int:
    return driver_main(argv, Driver, "usage: python -m redraft.engines.vllm_driver  (settings and commands as JSON "
                       "lines on stdin; started by redraft.engines.vllm)")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
