"""Serving benchmark for SGLang: base against EAGLE-3, side by side, on chat-templated traffic.

    python -m eval.serving --base http://node1:30000 --eagle http://node2:30000 \\
        --tokenizer /models/Kimi-K2.5 --trust-remote-code --concurrency 1,8,32,128 --json bench.json

Why a tool of our own: a server that is "RUNNING" is not a speed-up. What decides is measured
tokens/s, TPOT and TTFT at each concurrency, the acceptance length the server really achieves,
and the server's own limits (SGLang caps speculative serving at 48 running requests unless told
otherwise). All of it is read here, per request, and printed next to the base server's numbers.

API choice (``--api``):
- ``native`` (SGLang ``/generate``): the only API whose responses carry ``meta_info`` with
  ``spec_verify_ct``, so the only one that measures acceptance. ``/generate`` does not apply a chat
  template, so prompts are templated client-side with ``--tokenizer`` (the target's folder) and sent
  as ``input_ids`` (no second BOS). Raw-text prompts would measure acceptance on traffic the drafter
  never sees; without ``--tokenizer`` native mode is refused.
- ``openai`` (``/v1/chat/completions``): the server applies its chat template; responses carry no
  ``meta_info`` (acceptance is reported as n/a, unless a server adds ``meta_info`` to its chunks).
- ``auto`` (default): native when ``--tokenizer`` is given, else openai.

Every request streams (SSE) so TTFT is measured; each has a bounded time-out and a bounded number
of retries (connection errors, time-outs, 5xx and 429). A server that cannot be reached fails fast
with an error naming its URL. See ``eval/serving_report.py`` for the definitions of every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from core.config import parse_hyphenated
from eval.serving_report import (
    RequestResult,
    build_report,
    render_report_text,
    summarize,
    write_json,
    write_markdown,
    write_plot,
)

logger = logging.getLogger("eval.serving")

SGLANG_SPEC_DEFAULT_MAX_RUNNING = 48  # speculative_hook._handle_eagle_family when --max-running-requests is unset
RETRYABLE_STATUS = {429, 500, 502, 503, 504}
INFO_KEYS = (
    "model_path", "version", "tp_size", "context_length", "max_running_requests", "cuda_graph_max_bs",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens",
)


class ServingError(RuntimeError):
    """A condition that stops the benchmark (unreachable server, bad options, unusable prompts)."""


class RequestFailed(Exception):
    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class ServingConfig:
    base: str | None = None
    eagle: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 128])
    max_tokens: int = 256
    prompts: str | None = None  # None: MT-bench (first turns)
    num_prompts: int = 80
    min_rounds: int = 2
    warmup: int = 4
    timeout: float = 300.0
    connect_timeout: float = 10.0
    retries: int = 2
    retry_backoff: float = 0.5
    api: str = "auto"
    tokenizer: str | None = None
    trust_remote_code: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    json_path: str | None = None
    markdown_path: str | None = None
    plot_path: str | None = None


# ---------------------------------------------------------------------------------------------------------
# Prompts


def _first_user_turn(rec: Any) -> str | None:
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    for key in ("prompt", "question", "instruction", "text"):
        if isinstance(rec.get(key), str):
            return rec[key]
    for key, role_key, text_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        msgs = rec.get(key)
        if isinstance(msgs, list):
            for m in msgs:
                if isinstance(m, dict) and m.get(role_key) in ("user", "human"):
                    text = m.get(text_key, m.get("content"))
                    if isinstance(text, str):
                        return text
    return None


def load_prompts(path: str | None, num: int) -> tuple[list[str], str]:
    """First user turns from a JSONL/JSON/text file (default: the embedded MT-bench questions).

    JSONL records may carry ``turns`` (MT-bench), ``prompt``/``question``/``instruction``/``text``,
    OpenAI ``messages`` or ShareGPT ``conversations``; a ``.txt`` file holds one prompt per line.
    """
    if path is None:
        from core.embedded import resolve_data

        src = Path(resolve_data("mtbench"))
    else:
        src = Path(path)
        if not src.is_file():
            raise ServingError(f"--prompts {path}: no such file")
    prompts: list[str] = []
    if src.suffix == ".txt":
        prompts = [line.strip() for line in src.read_text().splitlines() if line.strip()]
    elif src.suffix == ".json":
        try:
            data = json.loads(src.read_text())
        except json.JSONDecodeError as e:
            raise ServingError(f"{src}: not valid JSON ({e})") from e
        for i, rec in enumerate(data if isinstance(data, list) else []):
            text = _first_user_turn(rec)
            if text is None:
                raise ServingError(f"{src}: record {i} has no prompt (turns, prompt, messages, conversations)")
            prompts.append(text)
    else:
        with src.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ServingError(f"{src}:{lineno}: not valid JSON ({e})") from e
                text = _first_user_turn(rec)
                if text is None:
                    raise ServingError(
                        f"{src}:{lineno}: no prompt (expected turns, prompt, question, text, messages or conversations)")
                prompts.append(text)
                if num and len(prompts) >= num:
                    break
    if num:
        prompts = prompts[:num]
    if not prompts:
        raise ServingError(f"{src}: no prompts")
    return prompts, str(src)


def encode_chat_prompts(prompts: Sequence[str], tokenizer_path: str, trust_remote_code: bool,
                        chat_template_kwargs: dict[str, Any]) -> list[list[int]]:
    """Token ids of [user prompt] + generation prompt, rendered with the target's own template."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ServingError(f"--tokenizer {tokenizer_path}: cannot load ({type(e).__name__}: {e})") from e
    if not getattr(tok, "chat_template", None):
        raise ServingError(f"--tokenizer {tokenizer_path}: has no chat template")
    out = []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True, **chat_template_kwargs)
        # The template renders BOS itself; adding special tokens again would double it.
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


