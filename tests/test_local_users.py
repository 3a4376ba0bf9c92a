"""Issue 42 item 3 (the part built): a loopback relay that proves the run secret serves only this user's processes.

Another user of the host (here ``nobody``, uid 65534, with the system's python) connecting to a replica's local
``LighthouseRelay`` is closed before anything is relayed (before, it got the run's powers: the relay proved the secret
for it, e.g. to read the guarded lighthouse's status). Needs root (to run a process as another user) and Linux.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from dilocox.net.relay import LighthouseGuard, LighthouseRelay
from dilocox.net.secure import peer_uid, same_user

SECRET = b"u" * 32
OTHER_PY = "/usr/bin/python3"  # (readable by every user, unlike a python under /root)
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.getuid() != 0 or not os.access(OTHER_PY, os.X_OK),
    reason="needs Linux, root (to act as another user) and /usr/bin/python3",
)

ASK = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.settimeout(10)
s.sendall(b"hi")
try:
    got = s.recv(64)
except OSError as e:
    got = b"error:" + type(e).__name__.encode()
print(repr(got))
"""


def _ask_as(uid: int | None, port: int) -> str:
    p = subprocess.run([OTHER_PY, "-c", ASK, str(port)], capture_output=True, text=True, timeout=60, user=uid)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_peer_uid_names_the_owner_of_a_loopback_connection():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        mine = socket.create_connection(("127.0.0.1", port))
        a, _ = srv.accept()
        assert peer_uid(a) == os.getuid() and same_user(a)
        a.close()
        mine.close()
        code = f"import socket,time;s=socket.create_connection(('127.0.0.1',{port}));time.sleep(5)"
        other = subprocess.Popen([OTHER_PY, "-c", code], user=65534)
        try:
            srv.settimeout(30)
            b, _ = srv.accept()
            assert peer_uid(b) == 65534 and not same_user(b)
            b.close()
        finally:
            other.kill()
            other.wait(10)


def test_another_local_user_gets_nothing_through_a_relay_that_proves_the_secret():
    reached = bytearray()
    inner = socket.create_server(("127.0.0.1", 0))
    inner.settimeout(0.5)
    stop = threading.Event()

    def lighthouse():  # a stand-in lighthouse: answers "L:" + what it got
        while not stop.is_set():
            try:
                c, _ = inner.accept()
            except OSError:
                continue
            with c:
                c.settimeout(5)
                try:
                    data = c.recv(64)
                    reached.extend(data)
                    c.sendall(b"L:" + data)
                except OSError:
                    pass

    t = threading.Thread(target=lighthouse, daemon=True)
    t.start()
    guard = LighthouseGuard(("127.0.0.1", 0), inner.getsockname(), SECRET, "lighthouse")
    relay = LighthouseRelay([("127.0.0.1", guard.port)], secret=SECRET, service="lighthouse")
    port = int(relay.address.rsplit(":", 1)[1])
    try:
        t0 = time.monotonic()
        assert _ask_as(65534, port) == "b''"  # closed at once, nothing relayed
        assert time.monotonic() - t0 < 30 and not reached and relay.used == []
        assert _ask_as(None, port) == "b'L:hi'"  # this user: relayed to the lighthouse through the guard
        assert bytes(reached) == b"hi" and relay.used == [0]
    finally:
        stop.set()
        relay.close()
        guard.close()
        inner.close()
        t.join(5)
