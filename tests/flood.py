"""A stranger's flood for the lock-out tests (issue 42): silent connections and garbage answers to the challenge."""

from __future__ import annotations

import socket


def silent(src: str, host: str, port: int) -> socket.socket | None:
    """A connection from ``src`` to ``host:port`` opened without waiting and never written to (None: not opened)."""
    s = socket.socket()
    s.setblocking(False)
    try:
        s.bind((src, 0))
        s.connect_ex((host, port))
    except OSError:
        s.close()
        return None
    return s


def garbage_answer(src: str, host: str, port: int, payload: bytes) -> None:
    """Connect from ``src``, and answer a dilocox challenge (``DXA1``) with ``payload``; bounded by 0.2 s per call."""
    s = socket.socket()
    s.settimeout(0.2)
    try:
        s.bind((src, 0))
        s.connect((host, port))
        if s.recv(36)[:4] == b"DXA1":
            s.sendall(payload)
    except OSError:
        pass
    s.close()
