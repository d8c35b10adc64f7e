"""Who writes the target's replies during ``--regenerate``: ``--regen-backend hf|vllm|server``.

- ``hf`` (default): the capture backend's own ``generate``, ``--gen-batch-size`` prompts per call
  (transformers with ``--backend hf``; SGLang's engine with ``--backend sglang``).
- ``vllm``: vLLM from the rendered prompt ids, every prompt of a turn at once (the engine schedules
  them), through :mod:`redraft.engines.vllm` (in-process where ``vllm`` is installed, else the vLLM CPU venv).
- ``server``: a running SGLang or vLLM server (``--regen-url``), ``--regen-concurrency`` requests in
  flight, through :mod:`redraft.engines.server`.

Each is token ids in, token ids out: the prompt ids are the chat template's render (what
``extract.generated`` captures on) and the reply is kept as the ids the engine returned, stop id
included; nothing is decoded and re-encoded. Every backend stops at exactly the regeneration's stop
ids (the HF generation config's ``eos_token_id``, vLLM's ``stop_token_ids`` with ``ignore_eos``;
SGLang adds the model's own eos ids, which it cannot switch off alone). A reply is checked before it
is used: not empty, within its budget, no stop id before its last token. Sampled runs are seeded per
request from the shard's seed and the prompt ids, so reruns reproduce on engines that honour seeds.
"""

from __future__ import annotations

import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from extract.backends.base import GenerationConfig, TargetBackend
from extract.progress import advance
from extract.timing import span
from redraft.core.errors import Failure

log = logging.getLogger(__name__)

REGEN_BACKENDS = ("hf", "vllm", "server")


class RegenError(Failure):
    """An engine returned something that is not a reply to the request (or could not be run)."""


class Regenerator(ABC):
    """Prompts (token ids) -> the ids the target generated after each, stop id included when it stopped."""

    name: str

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], gen: GenerationConfig,
                 stops: Sequence[int], seeds: Sequence[int] | None = None) -> list[list[int]]:
        """Continue every prompt with at most ``budgets[i]`` new tokens under ``gen``'s sampling.

        ``seeds``: one per prompt, for sampling the same prompt many times (self-written prompts all
        start from the same ids); default: derived from ``gen.seed`` and the prompt's ids.
        """

    def describe(self) -> dict[str, Any]:
        """What generated (for the log and the manifest)."""
        return {"backend": self.name}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop an engine this regenerator started."""


class BackendRegenerator(Regenerator):
    """Today's path: the capture backend's generate, ``gen.batch_size`` prompts per call (budget: the chunk's least)."""

    name = "hf"

    def __init__(self, backend: TargetBackend) -> None:
        self.backend = backend

    def generate(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], gen: GenerationConfig,
                 stops: Sequence[int], seeds: Sequence[int] | None = None) -> list[list[int]]:
        out: list[list[int]] = []
        for start in range(0, len(prompts), gen.batch_size):
            chunk = [list(p) for p in prompts[start : start + gen.batch_size]]
            budget = min(budgets[start : start + gen.batch_size])
            if seeds is None:
                new = self.backend.generate(chunk, replace(gen, max_new_tokens=budget), list(stops))
            else:  # per-prompt seeds where the backend samples per request (SGLang); hf draws a batch from one
                batch_seeds = [int(s) for s in seeds[start : start + gen.batch_size]]
                new = self.backend.generate(chunk, replace(gen, max_new_tokens=budget, seed=batch_seeds[0]),
                                            list(stops), seeds=batch_seeds)
            advance(len(new), sum(len(o) for o in new))
            out += new
        return out


def request_seed(seed: int, prompt: Sequence[int]) -> int:
    """Per-request seed: the shard's seed and the prompt ids (independent of order and batching)."""
    digest = hashlib.sha256(json.dumps([int(t) for t in prompt], separators=(",", ":")).encode()).digest()
    return (seed + int.from_bytes(digest[:7], "big")) % (1 << 62)


def token_requests(prompts: Sequence[Sequence[int]], budgets: Sequence[int], gen: GenerationConfig,
              stops: Sequence[int], seeds: Sequence[int] | None = None) -> list[Any]:
    from redraft.engines.request import TokenRequest

    if seeds is not None and len(seeds) != len(prompts):
        raise RegenError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    return [TokenRequest(id=str(i), prompt_token_ids=[int(t) for t in p], max_tokens=int(b),
                         temperature=gen.temperature, top_p=gen.top_p,
                         seed=request_seed(gen.seed, p) if seeds is None else int(seeds[i]),
                         stop_token_ids=[int(t) for t in stops])
            for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]


