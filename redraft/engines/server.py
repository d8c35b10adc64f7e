"""A running SGLang or vLLM server as a token-ids generator: prompt ids in, generated ids out.

The APIs (checked against the engines' sources):

- SGLang 0.5.23 native ``POST /generate`` with ``input_ids`` and ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``, ``no_stop_trim``,
  ``sampling_seed``; the schema refuses unknown keys) and ``return_prompt_token_ids``. The response
  carries ``output_ids`` and ``meta_info.finish_reason`` ``{type, matched}``. SGLang also stops at the
  model's own eos ids (``ignore_eos`` would switch off every token stop); ``sampling_seed`` is honoured
  only by a server started with ``--enable-deterministic-inference``.
- vLLM 0.32 ``POST /v1/completions`` with a token-id ``prompt``, ``return_token_ids`` (``choices[0]
  .token_ids`` and ``.prompt_token_ids``), ``stop_token_ids`` with ``ignore_eos`` (so exactly those
  ids stop it), ``seed``. (vLLM's token-in/token-out ``/inference/v1/generate`` needs
  ``--enable-scale-out``; the completions route is on by default.)

Every sampling knob is sent explicitly: both servers otherwise fill unset ones from the model's
``generation_config.json``. The prompt the server echoes is compared with the one sent (a server that
adds a BOS or re-tokenises is refused). Requests run concurrently with at most ``concurrency`` in
flight; connection errors, time-outs, 429 and 5xx are retried with exponential backoff; a server that
cannot be reached at all fails with an error naming its URL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from redraft.core.errors import Failure
from redraft.engines.request import TokenRequest, sglang_sampling_params

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {429, 500, 502, 503, 504}
APIS = ("auto", "sglang", "vllm")


class ServerError(Failure):
    """The server cannot be used as asked (unreachable, refused a request, answered out of contract)."""


class _Retryable(Exception):
    pass


@dataclass
class ServerSettings:
    url: str
    api: str = "auto"  # auto: SGLang when /model_info answers, else vLLM when /version does
    concurrency: int = 64  # requests in flight at most
    timeout_s: float = 1800.0  # per request
    retries: int = 5  # per request, after the first try
    backoff_s: float = 1.0  # first wait; doubles per retry (capped at 30 s)


@dataclass
class ServerInfo:
    api: str  # "sglang" or "vllm"
    model: str | None  # the served model's name (vLLM's completions need it) or path
    version: str | None


class TokenServer:
    """Ask a running server for generations; ``generate`` runs a batch of requests to completion."""

    def __init__(self, settings: ServerSettings) -> None:
        if settings.api not in APIS:
            raise ServerError(f"server api must be one of {APIS}, got {settings.api!r}")
        if settings.concurrency < 1:
            raise ServerError(f"concurrency must be >= 1, got {settings.concurrency}")
        self.settings = settings
        self.url = settings.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ServerError(f"server URL {settings.url!r} must start with http:// or https://")
        self.info: ServerInfo | None = None

    def generate(self, requests: list[TokenRequest]) -> list[dict[str, Any]]:
        """One row per request, in order: ``id``, ``output_token_ids`` (the stop id included), ``finish_reason``
        ("stop" or "length"), ``seconds`` (the request's latency)."""
        return asyncio.run(self._generate_all(requests))

    def describe(self) -> ServerInfo:
        """Which server this is (asks it once)."""
        if self.info is None:
            asyncio.run(self._describe_only())
        assert self.info is not None
        return self.info

    async def _describe_only(self) -> None:
        async with self._session() as session:
            await self._detect(session)

    def _session(self) -> aiohttp.ClientSession:
        s = self.settings
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.timeout_s),
                                     connector=aiohttp.TCPConnector(limit=s.concurrency))

    async def _generate_all(self, requests: list[TokenRequest]) -> list[dict[str, Any]]:
        if not requests:
            return []
        async with self._session() as session:
            info = await self._detect(session)
            sem = asyncio.Semaphore(self.settings.concurrency)
            t0 = time.perf_counter()
            done, last = 0, t0
            n = len(requests)

            async def one(req: TokenRequest) -> dict[str, Any]:
                nonlocal done, last
                async with sem:
                    row = await self._with_retries(session, info, req)
                done += 1
                now = time.perf_counter()
                if done == n or now - last >= 15:  # a line per 15 s and one at the end
                    last = now
                    log.info("server %s: %d/%d requests (%.0f s)", self.url, done, n, now - t0)
                return row

            tasks = [asyncio.ensure_future(one(r)) for r in requests]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    # ------------------------------------------------------------------------------------------- detection

    async def _detect(self, session: aiohttp.ClientSession) -> ServerInfo:
        if self.info is None:
            s = self.settings
            self.info = await detect_server(session, self.url, s.api, retries=s.retries, backoff_s=s.backoff_s,
                                            hint="--regen-url")
        return self.info

    # ------------------------------------------------------------------------------------------- requests

    async def _with_retries(self, session: aiohttp.ClientSession, info: ServerInfo,
                            req: TokenRequest) -> dict[str, Any]:
        s = self.settings
        for attempt in range(s.retries + 1):
            try:
                return await self._once(session, info, req)
            except (_Retryable, aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                if attempt == s.retries:
                    raise ServerError(f"server {self.url}: request {req.id} failed {s.retries + 1} times "
                                      f"({type(e).__name__}: {e})") from None
                wait = _backoff(s.backoff_s, attempt)
                log.warning("server %s: request %s: %s: %s; retrying in %.1f s", self.url, req.id,
                            type(e).__name__, e, wait)
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def _once(self, session: aiohttp.ClientSession, info: ServerInfo, req: TokenRequest) -> dict[str, Any]:
        path, body = (("/generate", sglang_request(req)) if info.api == "sglang"
                      else ("/v1/completions", vllm_request(req, info.model)))
        t0 = time.perf_counter()
        async with session.post(self.url + path, json=body) as resp:
            text = await resp.text()
            if resp.status in RETRYABLE_STATUS:
                raise _Retryable(f"HTTP {resp.status}: {text[:200]}")
            if resp.status != 200:
                raise ServerError(f"server {self.url}{path} refused request {req.id} (HTTP {resp.status}): "
                                  f"{text[:500]}")
            try:
                out = await resp.json(content_type=None)
            except ValueError:
                raise ServerError(f"server {self.url}{path}: request {req.id}: the answer is not JSON: "
                                  f"{text[:200]}") from None
        parse = parse_sglang if info.api == "sglang" else parse_vllm
        ids, finish, prompt = parse(out, req.id)
        if prompt is not None and list(prompt) != list(req.prompt_token_ids):
            raise ServerError(f"server {self.url}: request {req.id}: the server computed on other prompt ids than "
                              f"were sent ({len(prompt)} vs {len(req.prompt_token_ids)} tokens); token-exact "
                              "regeneration needs the ids as sent")
        return {"id": req.id, "output_token_ids": ids, "finish_reason": finish, "seconds": time.perf_counter() - t0}


async def detect_server(session: aiohttp.ClientSession, url: str, api: str = "auto", *, retries: int = 5,
                        backoff_s: float = 1.0, hint: str = "the URL") -> ServerInfo:
    """Which engine answers at ``url``: SGLang when ``/model_info`` (or the older ``/get_model_info``) names a
    ``model_path``, else vLLM when ``/v1/models`` lists a model (vLLM has no ``/model_info``). ``api`` other
    than "auto" restricts the check to that engine; ServerError when neither answers as asked. Shared by
    regeneration (``redraft.engines.server``) and the serving benchmark (``serve.bench``)."""
    info: ServerInfo | None = None
    if api in ("auto", "sglang"):
        for path in ("/model_info", "/get_model_info"):
            status, body = await get_json(session, url, path, retries=retries, backoff_s=backoff_s, hint=hint)
            if status == 200 and isinstance(body, dict) and "model_path" in body:
                _, server = await get_json(session, url, "/server_info", retries=retries, backoff_s=backoff_s,
                                           hint=hint)
                version = server.get("version") if isinstance(server, dict) else None
                info = ServerInfo("sglang", body.get("model_path"), version)
                break
    if info is None and api in ("auto", "vllm"):
        status, models = await get_json(session, url, "/v1/models", retries=retries, backoff_s=backoff_s, hint=hint)
        _, version = await get_json(session, url, "/version", retries=retries, backoff_s=backoff_s, hint=hint)
        if status == 200 and isinstance(models, dict) and models.get("data"):
            info = ServerInfo("vllm", str(models["data"][0].get("id")),
                              version.get("version") if isinstance(version, dict) else None)
    if info is None:
        raise ServerError(f"{url} answers, but not as an SGLang server (/model_info) or a vLLM server "
                          f"(/v1/models){' when asked for ' + api if api != 'auto' else ''}")
    log.info("server %s: %s %s serving %s", url, info.api, info.version or "", info.model)
    return info


async def get_json(session: aiohttp.ClientSession, url: str, path: str, *, retries: int = 5, backoff_s: float = 1.0,
                   hint: str = "the URL", timeout_s: float = 30.0) -> tuple[int, Any]:
    """(status, JSON or None) of ``GET url+path``; connection problems and 429/5xx retried with backoff, then a
    ServerError naming the URL (``hint``: the option that names it)."""
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                try:
                    body = await resp.json(content_type=None)
                except ValueError:
                    body = None
                if resp.status in RETRYABLE_STATUS and attempt < retries:
                    last = ServerError(f"HTTP {resp.status}")
                else:
                    return resp.status, body
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            last = e
        if attempt < retries:
            await asyncio.sleep(_backoff(backoff_s, attempt))
    raise ServerError(f"cannot reach the server at {url} ({type(last).__name__}: {last}) after "
                      f"{retries + 1} tries: start it (SGLang: python -m sglang.launch_server --model-path "
                      f"TARGET; vLLM: vllm serve TARGET) or fix {hint}")


def _backoff(first: float, attempt: int) -> float:
    return min(30.0, first * (2 ** attempt))


def sglang_request(req: TokenRequest) -> dict[str, Any]:
    """SGLang ``/generate`` body: every sampling knob explicit, the stop id kept in ``output_ids``."""
    return {"input_ids": [int(t) for t in req.prompt_token_ids], "sampling_params": sglang_sampling_params(req),
            "return_prompt_token_ids": True, "stream": False}


def vllm_request(req: TokenRequest, model: str | None) -> dict[str, Any]:
    """vLLM ``/v1/completions`` body with a token-id prompt; exactly ``stop_token_ids`` stop it when given."""
    body: dict[str, Any] = {
        "prompt": [int(t) for t in req.prompt_token_ids], "max_tokens": int(req.max_tokens),
        "temperature": float(req.temperature), "top_p": float(req.top_p) if req.temperature > 0 else 1.0,
        "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "min_tokens": 0, "n": 1, "stream": False, "return_token_ids": True, "skip_special_tokens": False,
    }
    if model:
        body["model"] = model
    if req.stop_token_ids:
        body["stop_token_ids"] = [int(t) for t in req.stop_token_ids]
        body["ignore_eos"] = True  # only the ids given stop it, as in the other backends
    if req.temperature > 0 and req.seed is not None:
        body["seed"] = int(req.seed)
    return body


def _stop_id(matched: Any) -> int | None:
    return matched if isinstance(matched, int) and not isinstance(matched, bool) else None


def parse_sglang(out: Any, rid: str) -> tuple[list[int], str, list[int] | None]:
    """(output ids with the matched stop id, "stop" | "length", the prompt ids the server used or None)."""
    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict) or "output_ids" not in out:
        raise ServerError(f"SGLang answer to request {rid} has no output_ids/meta_info (keys: "
                          f"{sorted(out) if isinstance(out, dict) else type(out).__name__})")
    ids = [int(t) for t in out["output_ids"]]
    finish = out["meta_info"].get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length"):
        raise _Retryable(f"SGLang finished request {rid} with {finish!r}")
    matched = _stop_id(finish.get("matched")) if isinstance(finish, dict) else None
    if kind == "stop" and matched is not None and (not ids or ids[-1] != matched):
        ids.append(matched)
    prompt = out.get("prompt_token_ids")
    return ids, kind, [int(t) for t in prompt] if isinstance(prompt, list) else None


def parse_vllm(out: Any, rid: str) -> tuple[list[int], str, list[int] | None]:
    """The same for vLLM's completions answer (``return_token_ids``)."""
    choices = out.get("choices") if isinstance(out, dict) else None
    if not choices or not isinstance(choices[0], dict) or choices[0].get("token_ids") is None:
        raise ServerError(f"vLLM answer to request {rid} has no choices[0].token_ids (is return_token_ids "
                          f"supported by this server? answer: {str(out)[:200]})")
    c = choices[0]
    ids = [int(t) for t in c["token_ids"]]
    kind = c.get("finish_reason")
    if kind not in ("stop", "length"):
        raise _Retryable(f"vLLM finished request {rid} with {kind!r}")
    matched = _stop_id(c.get("stop_reason"))
    if kind == "stop" and matched is not None and (not ids or ids[-1] != matched):
        ids.append(matched)
    prompt = c.get("prompt_token_ids")
    return ids, kind, [int(t) for t in prompt] if isinstance(prompt, list) else None
