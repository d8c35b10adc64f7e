"""The first-party import graph of the tree, read from the source (ast), function-level imports included: what
tests/unit/test_house.py (circles, a drafter's way) and tests/unit/test_layering.py (floors) each hold rules over."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = ("redraft", "extract", "train", "eval", "serve", "conformance")
SCRIPT_FOLDERS = ("benchmarks", "scripts")


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file: the packages' modules by dotted name, the script folders' files as ``folder:stem``."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    for folder in SCRIPT_FOLDERS:
        for p in sorted((root / folder).glob("*.py")):
            mods[f"{folder}:{p.stem}"] = p
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's first-party imports, at any depth of its code (module level or inside a function)."""

    def resolve(name: str, folder: str | None) -> str | None:
        if folder and f"{folder}:{name.split('.')[0]}" in mods:  # a script's sibling
            return f"{folder}:{name.split('.')[0]}"
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        folder = mod.split(":")[0] if ":" in mod else None
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names += [f"{node.module}.{a.name}" for a in node.names]
        found = {r for r in (resolve(n, folder) for n in names) if r}
        graph[mod] = {d for d in found if d != mod and not mod.startswith(d + ".")}  # a package's own __init__
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def reached(graph: dict[str, set[str]], starts: tuple[str, ...]) -> set[str]:
    """Every module ``starts`` import, at any depth (function-level imports included)."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo += graph.get(mod, ())
    return seen
