"""The transport of ``serve.bench``: one streamed request with bounded time-outs and retries, and a closed loop.

APIs, per engine (``Target.engine`` x ``Target.api``):

- SGLang, native: ``POST /generate`` with ``input_ids`` (templated client-side); each answer's
  ``meta_info`` carries ``completion_tokens`` and ``spec_verify_ct`` (per-request acceptance).
- vLLM, native: ``POST /v1/completions`` with the token ids as ``prompt`` (a list of ints: no second
  template, no second BOS); acceptance comes from ``/metrics``, not from the answer.
- either engine, openai: ``POST /v1/chat/completions``; the server applies its chat template.

Every request streams (SSE) so TTFT is measured: time to the first chunk carrying generated text.
Connection errors, time-outs, 5xx and 429 are retried (at most ``retries`` times, exponential backoff).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from redraft.engines.server import RETRYABLE_STATUS
from redraft.engines.sglang_driver import spec_counters
from serve.acceptance import sglang_request_acceptance
from serve.report import RequestResult

logger = logging.getLogger("serve.bench")


class RequestFailed(Exception):
    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class RequestSettings:
    """What every request of a run carries, and how long and how often it may be tried."""

    max_tokens: int = 256
    temperature: float = 0.0
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float = 300.0
    connect_timeout: float = 10.0
    retries: int = 2
    retry_backoff: float = 0.5


@dataclass
class Target:
    """A server and how to talk to it."""

    role: str  # "base" | "eagle"
    url: str
    api: str  # "native" | "openai"
    engine: str = "sglang"  # "sglang" | "vllm"
    model: str = "default"


def build_payload(target: Target, rs: RequestSettings, prompt: str, input_ids: list[int] | None) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request."""
    if target.api == "native" and target.engine == "sglang":
        params: dict[str, Any] = {"max_new_tokens": rs.max_tokens, "temperature": rs.temperature}
        if rs.ignore_eos:
            params["ignore_eos"] = True
        return "/generate", {"input_ids": input_ids, "sampling_params": params, "stream": True}
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": rs.max_tokens,
        "temperature": rs.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if rs.ignore_eos:
        body["ignore_eos"] = True
    if target.api == "native":  # vLLM: the rendered prompt's ids, as SGLang's /generate gets them
        body["prompt"] = [int(t) for t in input_ids or []]
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": prompt}]
    if rs.chat_template_kwargs:
        body["chat_template_kwargs"] = rs.chat_template_kwargs
    return "/v1/chat/completions", body


async def _stream_once(session: aiohttp.ClientSession, target: Target, path: str, body: dict,
                       timeout: aiohttp.ClientTimeout) -> RequestResult:
    t0 = time.perf_counter()
    ttft: float | None = None
    meta: dict[str, Any] = {}
    usage_tokens: int | None = None
    content_chunks = 0
    done = False
    sglang_native = path == "/generate"
    async with session.post(target.url + path, json=body, timeout=timeout) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise RequestFailed(f"HTTP {resp.status} from {target.url}{path}: {text}",
                                retryable=resp.status in RETRYABLE_STATUS)
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError as e:
                raise RequestFailed(f"bad SSE chunk from {target.url}{path}: {payload[:120]!r}", False) from e
            if isinstance(chunk, dict) and chunk.get("error"):
                raise RequestFailed(f"server error from {target.url}{path}: {chunk['error']}", False)
            if sglang_native:
                m = chunk.get("meta_info") or {}
                if ttft is None and (chunk.get("text") or m.get("completion_tokens") or chunk.get("output_ids")):
                    ttft = time.perf_counter() - t0
                meta = m or meta
                continue
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
                    content_chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            if isinstance(chunk.get("meta_info"), dict):
                meta = chunk["meta_info"]
    latency = time.perf_counter() - t0
    if not done:
        raise RequestFailed(f"stream from {target.url}{path} ended before [DONE] (connection dropped?)", True)
    tokens = meta.get("completion_tokens")
    if tokens is None:
        tokens = usage_tokens if usage_tokens is not None else content_chunks
    verify, accept = sglang_request_acceptance(meta, int(tokens))
    return RequestResult(ok=True, latency_s=latency, ttft_s=ttft, completion_tokens=int(tokens),
                         spec_verify_ct=verify, spec_accept_length=accept,
                         spec_counts=spec_counters(meta) if verify else None)


async def send_request(session: aiohttp.ClientSession, target: Target, rs: RequestSettings, prompt: str,
                       input_ids: list[int] | None) -> RequestResult:
    """One request with a bounded time-out per attempt and at most ``rs.retries`` retries."""
    path, body = build_payload(target, rs, prompt, input_ids)
    timeout = aiohttp.ClientTimeout(total=rs.timeout, sock_connect=rs.connect_timeout)
    error = ""
    for attempt in range(rs.retries + 1):
        if attempt:
            await asyncio.sleep(min(rs.retry_backoff * 2 ** (attempt - 1), 5.0))
        try:
            result = await _stream_once(session, target, path, body, timeout)
            result.attempts = attempt + 1
            return result
        except RequestFailed as e:
            error = str(e)
            if not e.retryable:
                return RequestResult(ok=False, attempts=attempt + 1, error=error)
        except (asyncio.TimeoutError, TimeoutError):
            error = f"timed out after {rs.timeout:g}s ({target.url}{path})"
        except aiohttp.ClientError as e:
            error = f"{type(e).__name__} from {target.url}{path}: {e}"
        logger.debug("attempt %d failed: %s", attempt + 1, error)
    return RequestResult(ok=False, attempts=rs.retries + 1, error=error)


async def run_level(session: aiohttp.ClientSession, target: Target, rs: RequestSettings, prompts: Sequence[str],
                    ids: Sequence[list[int]] | None, concurrency: int,
                    n_requests: int) -> tuple[list[RequestResult], float]:
    """Closed loop: ``concurrency`` workers, each sending its next request when the previous one ends."""
    results: list[RequestResult] = []
    counter = iter(range(n_requests))

    async def worker() -> None:
        for i in counter:
            k = i % len(prompts)
            results.append(await send_request(session, target, rs, prompts[k], ids[k] if ids else None))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
    return results, time.perf_counter() - t0


def requests_for(concurrency: int, num_prompts: int, min_rounds: int) -> int:
    """Every prompt once, and at least ``min_rounds`` requests per worker so the server stays at that load."""
    return max(num_prompts, min_rounds * concurrency)
