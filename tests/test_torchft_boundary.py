"""Import boundaries (issue 43): torchft is imported in one module of dilocox only, ``dilocox/elastic/torchft.py``;
the codecs (``dilocox/compress/``) import no ``torch.distributed`` (they exchange through the Wire they are handed).

Every other module takes what it needs from torchft through that module's lazy accessors, so the supported release
is checked in one place and an upgrade of torchft touches one file. The import is read from the source (AST): the
import statements anywhere in a module (the lazy ones in functions included) and ``importlib.import_module`` /
``__import__`` / ``importlib.util.find_spec`` of a literal ``torchft...`` name.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "dilocox")
BOUNDARY = os.path.join("dilocox", "elastic", "torchft.py")
_BY_NAME = {"import_module", "__import__", "find_spec"}


def _is_torchft(name: str | None, top: str = "torchft") -> bool:
    return bool(name) and (name == top or name.startswith(top + "."))


def torchft_imports(path: str, top: str = "torchft") -> list[int]:
    """The lines of ``path`` that import ``top`` (torchft by default) or one of its modules."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(_is_torchft(a.name, top) for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (
                _is_torchft(node.module, top) or any(_is_torchft(f"{node.module}.{a.name}", top) for a in node.names)
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in _BY_NAME and isinstance(node.args[0].value, str) and _is_torchft(node.args[0].value, top):
                lines.append(node.lineno)
    return sorted(lines)


def violations(root: str = ROOT) -> list[str]:
    """``file:line`` of every torchft import under ``root``/dilocox outside ``dilocox/elastic/torchft.py``."""
    out = []
    for d, _, files in os.walk(os.path.join(root, "dilocox")):
        for f in sorted(files):
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root)
            if f.endswith(".py") and rel != BOUNDARY:
                out += [f"{rel}:{line}" for line in torchft_imports(path)]
    return sorted(out)


def test_the_codecs_import_no_torch_distributed(tmp_path):
    """compress/ reaches other replicas only through a Wire (compress/codec.py); the check itself finds both forms."""
    comp = os.path.join(PKG, "compress")
    found = [f"{f}:{n}" for f in sorted(os.listdir(comp)) if f.endswith(".py")
             for n in torchft_imports(os.path.join(comp, f), "torch.distributed")]  # fmt: skip
    assert not found, f"torch.distributed imported in dilocox/compress/: {found}"
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\nfrom torch import distributed\n")
    assert torchft_imports(str(bad), "torch.distributed") == [1, 2]


def test_only_the_boundary_module_imports_torchft():
    bad = violations()
    assert not bad, (
        "torchft imported outside dilocox/elastic/torchft.py (add an accessor there and use it):\n" + "\n".join(bad)
    )
    assert torchft_imports(os.path.join(ROOT, BOUNDARY)), "the boundary module imports torchft no more?"


def test_the_check_finds_every_form_of_import(tmp_path):
    """The checker itself, on a fake tree: each form is caught with its line; dilocox's own module named torchft
    (absolute or relative) is not torchft."""
    mod = tmp_path / "dilocox" / "elastic"
    mod.mkdir(parents=True)
    (mod / "torchft.py").write_text("import torchft\n")
    (mod / "bad.py").write_text(
        "import os\n"
        "import torchft.manager as tm\n"
        "from torchft import Manager\n"
        "def f():\n"
        "    from torchft.process_group import ProcessGroup\n"
        "    importlib.import_module('torchft.coordination')\n"
        "    __import__('torchft')\n"
        "    importlib.util.find_spec('torchft')\n"
    )
    (mod / "good.py").write_text(
        "from dilocox.elastic.torchft import manager_module\n"
        "from dilocox.elastic import torchft\n"
        "from . import torchft as tf\n"
        "from .torchft import quorum_id\n"
        "import torchftx\n"
        "importlib.import_module('dilocox.elastic.torchft')\n"
    )
    bad = os.path.join("dilocox", "elastic", "bad.py")
    assert violations(str(tmp_path)) == [f"{bad}:{n}" for n in (2, 3, 5, 6, 7, 8)]


def test_the_boundary_module_imports_only_the_standard_library_at_module_level():
    """failover.py run as a script (the fast lighthouse) loads dilocox/elastic/torchft.py by path, without torch or
    the dilocox package: its module-level imports are the standard library's."""
    path = os.path.join(ROOT, BOUNDARY)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    tops = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            tops += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            tops.append((node.module or "").split(".")[0])
    assert tops and all(t in sys.stdlib_module_names or t == "__future__" for t in tops), tops


def test_importing_dilocox_imports_no_torchft():
    code = (
        "import sys\n"
        "import dilocox, dilocox.elastic, dilocox.elastic.torchft, dilocox.elastic.stores, dilocox.cli\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchft'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_fast_lighthouse_script_finds_the_real_torchft():
    """``python3 dilocox/elastic/failover.py lighthouse``: the script's directory holds dilocox's torchft.py, which
    must not shadow the torchft package; the lighthouse listens and neither torch nor dilocox is imported."""
    pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0)")
    script = os.path.join(ROOT, "dilocox", "elastic", "failover.py")
    argv = ["lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--lifetime", "0.2"]
    r = subprocess.run(
        [sys.executable, "-X", "importtime", script, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"address": "http://' in r.stdout, r.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in r.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "dilocox"}, sorted(imported & {"torch", "dilocox"})
    assert "loading torchft's extension directly failed" not in r.stderr, r.stderr[-2000:]
