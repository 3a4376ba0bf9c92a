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


def _top(module: str) -> str:
    """The subpackage (or top-level module) of dilocox that ``module`` belongs to: ``dilocox.X``."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """The module graph collapsed onto dilocox.X (a subpackage, or a module at the top): an edge A -> B when a module
    of A imports one of B (lazy imports included), and for each edge the module imports that make it."""
    pkgs: dict[str, set[str]] = {_top(m): set() for m in graph if m != "dilocox"}
    why: dict[tuple[str, str], list[str]] = {}
    for m, deps in graph.items():
        for d in deps:
            a, b = _top(m), _top(d)
            if a != b and a in pkgs and b in pkgs:
                pkgs[a].add(b)
                why.setdefault((a, b), []).append(f"{m} -> {d}")
    return pkgs, why


def test_package_cycle_finder_reports_a_constructed_cycle():
    """The package graph of a made-up module graph: x.a -> y.b -> x.c is a cycle of dilocox.x and dilocox.y although
    no two modules import each other; an import within one subpackage is not an edge."""
    g = {
        "dilocox.x.a": {"dilocox.y.b", "dilocox.x.c"},
        "dilocox.x.c": set(),
        "dilocox.y.b": {"dilocox.x.c"},
        "dilocox.z": {"dilocox.x.a"},
    }
    pkgs, why = _package_graph(g)
    assert pkgs == {"dilocox.x": {"dilocox.y"}, "dilocox.y": {"dilocox.x"}, "dilocox.z": {"dilocox.x"}}
    assert _cycles(pkgs) == [["dilocox.x", "dilocox.y"]]
    assert why[("dilocox.y", "dilocox.x")] == ["dilocox.y.b -> dilocox.x.c"]
    g["dilocox.y.b"] = set()
    assert _cycles(_package_graph(g)[0]) == []


def test_no_import_cycle_between_subpackages():
    """Issue 43 item 5: the subpackages of dilocox (and its top-level modules) form no cycle either, lazy imports
    included: e.g. elastic/ and swarm/ both build on net/, which imports neither."""
    pkgs, why = _package_graph(_graph())
    cycles = _cycles(pkgs)
    lines = []
    for c in cycles:
        lines.append(" <-> ".join(c))
        lines += [f"    {e}" for a in c for b in c if b in pkgs[a] for e in why[(a, b)]]
    assert not cycles, "import cycles between the subpackages of dilocox/ (with the imports that make them):\n" + (
        "\n".join(lines)
    )


def test_net_imports_none_of_its_users():
    """dilocox/net (the RPC, the mesh, the handshakes, the relays) is below elastic/, swarm/, outer/ and train: it
    imports none of them (lazily neither)."""
    users = ("dilocox.elastic", "dilocox.swarm", "dilocox.outer", "dilocox.train")
    graph = _graph()
    net = [m for m in graph if m == "dilocox.net" or m.startswith("dilocox.net.")]
    assert "dilocox.net.rpc" in net and "dilocox.net.secure" in net, sorted(net)
    bad = sorted(f"{m} -> {d}" for m in net for d in graph[m] if any(d == u or d.startswith(u + ".") for u in users))
    assert not bad, bad


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
