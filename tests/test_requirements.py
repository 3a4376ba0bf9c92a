"""requirements.txt declares every package that the code, the tests or a default config imports.

A fresh virtual environment gets only what requirements.txt names (``.ci/run`` builds one), so a package that
is imported but not declared fails there, while a ``pytest.importorskip`` of it would quietly skip the tests
that need it. These tests read every import of ``dilocox/``, ``tests/``, ``tools/`` and ``benchmarks/`` from the
source (import statements, ``importlib.import_module``, ``importlib.util.find_spec`` and ``pytest.importorskip``
with a literal name, anywhere in a file) and every backend that a config switches on, and fail on one that is neither
declared in requirements.txt nor one of the few guarded optional packages, whose guard must name the
``pip install`` that brings it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import importlib.metadata as md
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# packages that stay optional: each import sits in a function or behind a check, and the file that imports it
# says which pip install brings it (the hardware-specific kernels and SWARM's reference engine)
OPTIONAL = {
    "flash_attn": "pip install flash-attn",
    "transformer_engine": "pip install transformer-engine",
    "hivemind": "pip install hivemind",
}

# a module of an installed package that needs another package at import time
EXTRA = {"torch.utils.tensorboard": "tensorboard"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(path: str = os.path.join(ROOT, "requirements.txt")) -> set[str]:
    """The distribution names requirements.txt installs (normalised, PEP 503)."""
    names = set()
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
            assert m, f"requirements.txt: cannot read {line!r}"
            names.add(_norm(m.group(0)))
    return names


def _local_modules() -> set[str]:
    """Top-level names that are this repository's own (packages, and modules the tests and tools import)."""
    names = set()
    for d in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tools"), os.path.join(ROOT, "benchmarks")):
        for p in os.listdir(d):
            if p.endswith(".py"):
                names.add(p[:-3])
            elif os.path.isfile(os.path.join(d, p, "__init__.py")) or p in ("tests", "tools"):
                names.add(p)
    return names


_NAMED_IMPORTS = {"import_module", "find_spec", "importorskip"}


def imports_of(path: str) -> list[tuple[str, int, bool]]:
    """(dotted module, line, top_level) for every absolute import in ``path``.

    ``top_level`` is True for a plain import statement at module level outside try (one that runs when the
    module is imported and cannot be caught)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    guarded_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.If)):
            for sub in ast.walk(node):
                if sub is not node and hasattr(sub, "lineno"):
                    guarded_lines.add(sub.lineno)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, node.lineno not in guarded_lines) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno, node.lineno not in guarded_lines))
            found += [(f"{node.module}.{a.name}", node.lineno, node.lineno not in guarded_lines) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in _NAMED_IMPORTS and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, node.lineno, False))
    return found


def _sources() -> list[str]:
    files = []
    for d in ("dilocox", "tests", "tools", "benchmarks"):
        files += glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "*.py"))
    return sorted(files)


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


def _distributions_of(module: str) -> set[str]:
    """The installed distributions that provide ``module``'s top-level package; its own name when none is."""
    top = module.split(".")[0]
    return {_norm(d) for d in _packages_distributions().get(top, [])} or {_norm(top)}


def undeclared_imports(req: set[str]) -> list[str]:
    """One line per import that requirements.txt does not cover (empty when all are declared)."""
    std, local = set(sys.stdlib_module_names), _local_modules()
    problems = []
    for path in _sources():
        rel = os.path.relpath(path, ROOT)
        text, seen = None, set()
        for module, line, top_level in imports_of(path):
            top = module.split(".")[0]
            if top in std or top in local or top == "__future__" or (line, top, module in EXTRA) in seen:
                continue
            seen.add((line, top, module in EXTRA))
            if top in OPTIONAL:
                text = text if text is not None else open(path, encoding="utf-8").read()
                if top_level:
                    problems.append(f"{rel}:{line}: optional package {top} imported unguarded at module level")
                elif OPTIONAL[top] not in text:
                    problems.append(f"{rel}:{line}: optional package {top}: the file must say {OPTIONAL[top]!r}")
                continue
            need = {_norm(EXTRA[module])} if module in EXTRA else _distributions_of(module)
            if not need & req:
                problems.append(
                    f"{rel}:{line}: imports {module} (package {'/'.join(sorted(need))}), not in requirements.txt: "
                    "declare it there, or make it optional with a guard naming the pip install"
                )
    return sorted(set(problems))


