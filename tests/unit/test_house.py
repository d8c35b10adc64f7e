"""The house's rules that a newcomer relies on, held over the whole tree: no import circles (a function-level
import included: one inside a function hides a circle, it does not remove it), and no ``sys.path`` edits (redraft
is imported as installed; scripts import their siblings from their own folder, tests through pytest's
``pythonpath``)."""

from __future__ import annotations

import ast

from helpers_imports import circles, import_graph, module_files, reached
from helpers_paths import ROOT
from test_repository_paths import tracked_files

DRAFTER_WAY = ("train.main", "eval.export")  # a drafter's way from training to the folder an engine serves


def test_the_drafters_way_imports_nothing_back_and_forth():
    """PYTHONPATH=tests:tests/unit python -c "from test_house import *; g = import_graph(module_files(ROOT));
    print(len(reached(g, DRAFTER_WAY)))" counts its modules (41 since the token counts left the writer; 55 before issue 47)."""
    graph = import_graph(module_files(ROOT))
    way = reached(graph, DRAFTER_WAY)
    assert {"train.main", "eval.export", "redraft.core.drafter.modeling"} <= way
    assert not sorted({tuple(sorted((a, b))) for a in way for b in graph[a] if a in graph.get(b, ())})
    assert "redraft.core.drafter.serving_format" not in reached(graph, ("redraft.core.drafter.modeling",))


def test_no_import_circles():
    assert circles(import_graph(module_files(ROOT))) == []


def test_a_circle_hidden_inside_a_function_is_found(tmp_path):
    (tmp_path / "redraft" / "core").mkdir(parents=True)
    (tmp_path / "redraft" / "core" / "a.py").write_text("from redraft.core.b import g\n")
    (tmp_path / "redraft" / "core" / "b.py").write_text("def g():\n    from redraft.core import a\n    return a\n")
    (tmp_path / "redraft" / "core" / "c.py").write_text("import redraft.core.a\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "x.py").write_text("def f():\n    import y\n")
    (tmp_path / "benchmarks" / "y.py").write_text("from x import f\n")
    assert circles(import_graph(module_files(tmp_path))) == [["redraft.core.a", "redraft.core.b"],
                                                             ["benchmarks:x", "benchmarks:y"]]


def _is_sys_path(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(source: str) -> list[int]:
    """Lines that change ``sys.path``: its insert/append/extend, or an assignment to it or a slice of it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("insert", "append", "extend") and _is_sys_path(node.func.value)):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for target in targets if _is_sys_path(target)]
    return lines


def test_no_file_edits_sys_path():
    edits = [f"{name}:{n}" for name in tracked_files() if name.endswith(".py")
             for n in sys_path_edits((ROOT / name).read_text())]
    assert not edits, edits


def test_the_sys_path_guard_catches_each_form():
    for line in ("sys.path.insert(0, ROOT)", "sys.path.append('x')", "sys.path[:0] = [a]", "sys.path += [a]",
                 "sys.path = [a]"):
        assert sys_path_edits(line) == [1], line
    assert sys_path_edits("print(sys.path)\nx = 'sys.path.insert(0, y)'") == []
