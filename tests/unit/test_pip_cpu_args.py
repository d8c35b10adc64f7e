"""scripts/pip_cpu_args.py: PyTorch's CPU index is added exactly when pip's configured indexes lack the CPU build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pip_cpu_args


def test_the_index_is_added_only_when_the_configured_ones_lack_the_build():
    assert pip_cpu_args.extra_index_args(True, "https://x/cpu") == []
    assert pip_cpu_args.extra_index_args(False, "https://x/cpu") == ["--extra-index-url", "https://x/cpu"]


def test_the_probe_is_a_dry_run_of_the_spec():
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if "torch==2.13.0+cpu" in cmd else 1)

    assert pip_cpu_args.configured_serves(["pip"], "torch==2.13.0+cpu", run=run)
    assert not pip_cpu_args.configured_serves(["pip"], "torch==9.9+cpu", run=run)
    assert all("--dry-run" in c and "--no-deps" in c for c in calls)


def test_main_names_the_configured_index(monkeypatch, capsys):
    monkeypatch.setattr(pip_cpu_args, "configured_serves", lambda pip, spec: False)
    monkeypatch.setenv("REDRAFT_TORCH_CPU_INDEX", "https://mirror.example/whl/cpu")
    assert pip_cpu_args.main(["--pip", "pip"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "--extra-index-url https://mirror.example/whl/cpu"
    assert "is not on the configured indexes" in out.err


def test_this_machines_wheel_folder_serves_the_cpu_build():
    """Where pip's find-links hold the CPU wheel (redraft's CI machines), no index is added: no network wait."""
    import os

    import pytest

    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    if not any(list(Path(d).glob("torch-2.13.0+cpu-*.whl")) for d in folders):
        pytest.skip("pip's find-links hold no torch 2.13.0+cpu wheel here: a user's machine, nothing to hold")
    assert pip_cpu_args.configured_serves([sys.executable, "-m", "pip"], "torch==2.13.0+cpu")
