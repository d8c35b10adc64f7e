"""serve.bench against a local stand-in for SGLang (tests/helpers_fake_sglang.py), plus the maths on known answers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_fake_sglang import FakeBehaviour, FakeSGLang, dead_url
from helpers_paths import ROOT

from serve import bench as serving
from serve.bench import ServingConfig, ServingError, run_benchmark
from serve.report import (
    RequestResult,
    acceptance_length,
    build_report,
    percentile,
    render_markdown,
    render_report_text,
    summarize,
)


@pytest.fixture(scope="module")
def kimi_tokenizer_dir(tmp_path_factory):
    from redraft.catalog.tiny_tokenizers import build_chat_tokenizer

    out = tmp_path_factory.mktemp("kimi_tok")
    build_chat_tokenizer("kimi_k25").save_pretrained(out)
    return str(out)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "turns": [f"question number {i}?", "follow-up"]} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _cfg(prompts_file: str, **kw) -> ServingConfig:
    base = dict(prompts=prompts_file, num_prompts=4, concurrency=[1], max_tokens=16, warmup=0, timeout=10.0,
                connect_timeout=2.0, retries=0, retry_backoff=0.01)
    base.update(kw)
    return ServingConfig(**base)


def _run(cfg: ServingConfig) -> dict:
    return asyncio.run(run_benchmark(cfg))


# ---------------------------------------------------------------------------------------------------------
# Maths on known answers


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_acceptance_is_token_weighted_not_a_mean_of_ratios():
    results = [
        RequestResult(ok=True, latency_s=1.0, ttft_s=0.1, completion_tokens=100, spec_verify_ct=40,
                      spec_accept_length=2.5),
        RequestResult(ok=True, latency_s=1.0, ttft_s=0.1, completion_tokens=50, spec_verify_ct=10,
                      spec_accept_length=5.0),
        RequestResult(ok=False, error="boom"),
    ]
    assert acceptance_length(results) == pytest.approx(150 / 50)
    stats = summarize(results, concurrency=2, duration_s=2.0)
    assert stats.accept_length == pytest.approx(3.0)
    assert stats.accept_length_mean == pytest.approx(3.75)
    assert (stats.requests, stats.ok, stats.errors) == (3, 2, 1)
    assert stats.aggregate_tok_s == pytest.approx(75.0)
    assert stats.per_stream_tok_s == pytest.approx((100 + 50) / 2)
    # TPOT = (latency - TTFT) / (tokens - 1)
    assert stats.tpot_ms["p50"] == pytest.approx(1000 * (0.9 / 99 + 0.9 / 49) / 2)
    assert stats.ttft_ms["p99"] == pytest.approx(100.0)


def test_requests_without_verify_counts_give_no_acceptance():
    rs = [RequestResult(ok=True, latency_s=1.0, ttft_s=0.5, completion_tokens=1)]
    stats = summarize(rs, 1, 1.0)
    assert stats.accept_length is None and stats.tpot_ms["p50"] is None


def test_comparison_ratio_is_eagle_over_base():
    def server(tok_s, accept):
        lv = summarize([RequestResult(ok=True, latency_s=1.0, ttft_s=0.1, completion_tokens=tok_s,
                                      spec_verify_ct=tok_s // accept if accept else None)], 1, 1.0)
        return {"url": "u", "api": "native", "info": {}, "warnings": [], "levels": [lv]}

    report = build_report({"max_tokens": 256}, {"base": server(60, None), "eagle": server(150, 3)})
    (row,) = report["comparison"]
    assert row["aggregate_tok_s"]["ratio"] == pytest.approx(2.5)
    assert row["accept_length"] == pytest.approx(3.0)
    text = render_report_text(report)
    assert "2.50x" in text and "3.00" in text
    assert "| conc |" in render_markdown(report)


# ---------------------------------------------------------------------------------------------------------
# Against the stand-in server


def test_native_api_templates_client_side_and_measures_acceptance(prompts_file, kimi_tokenizer_dir):
    sched = [(16, 4), (12, 6)]  # 28 tokens / 10 verify steps per cycle
    with FakeSGLang(FakeBehaviour(schedule=sched, max_running_requests=256, cuda_graph_max_bs=256)) as srv:
        report = _run(_cfg(prompts_file, eagle=srv.url, tokenizer=kimi_tokenizer_dir, concurrency=[1, 2]))
        sent = srv.requests
    eagle = report["servers"]["eagle"]
    assert eagle["api"] == "native" and eagle["warnings"] == []
    assert eagle["info"]["speculative_algorithm"] == "EAGLE3" and eagle["info"]["max_running_requests"] == 256
    assert eagle["info"]["avg_spec_accept_length"] == 2.5
    for lv in eagle["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == 4 and lv["output_tokens"] == 2 * (16 + 12)
        assert lv["accept_length"] == pytest.approx(56 / 20)
        assert lv["accept_length_mean"] == pytest.approx((4.0 + 2.0) / 2)
        assert lv["ttft_ms"]["p50"] is not None and lv["tpot_ms"]["p50"] is not None
    body = sent[0]
    assert body["stream"] is True and body["sampling_params"]["max_new_tokens"] == 16
    assert "text" not in body
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(kimi_tokenizer_dir)
    rendered = tok.decode(body["input_ids"])
    assert "question number" in rendered and rendered.rstrip().endswith("<think>")
    assert "<|im_assistant|>" in rendered


def test_openai_api_reports_acceptance_na_and_reads_usage(prompts_file):
    with FakeSGLang(FakeBehaviour(speculative=False, max_running_requests=2048)) as base, \
            FakeSGLang(FakeBehaviour(max_running_requests=128)) as eagle:
        report = _run(_cfg(prompts_file, base=base.url, eagle=eagle.url, concurrency=[1, 4]))
        body = eagle.requests[0]
    assert body["model"] == "fake-kimi" and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "question number 0?"}]
    for role in ("base", "eagle"):
        server = report["servers"][role]
        assert server["api"] == "openai"
        for lv in server["levels"]:
            assert lv["errors"] == 0 and lv["output_tokens"] == lv["requests"] * 16
            assert lv["accept_length"] is None
    assert [r["concurrency"] for r in report["comparison"]] == [1, 4]
    text = render_report_text(report)
    assert "n/a*" in text and "OpenAI-compatible API returns no meta_info" in text


def test_native_without_tokenizer_is_refused(prompts_file):
    with pytest.raises(ServingError, match="--tokenizer"):
        _run(_cfg(prompts_file, eagle="http://127.0.0.1:1", api="native"))


@pytest.mark.parametrize("mrr, expect", [(48, "max_running_requests = 48"), (None, "caps speculative serving at 48"),
                                         (256, None)])
def test_warns_loudly_at_the_48_cap(prompts_file, caplog, mrr, expect):
    with FakeSGLang(FakeBehaviour(max_running_requests=mrr, cuda_graph_max_bs=mrr)) as srv:
        report = _run(_cfg(prompts_file, eagle=srv.url))
    warnings = report["servers"]["eagle"]["warnings"]
    if expect is None:
        assert warnings == []
    else:
        assert any(expect in w for w in warnings)
        assert any("!!!" in r.getMessage() and expect in r.getMessage() for r in caplog.records)
        assert "WARNING: " in render_report_text(report)


def test_concurrency_above_the_server_limit_and_mislabelled_servers_are_flagged(prompts_file):
    with FakeSGLang(FakeBehaviour(speculative=False, max_running_requests=2)) as plain:
        report = _run(_cfg(prompts_file, eagle=plain.url, concurrency=[4]))
    warnings = " ".join(report["servers"]["eagle"]["warnings"])
    assert "exceeds max_running_requests 2" in warnings and "not running a drafter" in warnings


def test_legacy_get_server_info_fallback_and_missing_info(prompts_file):
    with FakeSGLang(FakeBehaviour(info_path="/get_server_info", max_running_requests=300)) as srv:
        report = _run(_cfg(prompts_file, eagle=srv.url))
    assert report["servers"]["eagle"]["info"]["max_running_requests"] == 300
    with FakeSGLang(FakeBehaviour(info_path="")) as srv:
        report = _run(_cfg(prompts_file, eagle=srv.url))
    assert "neither /server_info" in report["servers"]["eagle"]["warnings"][0]
    assert report["servers"]["eagle"]["levels"][0]["errors"] == 0


def test_a_sleeping_server_times_out_boundedly(prompts_file):
    with FakeSGLang(FakeBehaviour(sleep_s=5.0)) as srv:
        t0 = time.perf_counter()
        report = _run(_cfg(prompts_file, eagle=srv.url, num_prompts=2, timeout=0.3, retries=1))
        elapsed = time.perf_counter() - t0
    lv = report["servers"]["eagle"]["levels"][0]
    assert lv["ok"] == 0 and lv["errors"] == 2 and lv["retried"] == 2
    assert "timed out after 0.3s" in lv["error_samples"][0]
    assert elapsed < 4.0  # 2 requests x 2 attempts x 0.3 s, not 2 x 5 s


def test_retries_recover_from_dropped_connections(prompts_file):
    with FakeSGLang(FakeBehaviour(drop_first=2, max_running_requests=256)) as srv:
        report = _run(_cfg(prompts_file, eagle=srv.url, retries=2, api="openai"))
        calls = srv.generation_calls
    lv = report["servers"]["eagle"]["levels"][0]
    assert lv["errors"] == 0 and lv["ok"] == 4 and lv["retried"] == 1
    assert calls == 6  # the first request took three attempts


def test_a_server_that_cuts_streams_is_an_error_not_a_result(prompts_file, kimi_tokenizer_dir):
    with FakeSGLang(FakeBehaviour(drop_mid_stream=True)) as srv:
        report = _run(_cfg(prompts_file, eagle=srv.url, tokenizer=kimi_tokenizer_dir, retries=1, num_prompts=2))
        calls = srv.generation_calls
    lv = report["servers"]["eagle"]["levels"][0]
    assert lv["ok"] == 0 and lv["errors"] == 2 and lv["output_tokens"] == 0
    assert calls == 4
    assert any(s in lv["error_samples"][0] for s in ("before [DONE]", "ClientPayloadError", "Disconnected"))


def test_dead_url_fails_fast_naming_it(prompts_file):
    url = dead_url()
    t0 = time.perf_counter()
    with pytest.raises(ServingError, match=f"cannot reach the server at {url}"):
        _run(_cfg(prompts_file, base=url))
    assert time.perf_counter() - t0 < 5.0


def test_warmup_failure_stops_with_a_clear_error(prompts_file):
    with FakeSGLang(FakeBehaviour(drop_mid_stream=True)) as srv:
        with pytest.raises(ServingError, match="every warm-up request failed"):
            _run(_cfg(prompts_file, eagle=srv.url, warmup=1))


def test_prompt_files_name_the_bad_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ServingError, match=r"bad.jsonl:2"):
        serving.load_prompts(str(bad), 0)
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert serving.load_prompts(str(txt), 0)[0] == ["one", "two"]
    convo = tmp_path / "c.jsonl"
    convo.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n"
                     + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "yo"}]}))
    assert serving.load_prompts(str(convo), 0)[0] == ["hi", "yo"]


def test_default_prompts_are_mtbench_first_turns():
    prompts, src = serving.load_prompts(None, 5)
    assert len(prompts) == 5 and src.endswith("mtbench.jsonl")
    first = json.loads(Path(src).read_text().splitlines()[0])
    assert prompts[0] == first["turns"][0]


# ---------------------------------------------------------------------------------------------------------
# CLI


def test_cli_writes_table_json_markdown_and_png(prompts_file, tmp_path, capsys):
    with FakeSGLang(FakeBehaviour(speculative=False, max_running_requests=2048)) as base, \
            FakeSGLang(FakeBehaviour(max_running_requests=256, cuda_graph_max_bs=256)) as eagle:
        rc = serving.main(["--base", base.url, "--eagle", eagle.url, "--prompts", prompts_file,
                           "--concurrency", "1,2", "--max-tokens", "8", "--warmup", "1",
                           "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"),
                           "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Side by side (ratio = EAGLE-3 / base)" in out and "max_running_requests: 256" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["schema"] == "redraft.serving/2"
    assert set(report["servers"]) == {"base", "eagle"} and len(report["comparison"]) == 2
    assert report["settings"]["concurrency"] == [1, 2]
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# Serving benchmark") and "| conc |" in md
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp")) and not list(tmp_path.glob(".r.*"))


def test_cli_dead_server_exit_code_and_message(prompts_file, capsys):
    url = dead_url()
    assert serving.main(["--eagle", url, "--prompts", prompts_file, "--connect-timeout", "2"]) == 2
    assert url in capsys.readouterr().err


def test_cli_all_failed_setting_exits_1(prompts_file):
    with FakeSGLang(FakeBehaviour(sleep_s=3.0)) as srv:
        rc = serving.main(["--eagle", srv.url, "--prompts", prompts_file, "--num-prompts", "1",
                           "--concurrency", "1", "--warmup", "0", "--timeout", "0.2", "--retries", "0"])
    assert rc == 1


def test_help_documents_every_option():
    run = subprocess.run([sys.executable, "-m", "serve.bench", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0
    for opt in ["--base", "--eagle", "--concurrency", "--max-tokens", "--prompts", "--num-prompts", "--warmup",
                "--timeout", "--retries", "--engine", "--api", "--json", "--markdown", "--plot", "--tokenizer",
                "--trust-remote-code", "--chat-template-kwargs", "--ignore-eos", "--min-rounds"]:
        assert opt in run.stdout, opt
    parser = serving.build_parser()
    undocumented = [a.option_strings for a in parser._actions if not a.help]
    assert undocumented == []


def test_bad_concurrency_is_a_usage_error(capsys):
    assert serving.main(["--concurrency", "1,x"]) == 2
    assert "concurrency=['1,x']: expected an integer" in capsys.readouterr().err
    assert serving.main(["--concurrency", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: concurrency=[0]: expected positive integers"
