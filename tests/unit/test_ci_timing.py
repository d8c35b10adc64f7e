"""scripts/ci_timing.py: the per-file seconds the suite orders its files by (tests/durations.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers_paths import ROOT

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.engine.vllm.test_capture" name="test_a" time="10.5"/>
<testcase classname="tests.engine.vllm.test_capture" name="test_b" time="2.0"/>
<testcase classname="tests.unit.test_plain.TestGroup" name="test_c" time="1.25"/>
</testsuite></testsuites>"""


def test_durations_are_seconds_per_file_keyed_by_the_files_path(tmp_path: Path) -> None:
    (tmp_path / "test.xml").write_text(JUNIT)
    out = tmp_path / "durations.json"
    res = subprocess.run([sys.executable, "scripts/ci_timing.py", str(tmp_path), "--durations", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text()) == {"tests/engine/vllm/test_capture.py": 12.5, "tests/unit/test_plain.py": 1.2}


def test_the_committed_durations_name_files_that_exist() -> None:
    durations = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert durations and all((ROOT / path).is_file() for path in durations), \
        [p for p in durations if not (ROOT / p).is_file()]
