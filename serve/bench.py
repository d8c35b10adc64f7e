"""Serving benchmark, SGLang or vLLM: base against EAGLE-3, side by side, on chat-templated traffic.

    python -m serve.bench --base http://node1:30000 --eagle http://node2:30000 \\
        --tokenizer /models/Kimi-K2.5 --trust-remote-code --concurrency 1,8,32,128 --json bench.json

Why a tool of our own: a server that is "RUNNING" is not a speed-up. What decides is measured
tokens/s, TPOT and TTFT at each concurrency, the acceptance length the server really achieves,
and the server's own limits (SGLang caps speculative serving at 48 running requests unless told
otherwise). All of it is read here and printed next to the base server's numbers.

Engine (``--engine``; default: detected per server by ``redraft.engines.server.detect_server``, SGLang
when ``/model_info`` answers, else vLLM when ``/v1/models`` does). Acceptance is the engine's own:

- SGLang: per request from ``meta_info.spec_verify_ct``, so only its native API measures it;
  ``/server_info`` gives the speculative settings (and the 48-request cap, warned about).
- vLLM: the difference of the ``/metrics`` spec-decode counters read before and after each
  concurrency setting: τ = 1 + accepted / drafts and the per-position rates, as ``eval.online``
  reads them from ``LLM.get_metrics()``. Works with either API; the server must carry no other
  traffic while it is measured. See ``serve/acceptance.py``.

A server without a drafter has no acceptance: it is reported as n/a (and labelled), never as 1.0.

API (``--api``): ``native`` sends the prompts as token ids rendered here with ``--tokenizer`` (the
target's folder): SGLang ``/generate``, vLLM ``/v1/completions``; ``openai`` sends chat messages to
``/v1/chat/completions`` and the server templates them (SGLang then reports no acceptance);
``auto`` (default): native when ``--tokenizer`` is given, else openai.

Job split: prompts (``serve/prompts.py``), transport (``serve/client.py``), acceptance
per engine (``serve/acceptance.py``), numbers and outputs (``serve/report.py``); this
module holds the options and runs the sweep. A server that cannot be reached fails fast with an
error naming its URL.
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

from redraft.core import cli as ending
from redraft.core import options
from redraft.core.config import ConfigError
from redraft.core.options import option
from redraft.engines.server import ServerError, detect_server, get_json
from serve import acceptance as acc
from serve.client import RequestSettings, Target, requests_for, run_level
from serve.prompts import ServingError, encode_chat_prompts, load_prompts
from serve.report import (
    apply_counter_delta,
    build_report,
    exit_for_failed_levels,
    render_report_text,
    summarize,
    write_json,
    write_markdown,
    write_plot,
)

__all__ = ["ServingConfig", "ServingError", "load_prompts", "main", "run_benchmark"]

logger = logging.getLogger("serve.bench")
ENGINES = ("auto", "sglang", "vllm")


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
    engine: str = "auto"  # auto | sglang | vllm
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

    def request_settings(self) -> RequestSettings:
        return RequestSettings(max_tokens=self.max_tokens, temperature=self.temperature, ignore_eos=self.ignore_eos,
                               chat_template_kwargs=self.chat_template_kwargs, timeout=self.timeout,
                               connect_timeout=self.connect_timeout, retries=self.retries,
                               retry_backoff=self.retry_backoff)


# ---------------------------------------------------------------------------------------------------------
# Server identity and settings


async def fetch_server_info(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[dict, bool]:
    """SGLang's GET /server_info, falling back to /get_server_info (older SGLang); ({}, False) when neither."""
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
        except (asyncio.TimeoutError, TimeoutError) as e:
            raise ServingError(f"{url}{path} did not answer within {timeout:.0f}s") from e
        except (aiohttp.ClientError, json.JSONDecodeError) as e:
            raise ServingError(f"{url}{path}: {type(e).__name__}: {e}") from e
    return {}, False


