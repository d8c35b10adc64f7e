"""A benchmark's ending, once: print its table, and with ``--out`` write the table (.md) and every number (.json);
and a case measured in a child process of its own (a fresh process's peak RSS is that case's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def publish(report: dict[str, Any], text: str, out: str, stem: str) -> None:
    print(text)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (folder / f"{stem}.md").write_text(text)


def child_case(script: str, *args: str) -> dict[str, Any]:
    """Run ``python script *args`` and return the JSON object its last line of stdout prints; a failed child stops
    the benchmark with its command and the end of its stderr."""
    cmd = [sys.executable, script, *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