def test_every_import_is_declared_in_requirements():
    problems = undeclared_imports(declared())
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_every_declared_package_is_installed():
    """What requirements.txt names is installed here (CI's fresh venv installs it; nothing skips for its lack)."""
    missing = []
    for name in sorted(declared()):
        try:
            md.version(name)
        except md.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"declared but not installed: {missing}; run make install (pip install -r requirements.txt)"


def test_the_check_catches_a_dropped_line(tmp_path):
    """Remove one line a test needs from a copy of requirements.txt: the import check names it."""
    req = declared()
    for pkg, module_hint in (("cryptography", "cryptography"), ("tensorboard", "torch.utils.tensorboard")):
        problems = undeclared_imports(req - {pkg})
        assert any(module_hint in p for p in problems), (pkg, problems)


# every config switch that brings in a package: (section, field, predicate on its value, package)
BACKENDS = [
    ("log", "tensorboard", bool, "tensorboard"),
    ("log", "wandb", bool, "wandb"),
    ("data", "source", lambda v: v == "hf", "datasets"),
    ("data", "tokenizer", lambda v: v == "bpe", "tokenizers"),
    ("security", "encrypt", bool, "cryptography"),
    ("model", "attn_backend", lambda v: v == "flash_attn", "flash_attn"),
    ("model", "attn_backend", lambda v: v == "te", "transformer_engine"),
    ("model", "init_from", bool, "safetensors"),
]


def _configs():
    from dilocox.config import Config, load_config

    yield "defaults", Config()
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)):
        if os.path.basename(os.path.dirname(path)) in ("methods", "model"):
            continue  # fragments: included by a run config, not runs of their own
        yield os.path.relpath(path, ROOT), load_config(path)


def test_every_backend_a_config_turns_on_is_declared():
    req = declared()
    problems = []
    for name, cfg in _configs():
        for section, key, on, pkg in BACKENDS:
            value = getattr(getattr(cfg, section), key)
            if not on(value):
                continue
            if pkg in OPTIONAL:
                problems.append(f"{name}: {section}.{key}={value!r} needs the optional {pkg}")
            elif _norm(pkg) not in req:
                problems.append(f"{name}: {section}.{key}={value!r} needs {pkg}, not in requirements.txt")
    assert not problems, "\n".join(problems)


def test_backends_table_names_real_fields():
    """The table above stays in step with the config: a renamed field fails here instead of being skipped."""
    from dilocox.config import Config

    cfg = Config()
    for section, key, _, _ in BACKENDS:
        assert key in {f.name for f in dataclasses.fields(getattr(cfg, section))}, f"{section}.{key}"


def test_default_logger_writes_tensorboard_events(tmp_path):
    """log.tensorboard is on by default: the logger writes event files (it does not silently do nothing)."""
    from dilocox.config import Config
    from dilocox.metrics import MetricsLogger

    assert Config().log.tensorboard, "the default changed: update this test and BACKENDS"
    log = MetricsLogger(str(tmp_path), enabled=True, total_steps=2, progress=False)
    log.write({"step": 1, "loss": 2.0})
    log.close()
    events = glob.glob(os.path.join(str(tmp_path), "tb", "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0, os.listdir(tmp_path)


@pytest.mark.parametrize("module", ["cryptography.hazmat.primitives.ciphers.aead", "datasets", "tensorboard"])
def test_default_backends_import(module):
    """The packages the defaults and documented switches need import in this environment."""
    import importlib

    importlib.import_module(module)