async def identify(session: aiohttp.ClientSession, target: Target, cfg: ServingConfig,
                   timeout: float) -> dict[str, Any]:
    """Which engine serves ``target.url`` (sets ``target.engine`` and ``target.model``), its settings and warnings."""
    try:
        server = await detect_server(session, target.url, cfg.engine, retries=cfg.retries,
                                     backoff_s=cfg.retry_backoff, hint=f"--{target.role}")
    except ServerError as e:
        raise ServingError(str(e)) from None
    target.engine = server.api
    if target.engine == "sglang":
        raw, found = await fetch_server_info(session, target.url, timeout)
        info = acc.parse_sglang_info(raw)
        warnings = acc.sglang_warnings(target.role, info, cfg.concurrency, found)
        model = server.model
        if target.api == "openai":  # the served name, which may differ from the path
            _, models = await get_json(session, target.url, "/v1/models", retries=cfg.retries,
                                       backoff_s=cfg.retry_backoff, hint=f"--{target.role}", timeout_s=timeout)
            data = models.get("data") if isinstance(models, dict) else None
            model = str(data[0]["id"]) if data and isinstance(data[0], dict) and data[0].get("id") else "default"
        target.model = cfg.model or model or "default"
        return {"info": info, "server_info_found": found, "warnings": warnings}
    counters = await _counters(session, target.url, timeout)
    _, models = await get_json(session, target.url, "/v1/models", retries=cfg.retries, backoff_s=cfg.retry_backoff,
                               hint=f"--{target.role}", timeout_s=timeout)
    target.model = cfg.model or server.model or "default"
    return {"info": acc.vllm_info(models, server.version, counters), "server_info_found": True,
            "warnings": acc.vllm_warnings(target.role, counters), "counters": counters}


async def _counters(session: aiohttp.ClientSession, url: str, timeout: float) -> acc.SpecCounters:
    try:
        return await acc.read_counters(session, url, timeout)
    except acc.MetricsError as e:
        raise ServingError(str(e)) from None


# ---------------------------------------------------------------------------------------------------------
# The sweep


async def bench_server(target: Target, cfg: ServingConfig, prompts: Sequence[str],
                       ids: Sequence[list[int]] | None) -> dict[str, Any]:
    """One server: identity, warm-up, then each concurrency (vLLM: counters read around each)."""
    top = max(cfg.concurrency)
    info_timeout = min(cfg.timeout, max(cfg.connect_timeout, 30.0))
    rs = cfg.request_settings()
    connector = aiohttp.TCPConnector(limit=top + 8)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=2**20) as session:
        ident = await identify(session, target, cfg, info_timeout)
        for w in ident["warnings"]:
            logger.warning("!!! %s (%s): %s", target.role, target.url, w)
        counted = target.engine == "vllm" and ident["counters"].speculative
        if cfg.warmup > 0:
            logger.info("%s: warm-up, %d requests", target.url, cfg.warmup)
            warm, _ = await run_level(session, target, rs, prompts, ids, min(cfg.warmup, 8), cfg.warmup)
            if not any(r.ok for r in warm):
                raise ServingError(f"{target.url}: every warm-up request failed: {warm[0].error}")
        levels = []
        for c in cfg.concurrency:
            n = requests_for(c, len(prompts), cfg.min_rounds)
            logger.info("%s: concurrency %d, %d requests", target.url, c, n)
            before = await _counters(session, target.url, info_timeout) if counted else None
            results, duration = await run_level(session, target, rs, prompts, ids, c, n)
            stats = summarize(results, c, duration)
            if before is not None:
                after = await _counters(session, target.url, info_timeout)
                try:
                    apply_counter_delta(stats, acc.counters_delta(before, after))
                except acc.MetricsError as e:
                    raise ServingError(f"{target.url}: {e}") from None
            if stats.errors:
                logger.warning("%s: concurrency %d: %d/%d requests failed, e.g. %s", target.url, c, stats.errors,
                               stats.requests, stats.error_samples[0])
            levels.append(stats)
        info = ident["info"]
        if target.engine == "sglang" and ident["server_info_found"]:  # cumulative server-side, after our traffic
            raw_after, _ = await fetch_server_info(session, target.url, info_timeout)
            info["avg_spec_accept_length"] = acc.parse_sglang_info(raw_after).get("avg_spec_accept_length")
    return {"url": target.url, "engine": target.engine, "api": target.api, "info": info,
            "server_info_found": ident["server_info_found"], "warnings": ident["warnings"], "levels": levels}


