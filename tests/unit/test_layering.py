"""The stages meet only in core's and catalog's code and in files (design.md): core imports no stage, no stage
imports another, and no stage launches another as a process (``python -m STAGE``, ``runpy``, ``train/main.py``);
``pipeline`` is the one place that runs stages one after another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers_paths import ROOT

STAGES = ("extract", "train", "eval", "serve")
LIBRARIES = ("core", "catalog")
PACKAGES = (*LIBRARIES, *STAGES, "pipeline")
ALLOWED = {"core": {"core"}, "catalog": {"core", "catalog"},
           **{stage: {"core", "catalog", stage} for stage in STAGES},
           "pipeline": {"core", "catalog", "pipeline", "serve"}}  # pipeline reads serve.tune's option list
LAUNCHES = {package: {package, *LIBRARIES} for package in PACKAGES} | {"pipeline": set(PACKAGES)}


def _imported_packages(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def launched_modules(tree: ast.AST) -> set[str]:
    """Modules a file starts as a process or runs as a program: ``[..., "-m", "X", ...]`` in a list or tuple,
    ``runpy.run_module("X")``, a ``train/main.py`` path in an argument list."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in node.elts]
            found |= {nxt for flag, nxt in zip(items, items[1:], strict=False) if flag == "-m" and nxt}
            found |= {"train.main" for s in items if s and s.endswith("train/main.py")}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "run_module", "run_path") and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value).replace("/", ".").removesuffix(".py"))
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    wrong = {str(p.relative_to(ROOT)): sorted(_imported_packages(ast.parse(p.read_text())) - ALLOWED[package])
             for p in _files(package)}
    assert not {k: v for k, v in wrong.items() if v}, f"{package} imports another stage"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_stage_launches_another(package):
    wrong = {}
    for p in _files(package):
        rel = str(p.relative_to(ROOT))
        launched = launched_modules(ast.parse(p.read_text()))
        others = sorted(m for m in launched if m.split(".")[0] in PACKAGES
                        and m.split(".")[0] not in LAUNCHES[package])
        if others:
            wrong[rel] = others
    assert not wrong, f"{package} launches another stage's module: {wrong}"


def test_the_launch_finder_sees_every_way_of_launching():
    tree = ast.parse("import runpy, subprocess, sys\n"
                     "subprocess.run([sys.executable, '-m', 'extract', '--out', 'x'])\n"
                     "cmd = (sys.executable, '-m', 'eval.acceptance')\n"
                     "runpy.run_module('serve.bench', run_name='__main__')\n"
                     "subprocess.run(['python', 'train/main.py', '--data', 'd'])\n"
                     "print('python -m extract is what you run')\n")
    assert launched_modules(tree) == {"extract", "eval.acceptance", "serve.bench", "train.main"}

