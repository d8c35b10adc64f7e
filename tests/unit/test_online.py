"""eval.online / eval.engine_truth without the real engine: requests from the data, the driver's counter
arithmetic (through a stand-in ``vllm`` package on PYTHONPATH), the verdict, and the lane's loud paths.

The real engine is exercised by ``make engine-truth`` (CI), which needs the vLLM CPU venv.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers_acceptance import make_case, write_case_dataset, write_target
from helpers_drafter import tiny_drafter
from helpers_paths import ROOT

from eval import engine_truth as et
from eval import online
from redraft.core import answers
from redraft.core.dataset.reader import DatasetReader
from redraft.core.drafter.folder import write_drafter_folder
from redraft.engines import vllm as vllm_engine

STEPS = 3

FAKE_VLLM = '''
"""Stand-in for vllm's offline API: K drafts per round, the first accepted, the second on odd rounds."""
__version__ = "fake"


class _M:
    def __init__(self, name, value=None, values=None):
        self.name, self.value, self.values = name, value, values


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos=False, **kw):
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, ids):
        self.token_ids, self.finish_reason = ids, "length"


class _Req:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]


class LLM:
    def __init__(self, model, speculative_config=None, **kw):
        self.k = speculative_config["num_speculative_tokens"] if speculative_config else 0
        self.drafts = self.accepted = 0
        self.pos = [0] * max(self.k, 2)

    def generate(self, prompts, params, use_tqdm=False):
        ids = prompts[0]["prompt_token_ids"]
        for r in range(params.max_tokens):  # one round per output token, for the arithmetic only
            self.drafts += 1
            n = 2 if r % 2 else 1
            self.accepted += n
            for i in range(n):
                self.pos[i] += 1
        return [_Req([ids[-1]] * params.max_tokens)]

    def get_metrics(self):
        return [_M("vllm:spec_decode_num_drafts", self.drafts), _M("vllm:spec_decode_num_draft_tokens", self.drafts * self.k),
                _M("vllm:spec_decode_num_accepted_tokens", self.accepted),
                _M("vllm:spec_decode_num_accepted_tokens_per_pos", values=self.pos), _M("other", 1)]
'''


# vllm.platforms as the driver reads it (the stand-in runs on a CPU, like vLLM CPU here).
FAKE_PLATFORMS = '''
class _Platform:
    def is_cpu(self):
        return True


