"""A secret holder's handshake time while one other address floods a guarded server (issue 42, docs/SECURITY.md).

    python -m tools.flood_probe [--kind rpc|state|guard|mesh] [--n 300]

Starts the server (the victim) in a subprocess on 127.0.0.1, times a secret holder's handshake from 127.0.0.1 while
quiet, then opens ``--n`` silent connections from 127.0.0.2 (both loopback) and times it again. Every wait is
bounded (the victim's start 60 s, each flood connect 0.2 s, the handshake 30 s).
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import subprocess
import sys
import time

SECRET = bytes(range(32))
SERVICE = {"rpc": "swarm-rpc", "state": "state", "guard": "lighthouse", "mesh": "mesh"}
VICTIM = r"""
import socket, sys
kind, S = sys.argv[1], bytes(range(32))
if kind == "rpc":
    from dilocox.net.rpc import RpcServer
    srv = RpcServer(lambda m, meta, t: ({}, {}), host="127.0.0.1", secret=S); port = int(srv.addr.rsplit(":", 1)[1])
elif kind == "state":
    from dilocox.net.transfer import StateTransport
    srv = StateTransport("127.0.0.1", 5.0, S); port = int(srv.metadata().rsplit(":", 1)[1])
elif kind == "guard":
    from dilocox.net.relay import LighthouseGuard
    up = socket.create_server(("127.0.0.1", 0))
    srv = LighthouseGuard(("127.0.0.1", 0), up.getsockname(), S, "lighthouse"); port = srv.port
else:
    from dilocox.net.mesh import PairServer
    srv = PairServer("127.0.0.1", S, False); port = int(srv.addr.rsplit(":", 1)[1])
print(port, flush=True)
sys.stdin.read()
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.flood_probe", description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=sorted(SERVICE), default="rpc")
    p.add_argument("--n", type=int, default=300, help="silent connections from 127.0.0.2")
    a = p.parse_args(argv)
    from dilocox.net.secure import dial

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, a.kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=env)  # fmt: skip
    flood: list[socket.socket] = []
    try:
        if not select.select([victim.stdout], [], [], 60)[0]:
            print("the victim did not start within 60 s", file=sys.stderr)
            return 1
        port = int(victim.stdout.readline())

        def honest() -> str:
            t0 = time.monotonic()
            try:
                s, _, _ = dial(("127.0.0.1", port), SECRET, SERVICE[a.kind], time.monotonic() + 30)
                s.close()
                return f"{time.monotonic() - t0:.3f} s"
            except (OSError, ConnectionError) as e:
                return f"failed after {time.monotonic() - t0:.1f} s ({type(e).__name__})"

        quiet = honest()
        for _ in range(a.n):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.settimeout(0.2)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                pass  # (a full listen backlog: the SYN waits)
            flood.append(s)
        print(f"{a.kind}: a secret holder's handshake: quiet {quiet}; under {a.n} silent connections from 127.0.0.2: "
              f"{honest()}")  # fmt: skip
        return 0
    finally:
        for s in flood:
            s.close()
        victim.stdin.close()
        try:
            victim.wait(10)
        except subprocess.TimeoutExpired:
            victim.kill()
            victim.wait(10)


if __name__ == "__main__":
    sys.exit(main())