def resolve_api(cfg: ServingConfig) -> str:
    if cfg.api == "auto":
        return "native" if cfg.tokenizer else "openai"
    if cfg.api == "native" and not cfg.tokenizer:
        raise ServingError("--api native needs --tokenizer (the target's folder): the token-id APIs (SGLang "
                           "/generate, vLLM /v1/completions) apply no chat template, and raw-text prompts give "
                           "misleading acceptance. Pass --tokenizer, or use --api openai.")
    if cfg.api == "openai" and cfg.tokenizer:
        logger.info("--api openai: the server applies its own chat template; --tokenizer is not used")
    return cfg.api


async def run_benchmark(cfg: ServingConfig) -> dict[str, Any]:
    """Both servers (or one), in turn: identity, warm-up, the concurrency sweep; returns the report dict."""
    if not cfg.base and not cfg.eagle:
        raise ServingError("give --base URL, --eagle URL, or both")
    if not cfg.concurrency or min(cfg.concurrency) < 1:
        raise ServingError(f"--concurrency must be positive integers, got {cfg.concurrency}")
    if cfg.engine not in ENGINES:
        raise ServingError(f"--engine must be one of {ENGINES}, got {cfg.engine!r}")
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
        "engine": cfg.engine, "api": api, "concurrency": cfg.concurrency, "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos, "prompts": source, "num_prompts": len(prompts),
        "min_rounds": cfg.min_rounds, "warmup": cfg.warmup, "timeout_s": cfg.timeout, "retries": cfg.retries,
        "tokenizer": cfg.tokenizer, "chat_template_kwargs": cfg.chat_template_kwargs,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return build_report(settings, servers)


# ---------------------------------------------------------------------------------------------------------
# CLI


