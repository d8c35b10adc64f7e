"""A local stand-in for an SGLang server (the engine needs a GPU), answering with SGLang's response schema.

Endpoints, as SGLang 0.5.x serves them:
- ``GET /model_info``: ``model_path`` (how ``redraft.engines.server.detect_server`` tells SGLang from vLLM).
- ``GET /server_info`` (or only the legacy ``/get_server_info``): server args at the top level
  (``speculative_*``, ``max_running_requests``, ``cuda_graph_max_bs``, ``context_length`` ...),
  ``internal_states`` (a list, one per DP rank, with ``avg_spec_accept_length``) and ``version``.
- ``POST /generate`` with ``stream: true``: SSE ``data: {"text", "output_ids", "meta_info"}`` chunks, text
  cumulative, ``meta_info.completion_tokens`` cumulative; the last chunk carries ``finish_reason`` and,
  on a speculative server, ``spec_verify_ct``, ``spec_accept_length``, ``spec_accept_rate``,
  ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``; then ``data: [DONE]``.
- ``POST /v1/chat/completions`` with ``stream: true``: OpenAI chunks (``choices[0].delta.content``), a usage
  chunk when ``stream_options.include_usage``, then ``data: [DONE]``; no ``meta_info``.
- ``GET /v1/models``.

Behaviour knobs reproduce the failures the client must survive: a server that sleeps, one that drops
connections before answering or in the middle of a stream, and per-request (tokens, verify steps)
schedules with known acceptance answers. Bound to 127.0.0.1 on a free port, in a background thread.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeBehaviour:
    speculative: bool = True
    max_running_requests: int | None = 48
    cuda_graph_max_bs: int | None = None
    # (completion_tokens, spec_verify_ct) per request, cycled in arrival order; None: max tokens, 3 per step.
    schedule: list[tuple[int, int]] | None = None
    step_delay_s: float = 0.0  # between streamed chunks
    first_token_delay_s: float = 0.0
    sleep_s: float = 0.0  # before answering /generate or /v1/chat/completions
    drop_first: int = 0  # this many generation requests get their connection closed before any byte
    drop_mid_stream: bool = False  # every generation request is cut after its first chunk
    info_path: str = "/server_info"  # "/server_info", "/get_server_info" (legacy only) or "" (neither)
    model_id: str = "fake-kimi"
    avg_spec_accept_length: float = 2.5


@dataclass
class FakeSGLang:
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    requests: list[dict[str, Any]] = field(default_factory=list)
    generation_calls: int = 0
    url: str = ""

    # ---- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> FakeSGLang:
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("fake SGLang server did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        b = self.behaviour
        app.router.add_get("/model_info", self._model_info)
        if b.info_path:
            app.router.add_get(b.info_path, self._server_info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        started.set()
        self._loop.run_forever()

    # ---- endpoints ---------------------------------------------------------------------------------------
    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/models/Kimi-K2.5", "tokenizer_path": "/models/Kimi-K2.5",
                                  "is_generation": True})

    async def _server_info(self, request: web.Request) -> web.Response:
        b = self.behaviour
        spec = b.speculative
        return web.json_response({
            "model_path": "/models/Kimi-K2.5",
            "tp_size": 8,
            "context_length": 262144,
            "speculative_algorithm": "EAGLE3" if spec else None,
            "speculative_draft_model_path": "/drafts/kimi-k25" if spec else None,
            "speculative_num_steps": 3 if spec else None,
            "speculative_eagle_topk": 1 if spec else None,
            "speculative_num_draft_tokens": 4 if spec else None,
            "max_running_requests": b.max_running_requests,
            "cuda_graph_max_bs": b.cuda_graph_max_bs,
            "max_total_num_tokens": 1_000_000,
            "internal_states": [{
                "avg_spec_accept_length": b.avg_spec_accept_length if spec else None,
                "last_gen_throughput": 123.0,
            }],
            "version": "0.5.23",
        })

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.behaviour.model_id, "object": "model"}]})

    def _plan(self, index: int, max_tokens: int) -> tuple[int, int]:
        sched = self.behaviour.schedule
        if sched:
            tokens, verify = sched[index % len(sched)]
            return min(tokens, max_tokens), verify
        return max_tokens, math.ceil(max_tokens / 3) if self.behaviour.speculative else max_tokens

    @staticmethod
    def _chunk_sizes(tokens: int, verify: int) -> list[int]:
        """First token from prefill, the rest spread over the verify steps (one chunk per step)."""
        if tokens <= 0:
            return []
        rest, steps = tokens - 1, max(min(verify, tokens - 1), 1)
        sizes = [1] + [rest // steps + (1 if i < rest % steps else 0) for i in range(steps)]
        return [s for s in sizes if s > 0]

    async def _begin(self, request: web.Request) -> tuple[dict[str, Any], int] | None:
        body = await request.json()
        self.requests.append(body)
        index = self.generation_calls
        self.generation_calls += 1
        b = self.behaviour
        if index < b.drop_first:
            request.transport.abort()
            return None
        if b.sleep_s:
            await asyncio.sleep(b.sleep_s)
        return body, index

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        begun = await self._begin(request)
        if begun is None:
            return web.Response(status=500)
        body, index = begun
        params = body.get("sampling_params") or {}
        tokens, verify = self._plan(index, int(params.get("max_new_tokens", 128)))
        b = self.behaviour
        resp = await self._sse(request)
        await asyncio.sleep(b.first_token_delay_s)
        done, text = 0, ""
        sizes = self._chunk_sizes(tokens, verify)
        for n, size in enumerate(sizes):
            if n:
                await asyncio.sleep(b.step_delay_s)
            done += size
            text += " tok" * size
            last = n == len(sizes) - 1
            meta: dict[str, Any] = {
                "id": f"req-{index}", "prompt_tokens": len(body.get("input_ids") or []),
                "completion_tokens": done, "cached_tokens": 0,
                "finish_reason": {"type": "length", "length": tokens} if last else None,
            }
            if last and b.speculative:
                meta.update({
                    "spec_verify_ct": verify,
                    "spec_accept_length": tokens / verify,
                    "spec_accept_rate": (tokens - verify) / (verify * 3),
                    "spec_num_correct_drafts": tokens - verify,
                    "spec_num_proposed_drafts": verify * 3,
                })
            await resp.write(b"data: " + json.dumps({"text": text, "output_ids": [7] * done,
                                                     "meta_info": meta}).encode() + b"\n\n")
            if b.drop_mid_stream:
                request.transport.abort()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        begun = await self._begin(request)
        if begun is None:
            return web.Response(status=500)
        body, index = begun
        tokens, _ = self._plan(index, int(body.get("max_tokens", 128)))
        b = self.behaviour
        resp = await self._sse(request)
        base = {"id": f"chatcmpl-{index}", "object": "chat.completion.chunk", "created": 0, "model": b.model_id}

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        await asyncio.sleep(b.first_token_delay_s)
        for n in range(tokens):
            if n:
                await asyncio.sleep(b.step_delay_s)
            await send({**base, "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]})
            if b.drop_mid_stream:
                request.transport.abort()
                return resp
        await send({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": tokens,
                                                          "total_tokens": 10 + tokens}})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
