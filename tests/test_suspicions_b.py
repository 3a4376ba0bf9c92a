"""Three suspicions of a review, each reproduced and fixed (every wait here is bounded by a socket timeout or a join).

1. The relayed pairs (``LighthouseRelay``, ``LighthouseGuard``) and the RPC's connections had no TCP keepalive: a peer
   that vanished without a FIN or an RST held an idle pair (its threads, its sockets) for good.
2. A ``Thread.start`` that failed (``RuntimeError: can't start new thread``) in the relay's accept loop ended the loop
   for good and left the pair open; in the guard's pipe it left the pair open and unread (the relay's client waited
   for ever). ``AcceptGate.hand_off`` (the guard's, the mesh's accept loops) and the RPC's loop already coped.
3. ``model.linear_backend=fp8`` emulated the fp8 GEMM silently where ``torch._scaled_mm`` cannot run (a CPU, a GPU
   before Ada/Hopper): now a warning says so, once per reason.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time

import pytest
import torch

SECRET = b"k" * 32
T = 5.0  # every socket wait of these tests


def _port(relay) -> int:
    return int(relay.address.rsplit(":", 1)[1])


def _wait(cond, within: float = T) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _relayed(port: int, up: socket.socket, data: bytes = b"hi") -> tuple[socket.socket, socket.socket]:
    """A client connection to the relay on ``port`` whose ``data`` arrived at the upstream server ``up``."""
    c = socket.create_connection(("127.0.0.1", port), timeout=T)
    c.sendall(data)
    s, _ = up.accept()
    s.settimeout(T)
    assert s.recv(len(data)) == data
    return c, s


def _upstream() -> socket.socket:
    up = socket.create_server(("127.0.0.1", 0))
    up.settimeout(T)
    return up


# ----------------------------------------------------------------------------------------------- 1. keepalive
def _assert_keepalive(socks: list[socket.socket]) -> None:
    assert socks
    for s in socks:
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1, s
    if sys.platform.startswith("linux"):
        from dilocox.net import tcp

        for s in socks:
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == tcp.IDLE_S
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == tcp.INTERVAL_S
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == tcp.COUNT


def test_both_sockets_of_a_relayed_pair_have_tcp_keepalive_at_the_relay_and_at_the_guard():
    from dilocox.net.relay import LighthouseGuard, LighthouseRelay

    up = _upstream()
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", up.getsockname()[1]), SECRET, "store")
    relay = LighthouseRelay([("127.0.0.1", guard.port)], secret=SECRET, service="store")
    plain = LighthouseRelay([("127.0.0.1", up.getsockname()[1])])  # (no secret: a loopback relay of a plain port)
    try:
        c, s = _relayed(_port(relay), up)
        c2, s2 = _relayed(_port(plain), up)
        assert _wait(lambda: len(guard._piped) == 2)
        with relay._lock, plain._lock:
            pairs = [x for _, a, b in relay._pairs + plain._pairs for x in (a, b)]
        assert len(pairs) == 4
        _assert_keepalive(pairs + list(guard._piped))
    finally:
        relay.close()
        plain.close()
        guard.close()
        up.close()


def test_the_rpc_servers_and_the_callers_connections_have_tcp_keepalive():
    from dilocox.net import client
    from dilocox.net.rpc import RpcServer

    server = RpcServer(lambda method, meta, tensors: ({"echo": meta["x"]}, {}), secret=SECRET)
    try:
        meta, _ = client.call(server.addr, "echo", {"x": 1}, timeout_s=T, secret=SECRET)
        assert meta == {"echo": 1}
        with server._lock:
            served = list(server._conns)
        port = int(server.addr.rsplit(":", 1)[1])
        with client.POOL._lock:
            kept = [c.sock for cs in client.POOL._idle.values() for c in cs if c.sock.getpeername()[1] == port]
        assert len(served) == 1 and len(kept) == 1
        _assert_keepalive(served + kept)
    finally:
        client.POOL.close_all()
        server.close()


# ------------------------------------------------------------------------------ 2. Thread.start failing once
def _fail_start_once(monkeypatch, match) -> dict:
    """``threading.Thread.start`` raises ``RuntimeError("can't start new thread")`` once, for the first thread for
    which ``match(thread)`` holds; every other thread starts as usual."""
    real, fired = threading.Thread.start, {"n": 0}

    def start(self):
        if not fired["n"] and match(self):
            fired["n"] += 1
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return fired


def _target_name(t: threading.Thread) -> str:
    return getattr(getattr(t, "_target", None), "__qualname__", "")


def _closed(sock: socket.socket) -> bool:
    """The peer ended the connection (EOF or a reset) within the test's bound; False if it stayed open."""
    sock.settimeout(T)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except (socket.timeout, TimeoutError):
        return False


