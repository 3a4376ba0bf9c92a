"""The one module of dilocox that imports torchft (issue 43): the supported release, the private names dilocox uses,
and lazy accessors for what the rest of the package takes from torchft.

torchft is needed by the elastic mode only and is slow to import (it imports torch), so nothing here imports it at
module level: each accessor imports it on its first call and checks the release (``check_torchft_version``); a
missing or unsupported torchft is one ImportError naming ``pip install torchft==0.2.0``. Another module under
dilocox/ that imports torchft fails tests/test_torchft_boundary.py.

This module imports nothing but the standard library at module level: ``dilocox/elastic/failover.py`` run as a
script (the lighthouse that starts fast) loads it by path, without the dilocox package (which would import torch).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
from types import ModuleType
from typing import Any

log = logging.getLogger("dilocox.elastic")

INSTALL = "pip install torchft==0.2.0"

# The private names of torchft that dilocox touches (issue 25 item 3: the Manager internals ``failover.py``'s quorum
# guard and failover use). They are those of the torchft release below; ``check_torchft_version`` refuses another
# at the start of an elastic run, and tests/test_elastic.py checks that a real torchft Manager (not a fake) has
# every one of them, so an upgrade that renames one fails there rather than in a run.
TORCHFT_TESTED = "0.2."
MANAGER_PRIVATE = ("_quorum_future", "_client", "_quorum_id", "_commit_failures", "_errored", "_healing")
CLIENT_PRIVATE = ("_quorum",)  # of ``Manager._client`` (torchft's Rust ManagerClient)


def check_torchft_version(version: str | None = None) -> str:
    """The installed torchft's version (``version`` overrides it, for tests); ImportError naming the fix when it is
    not the release whose Manager internals dilocox uses."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("torchft")
        except PackageNotFoundError as e:
            raise ImportError(f"the elastic mode needs torchft: {INSTALL}") from e
    if not version.startswith(TORCHFT_TESTED):
        raise ImportError(
            f"torchft {version} is not supported: dilocox's elastic mode uses torchft {TORCHFT_TESTED}x's Manager "
            f"internals ({', '.join(MANAGER_PRIVATE)}); {INSTALL}"
        )
    return version


def quorum_id(manager: Any) -> int:
    """The id of ``manager``'s current quorum (-1 before the first; torchft keeps it private)."""
    return int(manager._quorum_id)


def manager_classes() -> tuple[Any, Any]:
    """torchft's ``Manager`` and ``ProcessGroupGloo`` (an elastic replica's manager and its reconfigurable group)."""
    check_torchft_version()
    from torchft import Manager, ProcessGroupGloo

    return Manager, ProcessGroupGloo


def manager_module() -> ModuleType:
    """``torchft.manager``: ``stores.py`` swaps its ``ManagerServer`` / ``ManagerClient`` (the guarded store and
    manager) while a Manager is built or a guard is open."""
    check_torchft_version()
    import torchft.manager as tm

    return tm


def process_group_parts() -> tuple[Any, Any, Any]:
    """``(ProcessGroup, create_store_client, _DummyWork)`` of torchft: what ``mesh.py``'s process group is made of."""
    check_torchft_version()
    from torchft.process_group import ProcessGroup, create_store_client
    from torchft.work import _DummyWork

    return ProcessGroup, create_store_client, _DummyWork


def lighthouse_server_class() -> Any:
    """torchft's ``LighthouseServer`` (``torchft.coordination``: a lighthouse in this process)."""
    check_torchft_version()
    from torchft.coordination import LighthouseServer

    return LighthouseServer


def native_lighthouse_server_class() -> Any:
    """torchft's ``LighthouseServer`` from its native extension, without importing ``torchft`` (and so torch).

    Lazy on purpose and loaded by path: ``import torchft`` imports torch first, which made a restarted lighthouse
    take seconds to listen; the Rust extension itself needs neither. Falls back to the normal import.
    """
    spec = importlib.util.find_spec("torchft")  # locates the package without running its __init__
    if spec is None or spec.origin is None:
        raise ImportError(f"the lighthouse needs torchft: {INSTALL}")
    pkg = os.path.dirname(spec.origin)
    libs = [f for f in os.listdir(pkg) if f.startswith("_torchft.") and f.endswith((".so", ".pyd"))]
    try:
        path = os.path.join(pkg, libs[0])
        loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", path)
        spec = importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        return mod.LighthouseServer
    except (IndexError, ImportError, OSError) as e:
        log.warning("loading torchft's extension directly failed (%s); importing torchft", e)
        from torchft._torchft import LighthouseServer

        return LighthouseServer