def checked_outputs(rows: Sequence[dict[str, Any]], budgets: Sequence[int], stops: Sequence[int],
                    engine: str) -> list[list[int]]:
    """The rows' output ids, refused when one is not a reply the engine was asked for."""
    if len(rows) != len(budgets):
        raise RegenError(f"{engine} returned {len(rows)} replies for {len(budgets)} prompts")
    stop_set = {int(t) for t in stops}
    out = []
    for i, (row, budget) in enumerate(zip(rows, budgets, strict=True)):
        ids = [int(t) for t in row["output_token_ids"]]
        if not ids:
            raise RegenError(f"{engine} returned no tokens for prompt {i}")
        if len(ids) > budget:
            raise RegenError(f"{engine} returned {len(ids)} tokens for prompt {i}, more than its budget {budget}")
        early = next((j for j, t in enumerate(ids[:-1]) if t in stop_set), None)
        if early is not None:
            raise RegenError(f"{engine} went on past stop id {ids[early]} (reply token {early}) for prompt {i}")
        if row.get("finish_reason") == "stop" and ids[-1] not in stop_set:
            log.warning("%s stopped prompt %d at id %d, an eos id of the model that is not among the stop ids %s; "
                        "the reply is kept as generated and counted as cut", engine, i, ids[-1], sorted(stop_set))
        out.append(ids)
    return out


class VLLMRegenerator(Regenerator):
    """vLLM from the prompt ids; the engine starts at the first shard that needs it and serves every later one."""

    name = "vllm"

    def __init__(self, target_path: str | Path, *, dtype: str, max_model_len: int, kv_cache_bytes: int,
                 python: str | None = None, max_num_seqs: int | None = None,
                 gpu_memory_utilization: float | None = None) -> None:
        from redraft.engines.vllm import EngineSettings

        self.settings = EngineSettings(target=str(target_path), dtype=dtype, max_model_len=max_model_len,
                                       kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
                                       gpu_memory_utilization=gpu_memory_utilization)
        self.python = python or None
        self.engine: Any = None

    def start(self) -> Any:
        """The engine, started now if it is not yet (it loads the model: tens of seconds on a CPU)."""
        if self.engine is None:
            from redraft.engines.vllm import VLLMEngine

            with span("load"):  # counted as the stage's load, not as regeneration
                self.engine = VLLMEngine(self.settings, python=self.python, timeout_s=None,
                                         what="regeneration (vLLM)")
        return self.engine

    def generate(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], gen: GenerationConfig,
                 stops: Sequence[int], seeds: Sequence[int] | None = None) -> list[list[int]]:
        if not prompts:
            return []
        rows = self.start().generate(token_requests(prompts, budgets, gen, stops, seeds))
        out = checked_outputs(rows, budgets, stops, "vLLM")
        advance(len(out), sum(len(o) for o in out))
        return out

    def describe(self) -> dict[str, Any]:
        version = self.engine.version if self.engine is not None else None
        return {"backend": self.name, "engine": f"vllm {version}" if version else "vllm"}

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


class ServerRegenerator(Regenerator):
    """A running SGLang or vLLM server, ``concurrency`` requests in flight."""

    name = "server"

    def __init__(self, url: str, *, concurrency: int, api: str = "auto") -> None:
        from redraft.engines.server import ServerSettings, TokenServer

        if not url:
            raise RegenError("--regen-backend server needs --regen-url (e.g. http://HOST:30000)")
        self.server = TokenServer(ServerSettings(url=url, api=api, concurrency=concurrency))

    def generate(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], gen: GenerationConfig,
                 stops: Sequence[int], seeds: Sequence[int] | None = None) -> list[list[int]]:
        if not prompts:
            return []
        rows = self.server.generate(token_requests(prompts, budgets, gen, stops, seeds))
        info = self.server.info
        out = checked_outputs(rows, budgets, stops, f"{info.api if info else 'the'} server {self.server.url}")
        advance(len(out), sum(len(o) for o in out))
        return out

    def describe(self) -> dict[str, Any]:
        info = self.server.info
        if info is None:
            return {"backend": self.name}
        return {"backend": self.name, "engine": f"{info.api} {info.version or ''}".strip(), "model": info.model}


def make_regenerator(cfg: Any, backend: TargetBackend | None, target_path: str | Path) -> Regenerator:
    """The regenerator ``cfg.regen_backend`` names (an ExtractConfig); engines start when first asked.
    Only hf uses ``backend`` (the capture backend's own generate)."""
    if cfg.regen_backend == "hf":
        if backend is None:
            raise RegenError("--regen-backend hf generates with the capture backend, and none was loaded")
        return BackendRegenerator(backend)
    if cfg.regen_backend == "vllm":
        return VLLMRegenerator(target_path, dtype=cfg.dtype, max_model_len=cfg.max_length,
                               kv_cache_bytes=int(cfg.regen_kv_cache_gb * (1 << 30)),
                               python=cfg.regen_engine_python or None,
                               gpu_memory_utilization=cfg.regen_gpu_memory_utilization or None)
    if cfg.regen_backend == "server":
        return ServerRegenerator(cfg.regen_url, concurrency=cfg.regen_concurrency, api=cfg.regen_server_api)
    raise RegenError(f"regen_backend: expected one of {list(REGEN_BACKENDS)}, got {cfg.regen_backend!r}")