def test_a_relay_whose_pump_thread_cannot_start_closes_that_pair_and_goes_on_accepting(monkeypatch):
    """Before: the RuntimeError left the accept loop (no connection was relayed again) and the pair stayed open."""
    from dilocox.net.relay import LighthouseRelay

    up = _upstream()
    relay = LighthouseRelay([("127.0.0.1", up.getsockname()[1])])
    fired = _fail_start_once(monkeypatch, lambda t: _target_name(t).endswith("LighthouseRelay._pump"))
    try:
        c = socket.create_connection(("127.0.0.1", _port(relay)), timeout=T)
        c.sendall(b"hi")
        s, _ = up.accept()  # (the relay connected upstream for it, then found no thread to pump with)
        assert _closed(c) and _closed(s)  # both sides of the pair closed
        assert fired["n"] == 1
        assert _wait(lambda: not relay._pairs)
        c2, s2 = _relayed(_port(relay), up, b"again")  # the accept loop goes on
        s2.sendall(b"back")
        c2.settimeout(T)
        assert c2.recv(4) == b"back"
    finally:
        relay.close()
        up.close()


def test_a_guard_whose_pipe_thread_cannot_start_closes_the_pair_and_serves_the_next(monkeypatch):
    """Before: the pair stayed open and unread (in ``_piped``): the relay's client waited for ever for an answer."""
    from dilocox.net.relay import LighthouseGuard, LighthouseRelay

    up = _upstream()
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", up.getsockname()[1]), SECRET, "store")
    relay = LighthouseRelay([("127.0.0.1", guard.port)], secret=SECRET, service="store")
    fired = _fail_start_once(monkeypatch, lambda t: "LighthouseGuard._pipe" in _target_name(t))
    try:
        c = socket.create_connection(("127.0.0.1", _port(relay)), timeout=T)
        c.sendall(b"hi")
        assert _closed(c)  # the relay's client sees its pair end
        assert fired["n"] == 1
        s, _ = up.accept()  # (the guard had connected upstream for it: closed too)
        assert _closed(s)
        assert _wait(lambda: not guard._piped and not relay._pairs)
        assert guard.gate.held() == 0
        c2, s2 = _relayed(_port(relay), up, b"again")
        s2.sendall(b"back")
        c2.settimeout(T)
        assert c2.recv(4) == b"back"
    finally:
        relay.close()
        guard.close()
        up.close()


def test_a_guard_whose_handshake_thread_cannot_start_frees_the_slot_and_goes_on(monkeypatch):
    """(Already so before: ``AcceptGate.hand_off`` gives the slot back and closes the connection.)"""
    from dilocox.net.relay import LighthouseGuard

    up = _upstream()
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", up.getsockname()[1]), SECRET, "store")
    fired = _fail_start_once(monkeypatch, lambda t: t.name == "store guard")
    try:
        c = socket.create_connection(("127.0.0.1", guard.port), timeout=T)
        assert _closed(c)
        assert fired["n"] == 1 and guard.gate.held() == 0
        from dilocox.net.secure import dial

        s, _, _ = dial(("127.0.0.1", guard.port), SECRET, "store", time.monotonic() + T)
        s.close()
    finally:
        guard.close()
        up.close()


# ------------------------------------------------------------------------------------- 3. fp8 emulation told
@pytest.fixture
def fresh_fp8(monkeypatch, caplog):
    from dilocox.model import fp8

    monkeypatch.setattr(fp8, "_TOLD", set(), raising=False)
    caplog.set_level(logging.WARNING, logger="dilocox.model.fp8")
    return fp8


def _told(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dilocox.model.fp8"]


def test_fp8_on_a_cpu_says_once_that_it_emulates_and_why(fresh_fp8, caplog):
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    y = fresh_fp8.fp8_linear(x, w)
    fresh_fp8.fp8_linear(x, w)
    told = _told(caplog)
    assert len(told) == 1, told
    assert "model.linear_backend=fp8" in told[0] and "runs on cpu" in told[0] and "emulating" in told[0]
    ref = fresh_fp8.quantize_dequantize(x) @ fresh_fp8.quantize_dequantize(w).t()
    assert torch.allclose(y, ref)  # (the emulation's numerics, unchanged)
    fresh_fp8.fp8_linear(x, w, emulate=True)  # asked for the emulation: nothing to tell
    assert len(_told(caplog)) == 1


def test_an_fp8_model_built_on_a_cpu_says_so_at_its_build(fresh_fp8, caplog):
    from dilocox.config.sections import ModelConfig
    from dilocox.model.transformer import build_model

    mcfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, linear_backend="fp8")
    build_model(mcfg, device="meta")
    assert _told(caplog) == []  # (the meta device runs no GEMM)
    build_model(mcfg)
    told = _told(caplog)
    assert len(told) == 1 and "runs on cpu" in told[0]


def test_the_reason_names_an_old_gpu_a_torch_without_scaled_mm_and_a_shape(fresh_fp8, monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    why = fresh_fp8.emulation_reason(cuda)
    assert "A100" in why and "compute capability 8.0" in why
    assert not fresh_fp8.fp8_supported(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fresh_fp8.emulation_reason(cuda) is None and fresh_fp8.fp8_supported(cuda)
    assert "24x32 weight" in fresh_fp8.emulation_reason(cuda, (24, 32))
    monkeypatch.delattr(torch, "_scaled_mm", raising=False)
    assert "no torch._scaled_mm" in fresh_fp8.emulation_reason(cuda)


def test_fp8_linear_traces_into_one_graph_without_logging(fresh_fp8):
    """The warning is not logged inside a torch.compile graph (a logging call there breaks ``fullgraph=True``)."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: fresh_fp8.fp8_linear(x, w), backend="eager", fullgraph=True)
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    assert torch.allclose(f(x, w), fresh_fp8.fp8_linear(x, w, emulate=True))
