"""slurm/train.sh and slurm/serve.sh: their argument assembly, run through --dry-run with a faked Slurm environment."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_paths import ROOT

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No SLURM_* variables and a PATH without scontrol/srun/nvidia-smi unless a test adds fakes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "hostname", "head", "dirname", "wc", "cat", "sed", "tail"):
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "PYTHON": sys.executable}
    env.update(extra)
    return env


def _run(script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", f"slurm/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def _lines(out: str, prefix: str) -> dict[str, list[str]]:
    found = {}
    for line in out.splitlines():
        if line.startswith(prefix):
            key, _, cmd = line.partition(": ")
            found[key] = shlex.split(cmd)
    return found


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# ---------------------------------------------------------------------------------------------------------
# train.sh


def _slurm_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(SLURM_JOB_ID="4242", SLURM_NNODES="3", SLURM_JOB_NODELIST="gpu[007-009,012]",
               SLURM_GPUS_ON_NODE="8", DATA="/scratch/data", OUT="/scratch/train")
    env.update(extra)
    return _clean_env(tmp_path, **env)


def test_train_multinode_dry_run_without_scontrol(tmp_path):
    env = _slurm_env(tmp_path)
    assert shutil.which("scontrol", path=env["PATH"]) is None
    run = _run("train.sh", ["--dry-run", "--lr", "3e-5"], env)
    assert run.returncode == 0, run.stderr
    srun = _lines(run.stdout, "srun")["srun"]
    assert srun[:4] == ["srun", "--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert srun[-3:] == ["--node-launch", "--lr", "3e-5"]
    nodes = _lines(run.stdout, "node ")
    assert sorted(nodes) == ["node 0", "node 1", "node 2"]
    for rank in range(3):
        argv = nodes[f"node {rank}"]
        assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
        assert _opt(argv, "--machine_rank") == str(rank)
        assert _opt(argv, "--num_machines") == "3"
        assert _opt(argv, "--num_processes") == "24"
        assert _opt(argv, "--main_process_ip") == "gpu007"  # parsed from the nodelist, zero padding kept
        assert _opt(argv, "--main_process_port") == "29500"
        assert _opt(argv, "--config_file") == "configs/accelerate/multinode-zero2-bf16.yaml"
        script = argv.index("train/main.py")
        train_args = argv[script + 1:]
        assert _opt(train_args, "--config") == "configs/kimi-k25.yaml"
        assert _opt(train_args, "--resume") == "auto"
        assert _opt(train_args, "--data") == "/scratch/data" and _opt(train_args, "--out") == "/scratch/train"
        assert train_args[-2:] == ["--lr", "3e-5"]  # user arguments last, so they win
    assert (ROOT / "configs/accelerate/multinode-zero2-bf16.yaml").is_file()
    assert (ROOT / "configs/kimi-k25.yaml").is_file()


def test_train_uses_scontrol_when_present(tmp_path):
    env = _slurm_env(tmp_path, SLURM_JOB_NODELIST="weird-list")
    fake = tmp_path / "bin" / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames weird-list" ] && printf "alpha\\nbeta\\n"\n')
    fake.chmod(0o755)
    run = _run("train.sh", ["--dry-run"], env)
    assert run.returncode == 0, run.stderr
    assert _opt(_lines(run.stdout, "node ")["node 1"], "--main_process_ip") == "alpha"


@pytest.mark.parametrize("nodelist, first", [("n1,n2", "n1"), ("solo", "solo"), ("a[3-4],b[1-2]", "a3"),
                                             ("rack1-gpu[10,12-13]", "rack1-gpu10")])
def test_train_nodelist_fallback(tmp_path, nodelist, first):
    run = _run("train.sh", ["--dry-run"], _slurm_env(tmp_path, SLURM_JOB_NODELIST=nodelist))
    assert run.returncode == 0, run.stderr
    assert _opt(_lines(run.stdout, "node ")["node 0"], "--main_process_ip") == first


def test_train_single_node_uses_the_8gpu_config(tmp_path):
    env = _slurm_env(tmp_path, SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu001", SLURM_GPUS_ON_NODE="4")
    run = _run("train.sh", ["--dry-run"], env)
    argv = _lines(run.stdout, "node ")["node 0"]
    assert _opt(argv, "--config_file") == "configs/accelerate/gpu-8-zero2-bf16.yaml"
    assert _opt(argv, "--num_processes") == "4" and _opt(argv, "--machine_rank") == "0"


def test_train_node_launch_takes_the_rank_from_srun(tmp_path):
    echo = tmp_path / "echo-python"
    echo.write_text('#!/bin/sh\necho "LAUNCH $*"\n')
    echo.chmod(0o755)
    env = _slurm_env(tmp_path, SLURM_NODEID="2", MAIN_ADDR="gpu007", PYTHON=str(echo))
    run = _run("train.sh", ["--node-launch", "--max_steps", "10"], env)
    assert run.returncode == 0, run.stderr
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("LAUNCH")]
    argv = line.split()
    assert _opt(argv, "--machine_rank") == "2" and _opt(argv, "--main_process_ip") == "gpu007"
    assert argv[-2:] == ["--max_steps", "10"] and "--node-launch" not in argv


def test_train_outside_slurm_is_one_local_launch(tmp_path):
    run = _run("train.sh", ["--dry-run", "--data", "runs/data", "--out", "runs/train"], _clean_env(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "srun" not in run.stdout
    argv = _lines(run.stdout, "node ")["node 0"]
    assert _opt(argv, "--config_file") == "configs/accelerate/cpu-2proc-zero2.yaml"  # no nvidia-smi here
    assert _opt(argv, "--num_processes") == "2" and _opt(argv, "--num_machines") == "1"
    assert _opt(argv, "--config") == "configs/demo/train.yaml" and _opt(argv, "--resume") == "auto"


# ---------------------------------------------------------------------------------------------------------
# serve.sh


def test_serve_eagle3_dry_run(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "max_position_embeddings": 262144,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}))
    run = _run("serve.sh", ["--dry-run", "--draft", str(draft), "--target", "/models/K25"], _clean_env(tmp_path))
    assert run.returncode == 0, run.stderr
    argv = shlex.split(run.stdout.strip())
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert _opt(argv, "--model-path") == "/models/K25" and _opt(argv, "--tp-size") == "8"
    assert "--trust-remote-code" in argv
    assert _opt(argv, "--speculative-algorithm") == "EAGLE3"
    assert _opt(argv, "--speculative-draft-model-path") == str(draft)
    assert (_opt(argv, "--speculative-num-steps"), _opt(argv, "--speculative-eagle-topk"),
            _opt(argv, "--speculative-num-draft-tokens")) == ("3", "1", "4")
    assert _opt(argv, "--max-running-requests") == "256" and _opt(argv, "--cuda-graph-max-bs") == "256"
    assert "layer ids [2, 30, 58]" in run.stderr and "ready to launch" in run.stderr and "warning" not in run.stderr


def test_serve_reads_the_export_settings_and_passes_extras(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    from redraft.engines.launch import (  # the command the export records in redraft.json
        LaunchPlan,
        sglang_command,
    )

    command = sglang_command("/models/K25", str(draft), LaunchPlan(steps=5, topk=4, num_draft_tokens=8, tp=8))
    (draft / "redraft.json").write_text(json.dumps({"format": "redraft-export", "command": command}))
    (draft / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    env = _clean_env(tmp_path, DRAFT=str(draft), MAX_RUNNING_REQUESTS="512")
    run = _run("serve.sh", ["--dry-run", "--cuda-graph-max-bs", "160", "--", "--mem-fraction-static", "0.85"], env)
    assert run.returncode == 0, run.stderr
    argv = shlex.split(run.stdout.strip())
    assert (_opt(argv, "--speculative-num-steps"), _opt(argv, "--speculative-eagle-topk"),
            _opt(argv, "--speculative-num-draft-tokens")) == ("5", "4", "8")
    run = _run("serve.sh", ["--dry-run", "--steps", "2"], env)  # an explicit option beats the record
    assert _opt(shlex.split(run.stdout.strip()), "--speculative-num-steps") == "2"
    assert _opt(argv, "--max-running-requests") == "512" and _opt(argv, "--cuda-graph-max-bs") == "160"
    assert argv[-2:] == ["--mem-fraction-static", "0.85"]
    assert "the server serves 262,144 tokens" in run.stderr and "a launch would stop here" in run.stderr


def test_serve_stops_before_a_launch_that_would_read_the_drafter_at_other_layers(tmp_path):
    """The doctor's static check (serve.doctor --before-launch): a Kimi-K2.5 export trained on layers [1, 29, 57]
    whose config.json asks [2, 30, 58] is read one layer deep by SGLang 0.5.10; with no SGLang installed every
    version known to redraft is checked, so the launch stops with the ids read alike by all of them."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "max_position_embeddings": 262144,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}))
    (draft / "redraft.json").write_text(json.dumps({"format": "redraft-export", "drafter": {
        "aux_layer_ids": [1, 29, 57], "target_architecture": "KimiK25ForConditionalGeneration",
        "target_num_layers": 61}}))
    run = _run("serve.sh", ["--draft", str(draft), "--target", "/models/K25"], _clean_env(tmp_path))
    assert run.returncode != 0 and "would not be served as trained" in run.stderr
    assert "SGLang 0.5.10 would capture other layers" in run.stderr and "[1, 29, 57]" in run.stderr
    dry = _run("serve.sh", ["--dry-run", "--draft", str(draft), "--target", "/models/K25"], _clean_env(tmp_path))
    assert dry.returncode == 0 and "a launch would stop here" in dry.stderr


