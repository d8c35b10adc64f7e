"""The ``redraft`` command: every stage under one name, with the module's own options, help and exit codes."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_paths import ROOT

from redraft.cli import COMMANDS, GROUPS, module_for


def redraft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "redraft", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_console_script_is_installed_beside_this_python():
    script = Path(sys.executable).parent / "redraft"
    assert script.is_file(), f"{script}: pip install -e . writes it (pyproject's [project.scripts])"
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_help_lists_every_command_by_group():
    res = redraft("--help")
    assert res.returncode == 0, res.stderr
    for title in GROUPS.values():
        assert f"{title}:" in res.stdout
    for c in COMMANDS:
        assert f"  {c.name} " in res.stdout, c.name
    for card in ("sbatch slurm/extract.sh", "accelerate launch train/main.py", "python -m eval.acceptance ckpt/"):
        assert card in res.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_command_is_its_modules_command_line(command):
    cli = importlib.import_module(command.module).cli
    assert list(inspect.signature(cli).parameters) == ["argv"]
    ours, theirs = redraft(command.name, "--help"), subprocess.run(
        [sys.executable, "-m", command.module.removesuffix(".__main__"), "--help"], cwd=ROOT, capture_output=True,
        text=True, timeout=300)
    assert (ours.returncode, theirs.returncode) == (0, 0), (ours.stderr[-2000:], theirs.stderr[-2000:])
    # the same options (argparse names the program differently: python -m X, redraft.cli)
    assert _options(ours.stdout) == _options(theirs.stdout) and _options(ours.stdout)


def _options(help_text: str) -> set[str]:
    return {w.rstrip(",") for w in help_text.split() if w.startswith("--")}


def test_the_doctor_with_a_target_also_walks_the_replies():
    doctor = next(c for c in COMMANDS if c.name == "doctor")
    assert module_for(doctor, ["--url", "http://x"]) == "serve.doctor"
    assert module_for(doctor, ["--url", "http://x", "--target", "t"]) == "redraft.pipeline.doctor"
    assert module_for(doctor, ["--target=t"]) == "redraft.pipeline.doctor"


def test_a_users_mistake_is_one_line_and_exit_2(tmp_path):
    res = redraft("eval", str(tmp_path / "no-such-checkpoint"), "--data", str(tmp_path / "no-such-data"))
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "no-such" in res.stderr


@pytest.mark.parametrize("args", [[], ["nope"]])
def test_no_or_an_unknown_command_exits_2(args):
    res = redraft(*args)
    assert res.returncode == 2 and "redraft COMMAND" in res.stderr + res.stdout
