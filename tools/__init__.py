"""Harnesses that measure other systems, or drive the product from outside: not part of dilocox.

What lives here (issue 19: the product package holds the product), for example:

- ``swarm_engines``: the membership / transport engines SWARM could use (torchft, hivemind) measured on
  loopback, for docs/SWARM.md;
- ``elastic_toy``: toy elastic replicas around torchft's lighthouse (tests/test_elastic*.py, the measured numbers
  of docs/ELASTIC.md and docs/RELIABILITY.md).

Nothing here is installed with the package (setup.py installs ``dilocox*`` only), and nothing under ``dilocox/``
imports from here. Run a tool from the repository root::

    python -m tools.<name> ...

A tool that starts itself again in a child process gives the child ``child_env()``: the repository root on
``PYTHONPATH``, so ``python -m tools.<name>`` resolves whatever the parent's working directory.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(env: dict | None = None, **extra: str) -> dict:
    """A copy of ``env`` (default: this process's environment) with the repository root first on ``PYTHONPATH``
    (so ``tools`` and this checkout's ``dilocox`` are importable) and ``extra`` set."""
    out = dict(os.environ if env is None else env, **extra)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, out.get("PYTHONPATH")) if p)
    return out
