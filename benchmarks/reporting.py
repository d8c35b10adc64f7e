"""A benchmark's ending, once: print its table, and with ``--out`` write the table (.md) and every number (.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def publish(report: dict[str, Any], text: str, out: str, stem: str) -> None:
    print(text)
    if out:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (folder / f"{stem}.md").write_text(text)