current_platform = _Platform()
'''


def write_fake_vllm(folder: Path, init: str = FAKE_VLLM) -> Path:
    """A ``vllm`` package folder holding the stand-in; returns the folder to put on PYTHONPATH."""
    (folder / "vllm").mkdir(parents=True)
    (folder / "vllm" / "__init__.py").write_text(init)
    (folder / "vllm" / "platforms.py").write_text(FAKE_PLATFORMS)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    drafter = tiny_drafter(3).eval()
    case = make_case(drafter, [20, 14, 11], steps=STEPS, seed=3, follow=1.0)
    lm_head = torch.randn(drafter.config.vocab_size, drafter.config.target_hidden_size)
    target = write_target(root / "target", drafter, lm_head)
    data = write_case_dataset(root / "data", case, drafter, target, lm_head, generation={"temperature": 0.0})
    ckpt = root / "ckpt"
    ckpt.mkdir()
    write_drafter_folder(ckpt, drafter.config, drafter.serving_state_dict(), {"step": 1})
    fake = write_fake_vllm(root / "fake")
    return dict(root=root, case=case, data=data, target=target, ckpt=ckpt, fake=fake)


def test_requests_are_the_prompt_ids_before_each_answer(world):
    reader = DatasetReader(world["data"])
    reqs = answers.build_requests(reader, range(len(reader)))
    case = world["case"]
    assert len(reqs) == sum(len(answers.answer_runs(case["loss_mask"][b])) for b in range(3))
    for r in reqs:
        b = r.sample
        ids, lm = case["input_ids"][b].tolist(), case["loss_mask"][b].tolist()
        a = len(r.prompt)
        assert r.prompt == ids[:a] and lm[a] and not lm[a - 1]  # the tokens before the answer's first token
        assert r.answer == ids[a : a + len(r.answer)] and all(lm[a : a + len(r.answer)])
        assert r.max_tokens == len(r.answer)
    assert {r.max_tokens for r in answers.build_requests(reader, [0], max_new_tokens=5)} == {5}


def test_missing_engine_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CPU_VENV", str(tmp_path / "nope"))
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(vllm_engine.EngineError, match="make vllm-cpu-venv"):
        vllm_engine.engine_python()
    with pytest.raises(vllm_engine.EngineError, match="no such file"):
        vllm_engine.engine_python(str(tmp_path / "python"))


def test_engine_env_preloads_intel_openmp(tmp_path):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    (venv / "bin" / "python").symlink_to(sys.executable)  # as in a venv: a link to the base interpreter
    env = vllm_engine.engine_env(str(venv / "bin" / "python"))
    assert str(venv / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_TARGET_DEVICE"] == "cpu"


def test_measure_through_the_driver(world, monkeypatch):
    """eval.online -> export -> redraft/engines/vllm_driver.py in a subprocess -> counters differenced per request."""
    reader = DatasetReader(world["data"])
    settings = online.OnlineSettings(steps=STEPS, speed_samples=2, engine_python=sys.executable,
                                     extra_env={"PYTHONPATH": str(world["fake"])})
    res = online.measure(world["ckpt"], reader, range(len(reader)), settings, target=str(world["target"]))
    reqs = answers.build_requests(reader, range(len(reader)))
    rows = res["per_request"]
    assert [r["id"] for r in rows] == [q.id for q in reqs]
    for r, q in zip(rows, reqs, strict=True):  # per request: the stand-in's rounds, not the global counters
        assert r["num_drafts"] == q.max_tokens
        assert r["num_accepted_tokens"] == q.max_tokens + q.max_tokens // 2
        assert r["num_accepted_tokens_per_pos"] == [q.max_tokens, q.max_tokens // 2, 0]
        assert r["same_as_data"] == (r["output_token_ids"] == q.answer)
    drafts = sum(q.max_tokens for q in reqs)
    accepted = sum(q.max_tokens + q.max_tokens // 2 for q in reqs)
    assert res["all"]["tau"] == pytest.approx(1 + accepted / drafts)
    assert res["all"]["accept_rate"][2] == 0.0
    assert res["lossless"] == {"equal": 2, "of": 2} and res["tokens_per_s"]["without_drafter"] > 0
    assert res["drafter_folder"].startswith("exported from")
    assert res["max_model_len"] == 256  # the tiny target's context (below the 2048 default vLLM would refuse)
    assert "tau online (1 + accepted/drafts)" in online.format_table(res)


def test_engine_context_follows_the_target(world, tmp_path):
    assert online.target_context(world["target"]) == 256
    assert online.target_context(world["root"]) is None  # no config.json
    (tmp_path / "config.json").write_text('{"architectures": ["KimiK25ForConditionalGeneration"], '
                                          '"text_config": {"max_position_embeddings": 262144}}')
    assert online.target_context(tmp_path) == 262144  # a Kimi-K2.5-style wrapper nests the decoder's config
    assert online.engine_context(None, 256, 40) == 256
    assert online.engine_context(None, 8192, 40) == online.DEFAULT_MAX_MODEL_LEN
    assert online.engine_context(None, None, 40) == online.DEFAULT_MAX_MODEL_LEN
    assert online.engine_context(128, 256, 200) == 200  # raised to the longest request
    with pytest.raises(online.OnlineError, match="max_position_embeddings is 256"):
        online.engine_context(None, 256, 300)


def test_engine_failure_is_loud(world):
    reader = DatasetReader(world["data"])
    settings = online.OnlineSettings(steps=STEPS, speed_samples=0, engine_python=sys.executable,
                                     extra_env={"PYTHONPATH": str(world["root"] / "empty")})
    with pytest.raises(online.OnlineError, match="engine failed"):
        online.measure(world["ckpt"], reader, [0], settings, target=str(world["target"]))


def _off(tau, rates):
    return {"tau": tau, "accept_rate": rates, "per_position": {"tau": tau + 0.1, "accept_rate": rates},
            "engine_walk": {"rounds": 10}}


def test_verdict_by_the_numbers():
    tol = et.Tolerances()
    on = {"tau": 1.5, "accept_rate": [0.4, 0.1], "num_drafts": 10}
    ok = et.compare(_off(1.5 * 1.019, [0.415, 0.085]), on, tol)
    assert ok["ok"] and ok["tau_rel_error"] == pytest.approx(0.019)
    bad_tau = et.compare(_off(1.5 * 1.021, [0.4, 0.1]), on, tol)
    assert not bad_tau["ok"] and "tau" in bad_tau["problems"][0]
    bad_rate = et.compare(_off(1.5, [0.4, 0.125]), on, tol)
    assert not bad_rate["ok"] and "draft 2" in bad_rate["problems"][0]


def _lane(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(["bash", str(ROOT / "scripts" / "engine_truth.sh")], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_speculation_that_changes_greedy_output_fails_the_lane():
    assert et.lossless_problem(None) is None and et.lossless_problem({"equal": 4, "of": 4}) is None
    assert "1 of 4 requests differ" in et.lossless_problem({"equal": 3, "of": 4})


def test_sglang_settings_are_checked_and_spelled_as_sglang_reads_them():
    with pytest.raises(online.OnlineError, match="vLLM drafts chains only"):
        online.OnlineSettings(topk=2, num_draft_tokens=6).check()
    with pytest.raises(online.OnlineError, match="needs --num-draft-tokens"):
        online.OnlineSettings(engine="sglang", topk=2).check()
    with pytest.raises(online.OnlineError, match="--engine"):
        online.OnlineSettings(engine="trtllm").check()
    chain = online.sglang_kwargs("/t", online.OnlineSettings(engine="sglang", steps=3), 1024, Path("/d"))
    assert (chain["speculative_num_steps"], chain["speculative_eagle_topk"], chain["speculative_num_draft_tokens"]) \
        == (3, 1, 4) and chain["speculative_algorithm"] == "EAGLE3" and chain["disable_radix_cache"]
    tree = online.sglang_kwargs("/t", online.OnlineSettings(engine="sglang", steps=3, topk=2, num_draft_tokens=6),
                                1024, Path("/d"))
    assert (tree["speculative_eagle_topk"], tree["speculative_num_draft_tokens"]) == (2, 6)
    base = online.sglang_kwargs("/t", online.OnlineSettings(engine="sglang"), 1024, None)
    assert not any(k.startswith("speculative") for k in base) and base["context_length"] == 1024


def test_per_request_counts_are_compared_per_sample():
    rows = [{"id": "a#0", "num_drafts": 3, "num_accepted_tokens_per_pos": [2, 1]},
            {"id": "a#1", "num_drafts": 1, "num_accepted_tokens_per_pos": [0, 0]},
            {"id": "b#0", "num_drafts": 4, "num_accepted_tokens_per_pos": [1, 0]}]
    walk = {"a": {"rounds": 4, "accepted_per_pos": [2, 1]}, "b": {"rounds": 4, "accepted_per_pos": [2, 0]}}
    eq = et.compare_requests(walk, rows, ["a", "b"])
    assert (eq["compared"], eq["equal"]) == (2, 1)
    assert eq["mismatched"] == [{"sample": "b", "offline": walk["b"],
                                 "online": {"rounds": 4, "accepted_per_pos": [1, 0]}}]
    assert et.compare_requests(walk, rows, ["a"])["mismatched"] == []


def test_lane_skips_only_on_purpose_and_fails_loudly():
    skipped = _lane({"REDRAFT_SKIP_ENGINE_TRUTH": "1"})
    assert skipped.returncode == 0 and "SKIPPED ON PURPOSE" in skipped.stdout
    broken = _lane({"REDRAFT_SKIP_ENGINE_TRUTH": "0", "PYTHON": "/nonexistent/python"})
    assert broken.returncode != 0 and "missing" in broken.stderr


def test_cli_help(capsys):
    for mod in (online, et):
        with pytest.raises(SystemExit):
            mod.main(["--help"])
    text = capsys.readouterr().out
    for opt in ("--data", "--steps", "--max-new-tokens", "--speed-samples", "--engine-python", "--json", "--markdown",
                "--tau-tol", "--rate-tol", "--min-samples"):
        assert opt in text


def test_driver_usage_error():
    driver = [sys.executable, "-m", "redraft.engines.vllm_driver"]
    proc = subprocess.run([*driver, "job.json"], capture_output=True, text=True, check=False, cwd=ROOT)
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = subprocess.run(driver, input="", capture_output=True, text=True, check=False, cwd=ROOT)
    assert proc.returncode == 2  # no settings line: nothing to load


def test_killed_driver_takes_the_engine_processes_with_it(tmp_path):
    """vLLM's EngineCore is a child of the driver: a SIGTERM to the driver (or its runner dying) ends both."""
    pid_file = tmp_path / "engine.pid"
    spawning = write_fake_vllm(tmp_path / "spawning", FAKE_VLLM.replace(
        "        self.k = speculative_config",
        "        import subprocess\n"
        f"        open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '300']).pid))\n"
        "        self.k = speculative_config"))
    engine = vllm_engine.VLLMEngine(vllm_engine.EngineSettings(target=str(tmp_path)), python=sys.executable,
                                    extra_env={"PYTHONPATH": str(spawning)})
    child = int(pid_file.read_text())
    assert _running(child)  # the stand-in's "EngineCore"
    driver = engine._process._proc
    os.kill(driver.pid, signal.SIGTERM)
    driver.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child)
    engine.close()


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_engine_timeout_stops_it(world, tmp_path):
    slow = write_fake_vllm(tmp_path / "slow", FAKE_VLLM.replace(
        "    def generate(self, prompts, params, use_tqdm=False):\n",
        "    def generate(self, prompts, params, use_tqdm=False):\n        import time; time.sleep(60)\n"))
    reader = DatasetReader(world["data"])
    settings = online.OnlineSettings(steps=STEPS, speed_samples=0, engine_python=sys.executable, timeout_s=3,
                                     extra_env={"PYTHONPATH": str(slow)})
    with pytest.raises(online.OnlineError, match="ran past 3 s"):
        online.measure(world["ckpt"], reader, [0], settings, target=str(world["target"]))
