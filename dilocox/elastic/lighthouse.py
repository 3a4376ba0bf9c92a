"""``dilocox lighthouse``: a torchft lighthouse in the foreground until SIGINT/SIGTERM.

(``dilocox launch --elastic`` starts this command as a child process: ``dilocox.elastic.supervisor``.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Iterator, Sequence

from dilocox.net.secure import HANDSHAKE_S


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dilocox lighthouse", description=lighthouse_main.__doc__)
    p.add_argument("--min-replicas", type=int, required=True, help="fewest replicas a quorum may have")
    p.add_argument("--bind", default="0.0.0.0:0", help="HOST:PORT to listen on (port 0: any free port)")
    p.add_argument(
        "--heartbeat-timeout-ms", type=int, default=2000, help="a replica silent this long is dropped (detection)"
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="how long a quorum waits for live stragglers; keep it above the replicas' phase-time skew",
    )
    p.add_argument(
        "--secret-file",
        default="",
        help="the run secret: torchft listens on loopback only and every connection to --bind must prove the secret "
        "first (the replicas' outer.elastic.lighthouse_auth, on wherever security.authenticate is; docs/SECURITY.md)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve plain gRPC on a --bind other hosts can reach, without --secret-file: whoever reaches it can join "
        "the quorum or kill a replica (a closed network only; the replicas need outer.elastic.lighthouse_auth=false)",
    )
    p.add_argument(
        "--handshake-s",
        type=float,
        default=HANDSHAKE_S,
        help="with --secret-file: the guard ends its handshake with a connection within this many seconds (the "
        "replicas' security.handshake_s; at most 30)",
    )
    return p


def lighthouse_main(argv: Sequence[str] | None = None) -> int:
    """``dilocox lighthouse``: a torchft lighthouse in the foreground until SIGINT/SIGTERM (exit 0).

    The first line of stdout is ``dilocox lighthouse: http://HOST:PORT ...``: the address to give the replicas
    as ``--outer.elastic.lighthouse`` (HOST is the bind host, or this machine's name when bound to all)."""
    p = _parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.min_replicas < 1:
        p.error(f"--min-replicas {a.min_replicas} must be >= 1")
    for name in ("heartbeat_timeout_ms", "join_timeout_ms"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1 (milliseconds)")
    from dilocox.net.secure import set_handshake_s

    try:
        set_handshake_s(a.handshake_s, "--handshake-s")
    except ValueError as e:
        p.error(str(e))
    host, sep, port = a.bind.rpartition(":")
    if not sep or not host or not port.isdigit():
        p.error(f"--bind {a.bind!r} is not HOST:PORT (e.g. 0.0.0.0:29510, [::]:0)")
    from dilocox.elastic.stores import _is_loopback

    if not a.secret_file and not a.insecure and not _is_loopback(host.strip("[]")):
        print(
            f"dilocox lighthouse: --bind {a.bind} is reachable from other hosts and has no --secret-file: pass "
            "--secret-file RUN_SECRET (the replicas' security.secret_file), bind 127.0.0.1, or --insecure on a closed "
            "network",
            file=sys.stderr,
        )
        return 2
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        got.append(signum)
        stop.set()

    prev = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        from dilocox.elastic import start_lighthouse

        try:
            lh = start_lighthouse(
                a.min_replicas,
                bind=a.bind,
                heartbeat_timeout_ms=a.heartbeat_timeout_ms,
                join_timeout_ms=a.join_timeout_ms,
                secret=_secret(a.secret_file),  # the public port is then a guard's; torchft's is on loopback
            )
        except ImportError as e:
            print(f"dilocox lighthouse: needs torchft: pip install torchft==0.2.0 ({e})", file=sys.stderr)
            return 2
        except ValueError as e:  # the secret file: one line naming it and the fix
            print(f"dilocox lighthouse: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001 - e.g. the port is taken: one line naming the bind address
            print(f"dilocox lighthouse: cannot listen on {a.bind}: {e}", file=sys.stderr)
            return 1
        real_port = lh.address().rsplit(":", 1)[1]
        shown = lh.address() if host in ("0.0.0.0", "[::]", "::") else f"http://{host}:{real_port}"
        print(
            f"dilocox lighthouse: {shown} (min_replicas={a.min_replicas}, heartbeat_timeout_ms="
            f"{a.heartbeat_timeout_ms}, join_timeout_ms={a.join_timeout_ms}); stop with Ctrl-C or SIGTERM",
            flush=True,
        )
        try:
            while not stop.wait(0.5):
                pass
        finally:
            lh.shutdown()
        name = signal.Signals(got[0]).name if got else "?"
        print(f"dilocox lighthouse: stopped ({name})", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)


def _secret(path: str) -> bytes | None:
    if not path:
        return None
    from dilocox.net.secure import load_secret

    return load_secret(path)


@contextlib.contextmanager
def quiet_rust_log(level: str = "warn") -> Iterator[None]:
    """torchft's Rust logger at ``level`` for a lighthouse started inside (unless the user set ``RUST_LOG``). That
    logger reads ``RUST_LOG`` once per process, when the first lighthouse starts; at its default a lighthouse in a
    job's own process (``dilocox swarm``) writes several INFO lines per quorum onto the user's console (~800 in
    35 s of a 2 x 2 job). The variable is put back after, so the peers the job starts keep their own default."""
    if "RUST_LOG" in os.environ:
        yield
        return
    os.environ["RUST_LOG"] = level
    try:
        yield
    finally:
        os.environ.pop("RUST_LOG", None)


def start_lighthouse(
    min_replicas: int,
    bind: str = "[::]:0",
    join_timeout_ms: int = 60000,
    quorum_tick_ms: int = 20,
    heartbeat_timeout_ms: int = 2000,
    secret: bytes | None = None,
):
    """Start a torchft lighthouse in this process; returns the server (``.address()``, ``.shutdown()``).

    ``heartbeat_timeout_ms`` is how long a silent replica stays in the membership: it bounds
    the detection time of a ``kill -9``'d replica. ``join_timeout_ms`` is how long the
    lighthouse waits for live (still heartbeating) stragglers once ``min_replicas`` have joined;
    keep it above the replicas' phase-time skew, or a slow but live replica is left out of the
    step and falls behind for good (torchft's default is 60 s). A dead replica is dropped after
    ``heartbeat_timeout_ms`` whatever ``join_timeout_ms`` is (docs/ELASTIC.md).
    ``secret``: torchft listens on 127.0.0.1 only and a ``LighthouseGuard`` holds ``bind``: only a client that
    proves the run secret (a ``LighthouseRelay`` with it: ``ElasticConfig.lighthouse_auth``) reaches it.
    """
    from dilocox.elastic.torchft import lighthouse_server_class  # (torchft is optional: imported there, lazily)

    lh = lighthouse_server_class()(
        bind="127.0.0.1:0" if secret else bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    if not secret:
        return lh
    from dilocox.net.relay import GuardedLighthouse

    return GuardedLighthouse(lh, bind, secret)