def test_serve_topk1_forces_steps_plus_one_and_warns_at_48(tmp_path):
    run = _run("serve.sh", ["--dry-run", "--steps", "5", "--draft-tokens", "4", "--max-running-requests", "48"],
               _clean_env(tmp_path))
    assert run.returncode == 0, run.stderr
    argv = shlex.split(run.stdout.strip())
    assert _opt(argv, "--speculative-num-draft-tokens") == "6"
    assert "forces num_draft_tokens" in run.stderr and "WARNING: --max-running-requests 48" in run.stderr


def test_serve_base_mode_has_no_speculation_but_explicit_limits(tmp_path):
    run = _run("serve.sh", ["--dry-run", "--base", "--port", "31000"], _clean_env(tmp_path))
    assert run.returncode == 0, run.stderr
    argv = shlex.split(run.stdout.strip())
    assert not [a for a in argv if a.startswith("--speculative")]
    assert _opt(argv, "--max-running-requests") == "256" and _opt(argv, "--cuda-graph-max-bs") == "256"
    assert _opt(argv, "--port") == "31000"


@pytest.mark.parametrize("args, message", [(["--port"], "--port needs a value"),
                                           (["--max-running-requests", "lots"], "MAX_RUNNING_REQUESTS must be")])
def test_serve_rejects_bad_options(tmp_path, args, message):
    run = _run("serve.sh", ["--dry-run", *args], _clean_env(tmp_path))
    assert run.returncode == 2 and message in run.stderr


