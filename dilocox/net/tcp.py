"""TCP keepalive on the run's long-lived connections (one helper for every one of them).

A relayed pair (``relay.py``: ``LighthouseRelay`` and ``LighthouseGuard``) idles between gRPC's or a store client's
requests, with no timeout on its reads: a peer that vanished without a FIN or an RST (a host powered off, a cable
pulled, a NAT that dropped the mapping) would hold the pair, its two threads and its sockets for good. With
``SO_KEEPALIVE`` the kernel probes an idle connection after ``IDLE_S`` seconds, every ``INTERVAL_S`` seconds, and ends
it after ``COUNT`` unanswered probes (about ``IDLE_S + INTERVAL_S * COUNT`` = 2 min): the blocked read then fails and
the pair is closed as if the peer had closed it. A live peer's kernel answers the probes, however long the pair
idles. The RPC's, the mesh's and ``secure.dial``'s connections get the same (``keep_alive``). Where the system has no
``TCP_KEEPIDLE`` (``TCP_KEEPALIVE`` on macOS) / ``TCP_KEEPINTVL`` / ``TCP_KEEPCNT``, only ``SO_KEEPALIVE`` is set (the
system's own timings, 2 h on most).
"""

from __future__ import annotations

import socket

IDLE_S = 60  # an idle connection's first probe
INTERVAL_S = 10  # between unanswered probes
COUNT = 6  # unanswered probes that end the connection

_IDLE_OPT = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)  # (Linux; macOS)
_TIMINGS = (
    (_IDLE_OPT, IDLE_S),
    (getattr(socket, "TCP_KEEPINTVL", None), INTERVAL_S),
    (getattr(socket, "TCP_KEEPCNT", None), COUNT),
)


def keep_alive(sock: socket.socket) -> socket.socket:
    """Turn on TCP keepalive on ``sock`` with this module's timings (the module docstring); returns ``sock``. A socket
    that is not TCP, or already closed, is left as it is (no error: the caller's next read or write tells)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    except OSError:
        return sock
    for opt, value in _TIMINGS:
        if opt is None:
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        except OSError:  # (a system that refuses one of them: the others, and the system's default, still apply)
            pass
    return sock
