"""No tracked file points outside the repository: CI and users have a clone and nothing beside it.

A reference to the notes that lived next to the checkout, or to one machine's home, workspace or wheel folder,
works on the machine that wrote it and nowhere else. Every tracked text file is read, code, docs, configs,
committed reports and test data alike. The patterns are assembled from pieces so that this file does not match
itself.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from helpers_paths import ROOT

SIBLING = "shared"
MACHINE_DIRS = ["wo" + "rk", "ro" + "ot", "ho" + r"me/[\w.-]+", "opt/wh" + "eels", "old_" + "root"]
FORBIDDEN = {
    "a folder beside the checkout": re.compile(r"\.\./" + SIBLING + r"\b"),
    "the notes that lived beside the checkout": re.compile(SIBLING + "/(?:reference|tools)/"),
    "a path of one machine": re.compile(r"(?<![\w.~$/-])/(?:" + "|".join(MACHINE_DIRS) + r")\b"),
}


def tracked_files() -> list[str]:
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.fail(f"git ls-files failed in {ROOT}: {res.stderr.strip()} (the guard needs the checkout's file list)")
    return [f for f in res.stdout.split("\0") if f]


def offending_lines(text: str) -> list[tuple[int, str, str]]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for why, pattern in FORBIDDEN.items():
            if pattern.search(line):
                hits.append((n, why, line.strip()[:160]))
    return hits


def test_no_tracked_file_points_outside_the_repository():
    files = tracked_files()
    assert len(files) > 100, files  # the whole tree, not a subfolder
    problems = []
    for name in files:
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files (images), and files deleted in the working tree
        problems += [f"{name}:{n}: {why}: {line}" for n, why, line in offending_lines(text)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line", [
    "see " + ".." + "/" + SIBLING + "/seed.txt",
    "(" + SIBLING + "/reference/sglang_cpu.md)",
    'model_name="/' + "root" + '/.cache/redraft/smollm2"',
    "git clone /" + "work" + "/main /tmp/ci",
    "PIP_FIND_LINKS=/" + "opt/wheels",
    "cd /" + "home/alice/redraft",
])
def test_the_guard_catches_each_kind(line):
    assert offending_lines(line), line


@pytest.mark.parametrize("line", [
    "~/.cache/redraft/smollm2-135m-instruct", "$REDRAFT_CACHE/kimi-k25-mini", "git clone . /tmp/ci-clone",
    "docs/work/notes.md", "tests/engine/vllm/test_regen_vllm.py", "/scratch/data", "--out runs/root/x",
])
def test_the_guard_lets_repository_and_generic_paths_through(line):
    assert not offending_lines(line), line