def test_scripts_parse_with_bash_n():
    for script in ("train.sh", "serve.sh"):
        assert subprocess.run(["bash", "-n", f"slurm/{script}"], cwd=ROOT, env=dict(os.environ)).returncode == 0


def test_extract_in_slurm_stops_when_the_python_has_no_sglang(tmp_path):
    """The Kimi config asks for SGLang; this test's python has none: the job stops before it starts, naming it."""
    env = _clean_env(tmp_path, SLURM_JOB_ID="1")
    del env["PYTHON"]
    env["REDRAFT_ENGINE_PYTHON"] = sys.executable
    r = _run("extract.sh", [], env)
    assert r.returncode == 2
    assert f"{sys.executable} has no SGLang" in r.stderr and "REDRAFT_ENGINE_PYTHON" in r.stderr


def test_extract_names_a_python_that_is_not_there(tmp_path):
    r = _run("extract.sh", ["--backend", "sglang"], _clean_env(tmp_path, PYTHON=str(tmp_path / "nope" / "python")))
    assert r.returncode == 2 and "PYTHON=" in r.stderr and "is not an executable" in r.stderr


def test_extract_backend_flag_overrides_the_config_for_the_engine_check(tmp_path):
    r = _run("extract.sh", ["--backend=sglang", "--help"], _clean_env(tmp_path))
    assert r.returncode == 2 and "backend sglang" in r.stderr
    r = _run("extract.sh", ["--help"], _clean_env(tmp_path))  # the demo config: hf, no engine to check
    assert r.returncode == 0 and "--backend" in r.stdout


def test_serve_stops_when_the_python_has_no_sglang(tmp_path):
    r = _run("serve.sh", ["--base", "--target", str(tmp_path)], _clean_env(tmp_path))
    assert r.returncode == 2 and "has no SGLang" in r.stderr
