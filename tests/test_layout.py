"""The package's shape (issue 19): no import cycle, no module above 600 lines, the product imports no harness.

Imports are read from the source (every ``import``/``from ... import`` anywhere in a module, the lazy ones
inside functions included: a lazy import hides a cycle from the interpreter, not from a reader).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dilocox")
MAX_LINES = 600


def _modules() -> dict[str, str]:
    """dotted module name -> file path, for every .py under dilocox/."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(d, f)
    return out


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
    """The dilocox modules that ``name`` imports (a ``from pkg import sub`` counts as importing pkg.sub)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in mods else base)
    return {m for m in found if m in mods and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a 3-cycle and a self-contained chain."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = _graph()
    # a package's __init__ re-exporting its own submodules is not a cycle with them (the interpreter
    # imports the package first either way): drop those edges only
    g = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    cycles = _cycles(g)
    assert not cycles, "import cycles in dilocox/ (each line: modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_module_above_the_limit():
    long = []
    for name, path in sorted(_modules().items()):
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"modules above {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)


@pytest.mark.parametrize("outside", ["tools", "tests", "benchmarks"])
def test_the_product_imports_no_harness(outside):
    bad = []
    for name, path in _modules().items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{name} imports {n}" for n in names if n == outside or n.startswith(outside + ".")]
    assert not bad, "\n".join(bad)


MAX_FUNCTION_LINES = 80


def test_no_function_above_the_limit():
    """Issue 25: no function or method in dilocox/ longer than 80 lines (a nested function counts inside its parent
    too): a long function is split into named steps."""
    long = []
    for name, path in _modules().items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {long}"


def test_processes_are_started_by_the_launch_library():
    """Issue 25 item 4: every child process of a run is started in its own session by
    dilocox.distributed.procs.spawn (one kill_group reaches it and what it started), nowhere by hand."""
    by_hand = []
    for name, path in _modules().items():
        if name == "dilocox.distributed.procs":
            continue
        text = open(path, encoding="utf-8").read()
        for needle in ("start_new_session", "os.killpg", "os.setsid"):
            if needle in text:
                by_hand.append(f"{name}: {needle}")
    assert not by_hand, by_hand