# ---------------------------------------------------------------------------------------------------------
# Server info


def parse_server_info(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields we print and check, from SGLang's ``/server_info`` (server args + scheduler info + states)."""
    info = {k: raw.get(k) for k in INFO_KEYS}
    states = raw.get("internal_states")
    state = states[0] if isinstance(states, list) and states else states if isinstance(states, dict) else {}
    info["avg_spec_accept_length"] = state.get("avg_spec_accept_length") if isinstance(state, dict) else None
    if info["max_running_requests"] is None and isinstance(state, dict):
        info["max_running_requests"] = state.get("max_running_requests")
    return info


def server_warnings(role: str, info: dict[str, Any], concurrency: Sequence[int], found: bool) -> list[str]:
    """Loud, specific warnings: the 48 cap, concurrency above the server's limits, a mislabelled server."""
    if not found:
        return ["the server exposes neither /server_info nor /get_server_info: its speculative settings "
                "and max_running_requests are unknown"]
    out = []
    spec = info.get("speculative_algorithm")
    mrr = info.get("max_running_requests")
    top = max(concurrency) if concurrency else 0
    if spec and mrr == SGLANG_SPEC_DEFAULT_MAX_RUNNING:
        out.append(
            f"speculative server ({spec}) runs with max_running_requests = 48, SGLang's cap for speculative "
            "decoding when --max-running-requests is not given (or it was set to 48): requests above 48 queue. "
            "This cap turned 2,370 tok/s into 849 tok/s in the write-up this project started from. Relaunch "
            "with an explicit --max-running-requests N --cuda-graph-max-bs N (slurm/serve.sh does).")
    elif spec and mrr is None:
        out.append(f"speculative server ({spec}) does not report max_running_requests: SGLang caps speculative "
                   "serving at 48 unless --max-running-requests is given")
    if isinstance(mrr, int) and top > mrr:
        out.append(f"concurrency {top} exceeds max_running_requests {mrr}: the extra requests queue, "
                   "so throughput at that setting measures the cap, not the decoder")
    cg = info.get("cuda_graph_max_bs")
    if isinstance(cg, int) and spec and top > cg:
        out.append(f"concurrency {top} exceeds cuda_graph_max_bs {cg}: larger batches run without CUDA graphs")
    if role == "eagle" and not spec:
        out.append("the --eagle server reports no speculative_algorithm: it is not running a drafter")
    if role == "base" and spec:
        out.append(f"the --base server runs speculative decoding ({spec}): it is not a baseline")
    return out


async def fetch_server_info(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[dict, bool]:
    """GET /server_info, falling back to /get_server_info (older SGLang); unreachable → ServingError."""
    t = aiohttp.ClientTimeout(total=timeout)
    for path in ("/server_info", "/get_server_info"):
        try:
            async with session.get(url + path, timeout=t) as resp:
                if resp.status == 404:
                    continue
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise ServingError(f"{url}{path}: HTTP {resp.status}: {text}")
                return await resp.json(content_type=None), True
        except aiohttp.ClientConnectorError as e:
            raise ServingError(f"cannot connect to {url}: {e.os_error or e}. Is the server up? "
                               "(Kimi-K2.5 takes 5-10 minutes to load before it answers)") from e
        except (asyncio.TimeoutError, TimeoutError) as e:
            raise ServingError(f"{url}{path} did not answer within {timeout:.0f}s") from e
        except (aiohttp.ClientError, json.JSONDecodeError) as e:
            raise ServingError(f"{url}{path}: {type(e).__name__}: {e}") from e
    return {}, False


async def fetch_model_id(session: aiohttp.ClientSession, url: str, timeout: float) -> str:
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status == 200:
                data = (await resp.json(content_type=None)).get("data") or []
                if data and isinstance(data[0], dict) and data[0].get("id"):
                    return str(data[0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, json.JSONDecodeError, AttributeError):
        pass
    return "default"


# ---------------------------------------------------------------------------------------------------------
# One request


@dataclass
class Target:
    """A server and how to talk to it."""

    role: str
    url: str
    api: str  # "native" | "openai"
    model: str = "default"


def build_payload(target: Target, cfg: ServingConfig, prompt: str, input_ids: list[int] | None) -> tuple[str, dict]:
    if target.api == "native":
        params: dict[str, Any] = {"max_new_tokens": cfg.max_tokens, "temperature": cfg.temperature}
        if cfg.ignore_eos:
            params["ignore_eos"] = True
        return "/generate", {"input_ids": input_ids, "sampling_params": params, "stream": True}
    body: dict[str, Any] = {
        "model": target.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.chat_template_kwargs:
        body["chat_template_kwargs"] = cfg.chat_template_kwargs
    return "/v1/chat/completions", body


async def _stream_once(session: aiohttp.ClientSession, target: Target, path: str, body: dict,
                       timeout: aiohttp.ClientTimeout) -> RequestResult:
    t0 = time.perf_counter()
    ttft: float | None = None
    meta: dict[str, Any] = {}
    usage_tokens: int | None = None
    content_chunks = 0
    done = False
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
            if target.api == "native":
                m = chunk.get("meta_info") or {}
                if ttft is None and (chunk.get("text") or m.get("completion_tokens") or chunk.get("output_ids")):
                    ttft = time.perf_counter() - t0
                meta = m or meta
            else:
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
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
    verify = meta.get("spec_verify_ct")
    accept = meta.get("spec_accept_length")
    if accept is None and verify:
        accept = tokens / verify
    return RequestResult(ok=True, latency_s=latency, ttft_s=ttft, completion_tokens=int(tokens),
                         spec_verify_ct=int(verify) if verify else None,
                         spec_accept_length=float(accept) if accept is not None else None)


async def send_request(session: aiohttp.ClientSession, target: Target, cfg: ServingConfig, prompt: str,
                       input_ids: list[int] | None) -> RequestResult:
    """One request with a bounded time-out per attempt and at most ``cfg.retries`` retries."""
    path, body = build_payload(target, cfg, prompt, input_ids)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout, sock_connect=cfg.connect_timeout)
    error = ""
    for attempt in range(cfg.retries + 1):
        if attempt:
            await asyncio.sleep(min(cfg.retry_backoff * 2 ** (attempt - 1), 5.0))
        try:
            result = await _stream_once(session, target, path, body, timeout)
            result.attempts = attempt + 1
            return result
        except RequestFailed as e:
            error = str(e)
            if not e.retryable:
                return RequestResult(ok=False, attempts=attempt + 1, error=error)
        except (asyncio.TimeoutError, TimeoutError):
            error = f"timed out after {cfg.timeout:g}s ({target.url}{path})"
        except aiohttp.ClientError as e:
            error = f"{type(e).__name__} from {target.url}{path}: {e}"
        logger.debug("attempt %d failed: %s", attempt + 1, error)
    return RequestResult(ok=False, attempts=cfg.retries + 1, error=error)


# ---------------------------------------------------------------------------------------------------------
# Settings


async def run_level(session: aiohttp.ClientSession, target: Target, cfg: ServingConfig, prompts: Sequence[str],
                    ids: Sequence[list[int]] | None, concurrency: int, n_requests: int) -> tuple[list[RequestResult], float]:
    """Closed loop: ``concurrency`` workers, each sending its next request when the previous one ends."""
    results: list[RequestResult] = []
    counter = iter(range(n_requests))

    async def worker() -> None:
        for i in counter:
            k = i % len(prompts)
            results.append(await send_request(session, target, cfg, prompts[k], ids[k] if ids else None))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
    return results, time.perf_counter() - t0


def requests_for(concurrency: int, num_prompts: int, min_rounds: int) -> int:
    """Every prompt once, and at least ``min_rounds`` requests per worker so the server stays at that load."""
    return max(num_prompts, min_rounds * concurrency)


async def bench_server(target: Target, cfg: ServingConfig, prompts: Sequence[str],
                       ids: Sequence[list[int]] | None) -> dict[str, Any]:
    top = max(cfg.concurrency)
    info_timeout = min(cfg.timeout, max(cfg.connect_timeout, 30.0))
    connector = aiohttp.TCPConnector(limit=top + 8)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=2**20) as session:
        raw, found = await fetch_server_info(session, target.url, info_timeout)
        info = parse_server_info(raw)
        warnings = server_warnings(target.role, info, cfg.concurrency, found)
        for w in warnings:
            logger.warning("!!! %s (%s): %s", target.role, target.url, w)
        if target.api == "openai":
            target.model = cfg.model or await fetch_model_id(session, target.url, info_timeout)
        if cfg.warmup > 0:
            logger.info("%s: warm-up, %d requests", target.url, cfg.warmup)
            warm, _ = await run_level(session, target, cfg, prompts, ids, min(cfg.warmup, 8), cfg.warmup)
            if not any(r.ok for r in warm):
                raise ServingError(f"{target.url}: every warm-up request failed: {warm[0].error}")
        levels = []
        for c in cfg.concurrency:
            n = requests_for(c, len(prompts), cfg.min_rounds)
            logger.info("%s: concurrency %d, %d requests", target.url, c, n)
            results, duration = await run_level(session, target, cfg, prompts, ids, c, n)
            stats = summarize(results, c, duration)
            if stats.errors:
                logger.warning("%s: concurrency %d: %d/%d requests failed, e.g. %s", target.url, c, stats.errors,
                               stats.requests, stats.error_samples[0])
            levels.append(stats)
        if found:  # the cumulative server-side acceptance, after our traffic
            raw_after, _ = await fetch_server_info(session, target.url, info_timeout)
            info["avg_spec_accept_length"] = parse_server_info(raw_after).get("avg_spec_accept_length")
    return {"url": target.url, "api": target.api, "info": info, "server_info_found": found,
            "warnings": warnings, "levels": levels}


def resolve_api(cfg: ServingConfig) -> str:
    if cfg.api == "auto":
        return "native" if cfg.tokenizer else "openai"
    if cfg.api == "native" and not cfg.tokenizer:
        raise ServingError("--api native needs --tokenizer (the target's folder): SGLang's /generate applies no "
                           "chat template, and raw-text prompts give misleading acceptance. Pass --tokenizer, "
                           "or use --api openai (no acceptance numbers).")
    if cfg.api == "openai" and cfg.tokenizer:
        logger.info("--api openai: the server applies its own chat template; --tokenizer is not used")
    return cfg.api


async def run_benchmark(cfg: ServingConfig) -> dict[str, Any]:
    """Both servers (or one), in turn: server info, warm-up, the concurrency sweep; returns the report dict."""
    if not cfg.base and not cfg.eagle:
        raise ServingError("give --base URL, --eagle URL, or both")
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise ServingError(f"--concurrency must be positive integers, got {cfg.concurrency}")
    api = resolve_api(cfg)
    prompts, source = load_prompts(cfg.prompts, cfg.num_prompts)
    ids = None
    if api == "native":
        ids = encode_chat_prompts(prompts, str(cfg.tokenizer), cfg.trust_remote_code, cfg.chat_template_kwargs)
    servers = {}
    for role, url in (("base", cfg.base), ("eagle", cfg.eagle)):
        if url:
            servers[role] = await bench_server(Target(role, url.rstrip("/"), api), cfg, prompts, ids)
    settings = {
        "api": api, "concurrency": cfg.concurrency, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
        "ignore_eos": cfg.ignore_eos, "prompts": source, "num_prompts": len(prompts), "min_rounds": cfg.min_rounds,
        "warmup": cfg.warmup, "timeout_s": cfg.timeout, "retries": cfg.retries, "tokenizer": cfg.tokenizer,
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return build_report(settings, servers)


# ---------------------------------------------------------------------------------------------------------
# CLI


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.serving",
        description="Benchmark SGLang servers: base vs EAGLE-3 side by side (tokens/s, TPOT, TTFT, acceptance).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Acceptance length = Σ completion tokens / Σ spec_verify_ct from SGLang's per-request meta_info "
               "(native API only). Exit status: 0 ok, 1 a setting had no successful request, 2 bad options or "
               "an unreachable server.")
    p.add_argument("--base", help="URL of the server without speculative decoding, e.g. http://host:30000")
    p.add_argument("--eagle", help="URL of the server running the EAGLE-3 drafter")
    p.add_argument("--concurrency", type=_int_list, default=[1, 8, 32, 128],
                   help="comma-separated concurrent streams per setting (1 = single stream)")
    p.add_argument("--max-tokens", type=int, default=256, help="max new tokens per request")
    p.add_argument("--prompts", help="prompt file: JSONL (turns/prompt/messages/conversations), JSON list or .txt; "
                                     "default: the embedded MT-bench questions (first turns)")
    p.add_argument("--num-prompts", type=int, default=80, help="use the first N prompts (0: all)")
    p.add_argument("--min-rounds", type=int, default=2,
                   help="each setting sends max(N prompts, min-rounds x concurrency) requests")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per server before measuring (0: none)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request attempt may take")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to open a connection")
    p.add_argument("--retries", type=int, default=2,
                   help="retries per request after a connection error, time-out, 5xx or 429")
    p.add_argument("--api", choices=["auto", "native", "openai"], default="auto",
                   help="native: /generate with client-side chat template (needs --tokenizer; measures "
                        "acceptance); openai: /v1/chat/completions (acceptance n/a); auto: native iff --tokenizer")
    p.add_argument("--tokenizer", help="target model/tokenizer folder whose chat template renders the prompts")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the tokenizer's custom code (Kimi-K2.5 needs it; only for folders you trust)")
    p.add_argument("--chat-template-kwargs", type=_json_dict, default={},
                   help='JSON object passed to the chat template, e.g. \'{"thinking": true}\'')
    p.add_argument("--model", help="model name for the OpenAI API (default: the first id from /v1/models)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-tokens per request (fixed length; text after EOS is not "
                        "representative for acceptance)")
    p.add_argument("--json", dest="json_path", help="write the full report as JSON here")
    p.add_argument("--markdown", dest="markdown_path", help="write the tables as Markdown here")
    p.add_argument("--plot", dest="plot_path", help="write a PNG of tokens/s against concurrency here")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def config_from_args(args: argparse.Namespace) -> ServingConfig:
    if args.max_tokens < 1 or args.timeout <= 0 or args.retries < 0 or args.num_prompts < 0 or args.warmup < 0:
        raise ServingError("--max-tokens and --timeout must be positive; --retries, --num-prompts, --warmup >= 0")
    return ServingConfig(
        base=args.base, eagle=args.eagle, concurrency=args.concurrency, max_tokens=args.max_tokens,
        prompts=args.prompts, num_prompts=args.num_prompts, min_rounds=max(args.min_rounds, 1), warmup=args.warmup,
        timeout=args.timeout, connect_timeout=args.connect_timeout, retries=args.retries, api=args.api,
        tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code,
        chat_template_kwargs=args.chat_template_kwargs, model=args.model, temperature=args.temperature,
        ignore_eos=args.ignore_eos, json_path=args.json_path, markdown_path=args.markdown_path,
        plot_path=args.plot_path,
    )


def write_outputs(report: dict[str, Any], cfg: ServingConfig) -> None:
    if cfg.json_path:
        write_json(report, Path(cfg.json_path))
    if cfg.markdown_path:
        write_markdown(report, Path(cfg.markdown_path))
    if cfg.plot_path:
        write_plot(report, Path(cfg.plot_path))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_hyphenated(build_parser(), argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        report = asyncio.run(run_benchmark(cfg))
    except ServingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render_report_text(report))
    write_outputs(report, cfg)
    failed = [(role, lv["concurrency"]) for role, s in report["servers"].items() for lv in s["levels"] if lv["ok"] == 0]
    if failed:
        print(f"error: no successful request at {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
