"""The stages meet only in core: core imports no stage, and no stage imports another (design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "extract", "train", "eval")
ALLOWED = {"core": {"core"}, "extract": {"core", "extract"}, "train": {"core", "train"}, "eval": {"core", "eval"}}


def _imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    wrong = {str(p.relative_to(ROOT)): sorted(_imported_packages(p) - ALLOWED[package])
             for p in sorted((ROOT / package).rglob("*.py"))}
    assert not {k: v for k, v in wrong.items() if v}, f"{package} imports another stage"
