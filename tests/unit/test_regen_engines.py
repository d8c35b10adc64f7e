"""Regeneration engines without a real engine: the server client against stand-ins that speak SGLang's and
vLLM's APIs (as their sources define them), the pipeline regenerating through them, and the reply checks.

The real engines run in tests/engine/vllm/test_regen_vllm.py (vLLM CPU: in-engine, in-process and `vllm serve`) and in
the conformance lane (our SGLang bodies through SGLang's own schema, conformance/check_regen_api.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from aiohttp import web
from helpers_regen import assert_stored_as_generated, extract_cfg, stored_samples
from regen_exactness import recording_regenerators
from transformers import AutoTokenizer

import extract.pipeline as pipeline
from extract.backends.base import GenerationConfig
from extract.chat import encode_prompt, stop_token_ids
from extract.config import ExtractConfig, parse_args
from extract.records import read_records
from extract.regen_engines import RegenError, checked_outputs, request_seed
from redraft.catalog.tiny_models import make_tiny_llama
from redraft.core.config import ConfigError
from redraft.engines.request import TokenRequest
from redraft.engines.server import ServerError, ServerSettings, TokenServer, sglang_request
from redraft.engines.vllm import free_port

# SGLang 0.5.23's /generate schema refuses sampling keys outside this set (sglang/api/v1/api_types.py).
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice"}


def rule_reply(prompt: list[int], max_tokens: int, stops: list[int], vocab: int) -> tuple[list[int], bool]:
    """The stand-in's deterministic 'model': a reply that depends on the prompt, ending with a stop id after
    (sum % 7) + 2 tokens unless max_tokens comes first. (ids, stopped)."""
    n = sum(prompt) % 7 + 2
    ids = [(sum(prompt) * 31 + 17 * k) % (vocab - 40) + 20 for k in range(n)]
    ids = [t for t in ids if t not in stops]
    if len(ids) >= max_tokens or not stops:
        return ids[:max_tokens], False
    return ids + [stops[0]], True


class StandIn:
    """An HTTP server on 127.0.0.1 speaking SGLang's or vLLM's API, recording what it was sent."""

    def __init__(self, api: str, vocab: int = 200, *, delay: float = 0.0, fail_first: int = 0,
                 trim_stop: bool = False, add_bos: bool = False) -> None:
        self.api, self.vocab, self.delay = api, vocab, delay
        self.fail_first, self.trim_stop, self.add_bos = fail_first, trim_stop, add_bos
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        def answer(obj: dict):
            async def handler(request: web.Request) -> web.Response:
                return web.json_response(obj)
            return handler

        if self.api == "sglang":
            app.router.add_get("/model_info", answer({"model_path": "/models/standin"}))
            app.router.add_get("/server_info", answer({"version": "0.5.23-standin"}))
            app.router.add_post("/generate", self._sglang)
        else:
            app.router.add_get("/v1/models", answer({"data": [{"id": "standin"}]}))
            app.router.add_get("/version", answer({"version": "0.32.0-standin"}))
            app.router.add_post("/v1/completions", self._vllm)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _enter(self, body: dict) -> web.Response | None:
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.json_response({"error": "overloaded"}, status=503)
        return None

    async def _sglang(self, request: web.Request) -> web.Response:
        body = await request.json()
        if (fail := await self._enter(body)) is not None:
            return fail
        params = body["sampling_params"]
        unknown = set(params) - SGLANG_SAMPLING_KEYS
        if unknown or "input_ids" not in body:
            return web.json_response({"error": f"unknown field {sorted(unknown)}"}, status=400)
        prompt = body["input_ids"]
        ids, stopped = rule_reply(prompt, params["max_new_tokens"], params.get("stop_token_ids", []), self.vocab)
        finish = {"type": "stop", "matched": ids[-1]} if stopped else {"type": "length", "length": len(ids)}
        if stopped and self.trim_stop:
            ids = ids[:-1]
        echo = ([1] if self.add_bos else []) + prompt
        return web.json_response({"text": "", "output_ids": ids, "prompt_token_ids": echo,
                                  "meta_info": {"finish_reason": finish, "prompt_tokens": len(prompt),
                                                "completion_tokens": len(ids)}})

    async def _vllm(self, request: web.Request) -> web.Response:
        body = await request.json()
        if (fail := await self._enter(body)) is not None:
            return fail
        if not body.get("return_token_ids") or not isinstance(body.get("prompt"), list):
            return web.json_response({"error": "token prompt and return_token_ids expected"}, status=400)
        stops = body.get("stop_token_ids") or []
        ids, stopped = rule_reply(body["prompt"], body["max_tokens"], stops, self.vocab)
        echo = ([1] if self.add_bos else []) + body["prompt"]
        choice = {"index": 0, "text": "", "finish_reason": "stop" if stopped else "length",
                  "stop_reason": ids[-1] if stopped else None, "token_ids": ids, "prompt_token_ids": echo}
        return web.json_response({"choices": [choice]})

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def standin(request):
    servers: list[StandIn] = []

    def make(api: str, **kw) -> StandIn:
        servers.append(StandIn(api, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _requests(n: int, max_tokens: int = 6) -> list[TokenRequest]:
    return [TokenRequest(id=str(i), prompt_token_ids=[5, 6, 7 + i], max_tokens=max_tokens, stop_token_ids=[3])
            for i in range(n)]


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_pipeline_regenerates_through_a_server(api, standin, tmp_path, monkeypatch):
    """extract --regen-backend server: the server is sent the rendered prompt ids of every turn and its ids are
    stored as it returned them (stop id included), with every sampling knob explicit."""
    server = standin(api, vocab=200)
    target = make_tiny_llama(tmp_path / "t", seed=1)
    tok = AutoTokenizer.from_pretrained(target)
    server.vocab = len(tok)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"Question {i}?", "And then?"]}) + "\n"
                            for i in range(3)))
    calls: list[tuple[list[int], list[int]]] = []
    monkeypatch.setattr(pipeline, "make_regenerator", recording_regenerators(pipeline.make_regenerator, calls))
    summary = pipeline.run_extraction(extract_cfg(target, data, tmp_path / "ds", regenerate=True, max_new_tokens=6,
                                           regen_backend="server", regen_url=server.url, regen_concurrency=2))
    stops = stop_token_ids(tok)
    assert len(calls) == 6 and len(server.bodies) == 6
    sent = [b["input_ids"] if api == "sglang" else b["prompt"] for b in server.bodies]
    assert sorted(sent) == sorted(p for p, _ in calls)  # the server computed on exactly the prompts recorded
    for prompt, output in calls:
        assert output == rule_reply(prompt, 6, stops, len(tok))[0]  # as the server wrote them, stop id included
    records = read_records([tmp_path / "ds" / "regenerated.jsonl"], require_assistant=False).records
    first = records[0].messages
    assert encode_prompt(tok, first[:1]) in sent  # turn 1's prompt: the chat template's render, nothing else
    assert_stored_as_generated(stored_samples(tmp_path / "ds"), calls, set(stops))
    assert summary.manifest["regeneration"]["mismatched_samples"] == 0
    assert summary.manifest["generation"]["backend"] == "server"
    for b in server.bodies:
        knobs = b["sampling_params"] if api == "sglang" else b
        assert knobs["temperature"] == 0.0 and knobs["repetition_penalty"] == 1.0 and knobs["stop_token_ids"] == stops
        if api == "vllm":
            assert b["ignore_eos"] is True and b["model"] == "standin"
        else:
            assert knobs["no_stop_trim"] is True
    plan = json.loads((tmp_path / "ds" / "plan.json").read_text())
    assert plan["regen_backend"] == "server"


def test_matched_stop_id_is_kept_when_the_server_trims_it(standin):
    server = standin("sglang", trim_stop=True)
    rows = TokenServer(ServerSettings(url=server.url)).generate(_requests(4, max_tokens=20))
    assert all(r["finish_reason"] == "stop" and r["output_token_ids"][-1] == 3 for r in rows)
    assert [r["output_token_ids"] for r in rows] == [rule_reply([5, 6, 7 + i], 20, [3], 200)[0] for i in range(4)]


def test_in_flight_requests_are_bounded_and_failures_retried(standin):
    server = standin("vllm", delay=0.05, fail_first=2)
    client = TokenServer(ServerSettings(url=server.url, concurrency=3, backoff_s=0.01))
    rows = client.generate(_requests(12))
    assert [r["id"] for r in rows] == [str(i) for i in range(12)]  # in request order
    assert 2 <= server.max_in_flight <= 3
    assert len(server.bodies) == 14  # two 503s answered by retries
    assert client.info is not None and client.info.api == "vllm" and client.info.version == "0.32.0-standin"


def test_persistent_failure_names_the_request(standin):
    server = standin("sglang", fail_first=100)
    client = TokenServer(ServerSettings(url=server.url, retries=2, backoff_s=0.01))
    with pytest.raises(ServerError, match=r"request 0 failed 3 times"):
        client.generate(_requests(1))


def test_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    client = TokenServer(ServerSettings(url=url, retries=1, backoff_s=0.01))
    t0 = time.perf_counter()
    with pytest.raises(ServerError, match=r"cannot reach the server at http://127\.0\.0\.1:\d+ .*--regen-url"):
        client.generate(_requests(1))
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_a_server_that_changes_the_prompt_is_refused(api, standin):
    server = standin(api, add_bos=True)
    with pytest.raises(ServerError, match="other prompt ids than were sent"):
        TokenServer(ServerSettings(url=server.url)).generate(_requests(1))


def test_sglang_sampled_body_carries_seed_and_all_knobs():
    body = sglang_request(TokenRequest(id="x", prompt_token_ids=[1, 2], max_tokens=5, temperature=0.7, top_p=0.9,
                                       seed=11, stop_token_ids=[2]))
    params = body["sampling_params"]
    assert not set(params) - SGLANG_SAMPLING_KEYS
    assert params["sampling_seed"] == 11 and params["top_p"] == 0.9 and params["top_k"] == -1
    assert body["input_ids"] == [1, 2] and body["return_prompt_token_ids"] is True


def test_checked_outputs_refuses_what_is_not_a_reply():
    stops = [2, 9]
    ok = [{"output_token_ids": [5, 6, 2], "finish_reason": "stop"}, {"output_token_ids": [5, 6], "finish_reason": "length"}]
    assert checked_outputs(ok, [3, 2], stops, "e") == [[5, 6, 2], [5, 6]]
    with pytest.raises(RegenError, match="no tokens"):
        checked_outputs([{"output_token_ids": []}], [3], stops, "e")
    with pytest.raises(RegenError, match="more than its budget 2"):
        checked_outputs([{"output_token_ids": [5, 6, 7]}], [2], stops, "e")
    with pytest.raises(RegenError, match="past stop id 9"):
        checked_outputs([{"output_token_ids": [5, 9, 7, 2]}], [8], stops, "e")
    with pytest.raises(RegenError, match="2 replies for 1 prompts"):
        checked_outputs(ok, [3], stops, "e")


def test_request_seed_follows_the_seed_and_the_prompt_not_the_order():
    a, b = [1, 2, 3], [1, 2, 4]
    assert request_seed(0, a) == request_seed(0, list(a)) != request_seed(0, b)
    assert request_seed(1, a) != request_seed(0, a)
    assert 0 <= request_seed(2**40, a) < 2**62


def test_regen_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="regen_url: required"):
        ExtractConfig(target="t", data=["d"], out="o", regenerate=True, regen_backend="server").validate()
    with pytest.raises(ConfigError, match="regen_concurrency: must be >= 1"):
        ExtractConfig(target="t", data=["d"], out="o", regen_concurrency=0).validate()
    with pytest.raises(ConfigError, match=r"argument --regen-backend: invalid choice: 'tgi'"):
        parse_args(["--target", "t", "--data", "d", "--out", "o", "--regen-backend", "tgi"])
    cfg = parse_args(["--target", "t", "--data", "d", "--out", "o", "--regenerate", "--regen-backend", "server",
                      "--regen-url", "http://h:30000", "--regen-concurrency", "8"])
    assert (cfg.regen_backend, cfg.regen_url, cfg.regen_concurrency) == ("server", "http://h:30000", 8)


def test_resume_refuses_another_regeneration_engine(standin, tmp_path):
    """A folder regenerated by one engine is not finished by another (the plan records it)."""
    server = standin("sglang")
    target = make_tiny_llama(tmp_path / "t", seed=2)
    server.vocab = len(AutoTokenizer.from_pretrained(target))
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "q", "prompt": "Hi?"}) + "\n")
    out = tmp_path / "ds"
    pipeline.run_extraction(extract_cfg(target, data, out, regenerate=True, max_new_tokens=4, regen_backend="server",
                                 regen_url=server.url))
    with pytest.raises(ConfigError, match="regen_backend"):
        pipeline.run_extraction(extract_cfg(target, data, out, regenerate=True, max_new_tokens=4))


def test_budget_is_per_prompt_for_engines(standin, tmp_path):
    """A prompt near max_length gets only what is left; the others keep the full budget (no batch minimum)."""
    from types import SimpleNamespace

    from extract.records import Message, Record
    from extract.regen_engines import ServerRegenerator
    from extract.regenerate import regenerate_records

    server = standin("vllm")
    target = make_tiny_llama(tmp_path / "t", seed=2)
    tok = AutoTokenizer.from_pretrained(target)
    server.vocab = len(tok)
    records = [Record(id=i, messages=(Message(role="user", content=text),), source="t", category=None, origin="t:1")
               for i, text in (("short", "Hi?"), ("long", "word " * 40))]
    lens = {r.id: len(encode_prompt(tok, r.messages)) for r in records}
    max_length = lens["long"] + 5
    assert lens["short"] + 30 < max_length
    regenerate_records(SimpleNamespace(tokenizer=tok), records, GenerationConfig(max_new_tokens=30),
                       max_length=max_length, regenerator=ServerRegenerator(server.url, concurrency=2))
    budgets = {len(b["prompt"]): b["max_tokens"] for b in server.bodies}
    assert budgets == {lens["short"]: 30, lens["long"]: 5}


def test_cli_help_lists_the_regen_options():
    from extract.config import build_parser

    text = build_parser().format_help()
    for flag in ("--regen-backend", "--regen-url", "--regen-concurrency", "--regen-server-api",
                 "--regen-engine-python", "--regen-kv-cache-gb", "--regen-gpu-memory-utilization"):
        assert flag in text