@dataclass(kw_only=True)
class ServingOptions:
    """The options of python -m serve.bench (redraft.core.options)."""

    base: str | None = option(None, "URL of the server (SGLang or vLLM) without speculative decoding, e.g. "
                                    "http://host:30000", group="servers")
    eagle: str | None = option(None, "URL of the server (SGLang or vLLM) running the EAGLE-3 drafter; a vLLM server "
                                     "must carry no other traffic while measured (its counters are global)",
                               group="servers")
    engine: str = option("auto", "the servers' engine; auto: detected per server (SGLang when /model_info answers, "
                                 "else vLLM when /v1/models does)", group="servers", choices=ENGINES)
    api: str = option("auto", "native: token ids rendered here with --tokenizer's chat template (SGLang /generate, "
                              "vLLM /v1/completions); openai: /v1/chat/completions, the server templates (SGLang then "
                              "reports no acceptance; vLLM's comes from /metrics either way); auto: native iff "
                              "--tokenizer", group="servers", choices=("auto", "native", "openai"))
    model: str | None = option(None, "model name for the OpenAI-style APIs; unset: the first id from /v1/models",
                               group="servers")
    prompts: str | None = option(None, "prompt file: JSONL (turns/prompt/messages/conversations), JSON list or .txt; "
                                       "default: the embedded MT-bench questions (first turns)", group="traffic")
    num_prompts: int = option(80, "use the first N prompts (0: all)", group="traffic")
    tokenizer: str | None = option(None, "target model/tokenizer folder whose chat template renders the prompts",
                                   group="traffic")
    trust_remote_code: bool = option(False, "allow the tokenizer's custom code (Kimi-K2.5 needs it; only for folders "
                                            "you trust)", group="traffic")
    chat_template_kwargs: dict[str, Any] = option({}, 'JSON object passed to the chat template, e.g. '
                                                      '\'{"thinking": true}\'', group="traffic")
    concurrency: list[int] = option([1, 8, 32, 128], "comma-separated concurrent streams per setting (1 = single "
                                                     "stream)", group="traffic")
    max_tokens: int = option(256, "max new tokens per request", group="traffic")
    temperature: float = option(0.0, "sampling temperature (0: greedy)", group="traffic")
    ignore_eos: bool = option(False, "generate exactly --max-tokens per request (fixed length; text after EOS is not "
                                     "representative for acceptance)", group="traffic")
    min_rounds: int = option(2, "each setting sends max(N prompts, min-rounds x concurrency) requests",
                             group="traffic")
    warmup: int = option(4, "warm-up requests per server before measuring (0: none)", group="traffic")
    timeout: float = option(300.0, "seconds one request attempt may take", group="requests")
    connect_timeout: float = option(10.0, "seconds to open a connection", group="requests")
    retries: int = option(2, "retries per request after a connection error, time-out, 5xx or 429", group="requests")
    json: str | None = option(None, "write the full report as JSON here", group="output")
    markdown: str | None = option(None, "write the tables as Markdown here", group="output")
    plot: str | None = option(None, "write a PNG of tokens/s against concurrency here", group="output")
    verbose: bool = option(False, "debug logging", group="output", short="-v")

    def validate(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError(f"concurrency={self.concurrency}: expected positive integers")
        if self.max_tokens < 1 or self.timeout <= 0:
            raise ConfigError("max_tokens and timeout: must be positive")
        if self.retries < 0 or self.num_prompts < 0 or self.warmup < 0:
            raise ConfigError("retries, num_prompts and warmup: must be >= 0")


PROG = "python -m serve.bench"
DESCRIPTION = "Benchmark SGLang or vLLM servers: base vs EAGLE-3 side by side (tokens/s, TPOT, TTFT, acceptance)."
EPILOG = ("Acceptance length, the engine's own: SGLang: Σ completion tokens / Σ spec_verify_ct from each answer's "
          "meta_info (native API only); vLLM: 1 + accepted / drafts from the difference of its /metrics spec-decode "
          "counters around each setting (either API; per position too; the server must carry no other traffic). A "
          "server without a drafter: n/a. Exit status: 0 ok, 1 a setting had no successful request, 2 bad options "
          "or an unreachable server.")


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser(ServingOptions, prog=PROG, description=DESCRIPTION, epilog=EPILOG)


def config_from_args(args: ServingOptions) -> ServingConfig:
    return ServingConfig(
        base=args.base, eagle=args.eagle, concurrency=args.concurrency, max_tokens=args.max_tokens,
        prompts=args.prompts, num_prompts=args.num_prompts, min_rounds=max(args.min_rounds, 1), warmup=args.warmup,
        timeout=args.timeout, connect_timeout=args.connect_timeout, retries=args.retries, engine=args.engine,
        api=args.api,
        tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code,
        chat_template_kwargs=args.chat_template_kwargs, model=args.model, temperature=args.temperature,
        ignore_eos=args.ignore_eos, json_path=args.json, markdown_path=args.markdown,
        plot_path=args.plot,
    )


def write_outputs(report: dict[str, Any], cfg: ServingConfig) -> None:
    if cfg.json_path:
        write_json(report, Path(cfg.json_path))
    if cfg.markdown_path:
        write_markdown(report, Path(cfg.markdown_path))
    if cfg.plot_path:
        write_plot(report, Path(cfg.plot_path))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = options.parse(ServingOptions, argv, prog=PROG, description=DESCRIPTION, epilog=EPILOG, section="bench")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ending.configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        cfg = config_from_args(args)
        report = asyncio.run(run_benchmark(cfg))
    except ServingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render_report_text(report))
    write_outputs(report, cfg)
    return exit_for_failed_levels((role, s["levels"]) for role, s in report["servers"].items())


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` ended as redraft.core.cli ends every command (one line and exit 2 on a mistake)."""
    return ending.run(lambda: main(argv), logging.getLogger("serve.bench"))


if __name__ == "__main__":
    sys.exit(cli())
