"""The house's floors (docs/design.md): each room imports only its own floor's code below it, no stage imports
another, and no stage launches another as a process (``python -m STAGE``, ``runpy``, ``train/main.py``);
``redraft.pipeline`` is the one place that runs stages one after another, ``redraft.cli`` the one that names them
all.

    floor 3   redraft.pipeline, redraft.cli          (run the stages: as processes, or by name)
    floor 2   extract, train, eval, serve            (the stages: never each other)
    floor 1   redraft.engines, redraft.catalog       (engines; built-in targets and data)
    floor 0   redraft.core                           (the two contracts and the math every floor shares)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers_imports import import_graph, module_files
from helpers_paths import ROOT

STAGES = ("extract", "train", "eval", "serve")
BELOW_STAGES = {"redraft.core", "redraft.engines", "redraft.catalog"}
ALLOWED = {"redraft.core": {"redraft.core"},
           "redraft.engines": {"redraft.core", "redraft.engines"},
           "redraft.catalog": {"redraft.core", "redraft.catalog"},
           **{stage: BELOW_STAGES | {stage} for stage in STAGES},
           # pipeline reads serve.tune's option list; the command imports the stages by name when one runs
           "redraft.pipeline": BELOW_STAGES | {"redraft.pipeline", "serve"},
           "redraft.settings": {"redraft.core", "redraft.settings"},  # `redraft config`
           "redraft.cli": {"redraft.cli"}}
ROOMS = tuple(ALLOWED)
LAUNCHES = {room: {room, *BELOW_STAGES} for room in ROOMS} | {"redraft.pipeline": set(ROOMS)}


def room_of(module: str) -> str | None:
    """The room a dotted module name is in (``redraft.engines.vllm`` -> ``redraft.engines``), None outside."""
    parts = module.split(".")
    name = ".".join(parts[:2]) if parts[0] == "redraft" else parts[0]
    return name if name in ALLOWED else None


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


def _files(room: str) -> list[Path]:
    path = ROOT / room.replace(".", "/")
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def test_every_module_is_in_a_room():
    outside = [str(p.relative_to(ROOT)) for top in ("redraft", *STAGES) for p in (ROOT / top).rglob("*.py")
               if room_of(".".join(p.relative_to(ROOT).with_suffix("").parts)) is None
               and p.relative_to(ROOT).parts[1:] not in (("__init__.py",), ("__main__.py",))]
    assert not outside


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files(ROOT))  # the graph test_house holds circles over: one reading of the imports


@pytest.mark.parametrize("room", ROOMS)
def test_imports_point_down(room, graph):
    wrong = {mod: sorted({room_of(d) for d in deps} - {None} - ALLOWED[room])
             for mod, deps in graph.items() if room_of(mod) == room}
    assert not {k: v for k, v in wrong.items() if v}, f"{room} imports a room on its floor or above"


@pytest.mark.parametrize("room", ROOMS)
def test_no_stage_launches_another(room):
    wrong = {}
    for p in _files(room):
        launched = launched_modules(ast.parse(p.read_text()))
        others = sorted(m for m in launched if room_of(m) and room_of(m) not in LAUNCHES[room])
        if others:
            wrong[str(p.relative_to(ROOT))] = others
    assert not wrong, f"{room} launches another stage's module: {wrong}"


def test_the_launch_finder_sees_every_way_of_launching():
    tree = ast.parse("import runpy, subprocess, sys\n"
                     "subprocess.run([sys.executable, '-m', 'extract', '--out', 'x'])\n"
                     "cmd = (sys.executable, '-m', 'eval.acceptance')\n"
                     "runpy.run_module('serve.bench', run_name='__main__')\n"
                     "subprocess.run(['python', 'train/main.py', '--data', 'd'])\n"
                     "print('python -m extract is what you run')\n")
    assert launched_modules(tree) == {"extract", "eval.acceptance", "serve.bench", "train.main"}

