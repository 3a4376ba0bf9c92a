"""A torch ``TCPStore`` master that listens on 127.0.0.1 only (issue 21, docs/SECURITY.md).

torch's store authenticates nobody, and its master listens on every interface whatever host it is given
(``TCPStore("127.0.0.1", 0, is_master=True)`` listens on ``*``): ``loopback_store`` binds the listening socket to
127.0.0.1 itself and hands it to torch (``master_listen_fd``), so the store is reachable from this host only. An
elastic replica's store (``elastic/stores.py``: behind a ``LighthouseGuard`` for the other hosts) and the one-host
``dilocox train --nproc`` stores of torchrun (``launch/local_run.py``) are made here.
"""

from __future__ import annotations

import socket
from datetime import timedelta


def loopback_store(timeout: timedelta | None = None, port: int = 0, **kwargs):
    """A ``TCPStore`` master that listens on 127.0.0.1:``port`` (0: any) only (the module docstring); ``.port`` is its
    port. ``kwargs``: more ``TCPStore`` arguments (torchrun's stores: dilocox/launch/local_run.py)."""
    from torch.distributed import TCPStore

    if timeout is not None:
        kwargs["timeout"] = timeout
    kwargs.setdefault("wait_for_workers", False)
    sock = socket.create_server(("127.0.0.1", port), backlog=128)
    try:
        store = TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, master_listen_fd=sock.fileno(), **kwargs)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening socket now
    return store
