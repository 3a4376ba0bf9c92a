"""A joiner's state transfer (dilocox/net/transfer.py, issue 21 item 2): nothing unpickled, lengths bounded,
both sides authenticated. torchft's own HTTPTransport is the reproduction: a rogue source runs code in the joiner.
"""

from __future__ import annotations

import http.server
import io
import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

from dilocox.net.rpc import PeerUnavailable, ProtocolError, RpcServer, encode
from dilocox.net.secure import AuthError
from dilocox.net.transfer import (
    StateFormatError,
    StateTransport,
    flatten,
    parse_metadata,
    unflatten,
)

T = timedelta(seconds=5)


def _state() -> dict:
    """A state like the ones dilocox sends: θ, momentum, ints, a nested AdamW state dict (int keys, tuples)."""
    p = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(p.parameters(), lr=1e-3, betas=(0.9, 0.95))
    p(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "user": {
            "dilocox": {
                "valid": True,
                "n": 8,
                "theta": torch.randn(15),
                "momentum": torch.randn(15).to(torch.bfloat16),
                "schedule": {"phase": [0, 1.5, None], "frag": (2, "x")},
                "extra": opt.state_dict(),
            }
        },
        "torchft": {"step": 3, "batches_committed": 6},
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_flatten_round_trip_keeps_types_and_values():
    sd = _state()
    skel, tensors = flatten(sd)
    back = unflatten(skel, {str(i): t for i, t in enumerate(tensors)})
    assert _equal(sd, back)
    assert (
        isinstance(back["user"]["dilocox"]["extra"]["state"], dict) and 0 in back["user"]["dilocox"]["extra"]["state"]
    )
    # a loaded optimizer state works
    opt = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    opt.load_state_dict(back["user"]["dilocox"]["extra"])


def test_flatten_refuses_objects_it_cannot_send():
    with pytest.raises(StateFormatError, match=r"state\.f: a function cannot be sent"):
        flatten({"f": lambda: 0})
    with pytest.raises(StateFormatError, match="a set cannot be sent"):
        flatten({"s": {1, 2}})
    with pytest.raises(StateFormatError, match="complex64 tensor cannot be sent"):  # (the receiver would refuse it)
        flatten({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(StateFormatError, match="mapping key"):
        flatten({(1, 2): 3})


def test_a_state_that_cannot_be_sent_fails_the_joiner_not_the_source():
    """send_checkpoint runs on the LIVE replica's quorum thread: it must not raise there (torchft would fail that
    replica's step); the joiner's fetch fails with the reason instead."""
    from dilocox.net.rpc import RemoteError

    src, dst = _pair()
    try:
        src.send_checkpoint([1], 1, {"x": {1, 2}}, T)  # does not raise
        with pytest.raises(RemoteError, match="a set cannot be sent"):
            dst.recv_checkpoint(0, src.metadata(), 1, T)
        src.disallow_checkpoint()
        src.send_checkpoint([1], 2, {"x": torch.ones(2)}, T)  # the next offer is served again
        assert torch.equal(dst.recv_checkpoint(0, src.metadata(), 2, T)["x"], torch.ones(2))
    finally:
        src.shutdown()
        dst.shutdown()


def test_a_host_of_another_machine_binds_every_interface_and_advertises_this_one():
    """A rank on node 2 of a multi-node replica is given the replica's MASTER_ADDR (node 1): it must still start."""
    import socket as so

    t = StateTransport("192.0.2.10", 5.0, None)  # (TEST-NET-1: never an address of this machine)
    try:
        assert t.metadata().startswith(f"dxstate:{so.gethostname()}:")
    finally:
        t.shutdown()


@pytest.mark.parametrize(
    "skel,tensors,why",
    [
        ({"x": 1}, {}, "unknown kind"),
        ({"T": 0}, {}, "lacks"),
        ({"l": [{"T": 0}, {"T": 0}]}, {"0": torch.zeros(1)}, "lacks"),  # one tensor used twice
        ({"v": [1, 2]}, {}, "not a number"),
        ({"v": 1}, {"0": torch.zeros(1)}, "not in its skeleton"),
        ({"m": [[{"l": []}, {"v": 1}]]}, {}, "not a plain value"),
        ({"m": [[{"v": 1}]]}, {}, "not \\[key, value\\]"),
        ({"d": {"a": 1}}, {}, "one-key object"),
        ({"T": "0"}, {"0": torch.zeros(1)}, "lacks"),
    ],
)
def test_unflatten_rejects_malformed_skeletons(skel, tensors, why):
    with pytest.raises(StateFormatError, match=why):
        unflatten(skel, tensors)


def test_unflatten_bounds_depth():
    node = {"v": 1}
    for _ in range(40):
        node = {"l": [node]}
    with pytest.raises(StateFormatError, match="nested more than"):
        unflatten(node, {})


def _pair(secret_a=None, secret_b=None, max_bytes=1 << 20):
    return StateTransport("127.0.0.1", 5.0, secret_a, max_bytes), StateTransport("127.0.0.1", 5.0, secret_b, max_bytes)


def test_transport_serves_the_step_asked_for_with_a_secret():
    key = os.urandom(32)
    src, dst = _pair(key, key)
    try:
        sd = _state()
        # a request that arrives before the source offers its state waits for it (bounded)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("sd", dst.recv_checkpoint(0, src.metadata(), 4, T)))
        t.start()
        threading.Event().wait(0.2)
        src.send_checkpoint([1], 4, sd, T)
        t.join(10)
        assert _equal(sd, out["sd"]) and src.served == 1
        # torchft's disallow_checkpoint: nothing is served from then on (the state may change)
        src.disallow_checkpoint()
        src._timeout_s = 0.3  # (how long a request waits for the state to be offered again)
        with pytest.raises(PeerUnavailable, match="not serving"):
            dst.recv_checkpoint(0, src.metadata(), 4, timedelta(seconds=10))
    finally:
        src.shutdown()
        dst.shutdown()


def test_transport_wrong_step_and_wrong_secret_get_nothing():
    src, dst = _pair(os.urandom(32), os.urandom(32))
    src._timeout_s = 0.3  # (a request for another step waits this long before "not serving")
    try:
        src.send_checkpoint([1], 4, _state(), T)
        with pytest.raises((PeerUnavailable, AuthError)):  # another run's secret: refused both ways
            dst.recv_checkpoint(0, src.metadata(), 4, T)
        assert src.served == 0 and src._server.rejected["auth"] >= 1
        same = StateTransport("127.0.0.1", 5.0, src._secret)
        try:
            with pytest.raises(PeerUnavailable, match="serving step 4, asked for 5"):
                same.recv_checkpoint(0, src.metadata(), 5, T)
        finally:
            same.shutdown()
    finally:
        src.shutdown()
        dst.shutdown()


def test_transport_refuses_a_state_larger_than_the_run_can_need():
    """The receiver's bound (from its model) is checked against the header's claims before allocating."""
    src, dst = _pair(max_bytes=1000)
    try:
        src.send_checkpoint([1], 1, {"theta": torch.zeros(1000)}, T)  # 4000 bytes > 1000
        with pytest.raises(PeerUnavailable, match="limit 1000"):
            dst.recv_checkpoint(0, src.metadata(), 1, T)
    finally:
        src.shutdown()
        dst.shutdown()


class _Payload:
    """Unpickling this creates ``path``: the stand-in for code a rogue source runs in the joiner."""

    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rogue_http_server(payload: bytes):
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_rogue_source_runs_nothing(tmp_path):
    """The reproduction: torchft's HTTPTransport, fetching from a rogue source, runs its pickle. dilocox's
    transport refuses that source's address outright, and a rogue that speaks dilocox's protocol (holding the
    secret, or not) can only send tensors and plain values: the payload's bytes stay bytes."""
    marker = tmp_path / "pwned"
    _Payload.path = str(marker)
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed")
    from torchft.checkpointing._serialization import _streaming_save
    from torchft.checkpointing.http_transport import HTTPTransport

    buf = io.BytesIO()
    _streaming_save({"user": _Payload()}, buf)  # what torchft's HTTP checkpoint server sends
    srv = _rogue_http_server(buf.getvalue())
    url = f"http://127.0.0.1:{srv.server_address[1]}/checkpoint/"
    try:
        HTTPTransport._load_from_address(url + "1/full", T)
        assert marker.exists(), "the reproduction: torchft's transport ran the rogue source's pickle"
        marker.unlink()

        dst = StateTransport("127.0.0.1", 5.0, None)
        try:
            with pytest.raises(StateFormatError, match="not a dilocox state server"):
                dst.recv_checkpoint(0, url, 1, T)
            # a rogue server of the dilocox protocol: the pickle travels as a uint8 tensor and as a string value
            blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

            def rogue(method, meta, tensors):
                return {"step": 1, "skeleton": {"d": {"x": {"T": 0}, "s": {"v": buf.getvalue().hex()}}}}, {"0": blob}

            rs = RpcServer(rogue, secret=None)
            try:
                got = dst.recv_checkpoint(0, "dxstate:" + rs.addr, 1, T)
                assert torch.equal(got["x"], blob) and isinstance(got["s"], str)
            finally:
                rs.close()
        finally:
            dst.shutdown()
        assert not marker.exists()
    finally:
        srv.shutdown()


def test_metadata_must_be_a_dilocox_state_server():
    assert parse_metadata("dxstate:10.0.0.2:4000") == "10.0.0.2:4000"
    for bad in ("http://h:1/checkpoint/", "", "dxstat:h:1"):
        with pytest.raises(StateFormatError, match="not a dilocox state server"):
            parse_metadata(bad)


def test_encode_of_a_reply_is_what_the_limits_check():
    """The reply's tensors are counted on the wire: header claims == bytes sent (so the bound is the real size)."""
    skel, tensors = flatten({"a": torch.zeros(3, 5), "b": torch.ones(2, dtype=torch.bfloat16)})
    frames = encode("ok", {"step": 1, "skeleton": skel}, {str(i): t for i, t in enumerate(tensors)})
    assert sum(len(memoryview(f).cast("B")) for f in frames[2:]) == 3 * 5 * 4 + 2 * 2
    with pytest.raises(ProtocolError):
        from dilocox.net.rpc import Limits, _specs

        _specs({"method": "ok", "meta": {}, "tensors": [["0", "float32", [3, 5], 60]]}, Limits(max_message_bytes=59))


# ------------------------------------------------------------------------------------------- fuzz
def _random_node(rng, depth: int = 0):
    """A random skeleton node: mostly well-formed, often not (wrong kinds, types, tensor references)."""
    kind = rng.choice(["T", "v", "d", "m", "l", "t", "x", None, 3])
    if depth > rng.randrange(1, 6) or kind in ("T", "v"):
        return rng.choice(
            [{"T": rng.randrange(-1, 4)}, {"T": "0"}, {"v": rng.choice([1, 2.5, "s", None, True, [1], {"a": 1}])}]
        )
    if kind == "d":
        return {"d": {str(i): _random_node(rng, depth + 1) for i in range(rng.randrange(0, 4))}}
    if kind == "m":
        return {"m": [[_random_node(rng, depth + 1), _random_node(rng, depth + 1)] for _ in range(rng.randrange(3))]}
    if kind in ("l", "t"):
        return {kind: [_random_node(rng, depth + 1) for _ in range(rng.randrange(0, 4))]}
    return rng.choice([{kind: 1}, [], "x", 5, None, {"d": 1, "v": 2}])


def test_fuzz_a_rogue_state_source():
    """A source holding the secret answers each fetch with a random skeleton and random tensors (and, every
    tenth time, a step or a reply shape that is wrong). The joiner raises only the transfer's own errors, keeps
    nothing, and its memory stays flat. DILOCOX_FUZZ_N=10000 runs the issue's count."""
    import random

    from tests.test_security import SECRET, _rss_mb

    n = int(os.environ.get("DILOCOX_FUZZ_N", "1000"))
    rng = random.Random(7)

    def rogue(method, meta, tensors):
        k = rng.randrange(10)
        ts = {str(i): torch.randn(rng.randrange(0, 5)) for i in range(rng.randrange(0, 4))}
        if k == 0:
            return {"step": meta["step"] + 1, "skeleton": {"v": 1}}, {}
        if k == 1:
            return {"step": meta["step"]}, ts
        return {"step": meta["step"], "skeleton": _random_node(rng)}, ts

    rs = RpcServer(rogue, secret=SECRET, service="state")  # (a holder of the secret, serving as a state source)
    dst = StateTransport("127.0.0.1", 5.0, SECRET, max_state_bytes=1 << 16)
    crashes: list = []
    hook, threading.excepthook = threading.excepthook, lambda args: crashes.append(args.exc_value)
    before = _rss_mb()
    outcomes = {"ok": 0, "refused": 0}
    try:
        for i in range(n):
            try:
                got = dst.recv_checkpoint(0, "dxstate:" + rs.addr, i, T)
            except (StateFormatError, ProtocolError, PeerUnavailable):
                outcomes["refused"] += 1
                continue
            # what comes out is built of plain values and tensors only
            _, leaves = flatten(got)  # (raises for anything else)
            assert all(isinstance(t, torch.Tensor) for t in leaves)
            outcomes["ok"] += 1
        grown = _rss_mb() - before
        assert grown < 64, f"resident memory grew {grown:.0f} MiB"
        assert not crashes, crashes[:3]
        assert outcomes["refused"] > n // 4 and outcomes["ok"] > 0, outcomes  # both paths were exercised
    finally:
        threading.excepthook = hook
        rs.close()
        dst.shutdown()


def test_fuzz_the_state_server():
    """Random and mutated requests from a key holder (sealed, so the parser and the handler are fuzzed) and from a
    stranger: the server's threads never raise, it serves nothing to the stranger, and a genuine fetch works
    at the end."""
    import random

    from dilocox.net.secure import MAC_BYTES, Sealer, client_handshake
    from tests.test_security import SECRET, _closed, _mutations

    n = int(os.environ.get("DILOCOX_FUZZ_N", "1000"))
    src = StateTransport("127.0.0.1", 5.0, SECRET)
    src._timeout_s = 0.01  # (a request for a step not offered answers "not serving" at once)
    src.send_checkpoint([1], 3, _state(), T)
    rng = random.Random(5)
    good = b"".join(bytes(f) for f in encode("state", {"step": 3}))
    crashes: list = []
    hook, threading.excepthook = threading.excepthook, lambda args: crashes.append(args.exc_value)
    host, port = src._server.addr.rsplit(":", 1)
    try:
        for i in range(n):
            msg = _mutations(rng, good)
            s = socket.create_connection((host, int(port)), timeout=5)
            try:
                seal = Sealer(client_handshake(s, SECRET, time.monotonic() + 5, "state"), "client")
                if i % 2:
                    h = seal.sealer()
                    h.update(msg)
                    tag = h.digest()
                else:
                    tag = b"\0" * MAC_BYTES
                s.sendall(msg + tag)
                s.shutdown(socket.SHUT_WR)
                _closed(s, 2.0)
            except OSError:
                pass
            finally:
                s.close()
        assert not crashes, crashes[:3]
        assert src.served <= n // 2  # a stranger's (wrongly tagged) request never reaches the handler
        dst = StateTransport("127.0.0.1", 5.0, SECRET)
        try:
            assert _equal(_state()["torchft"], dst.recv_checkpoint(0, src.metadata(), 3, T)["torchft"])
        finally:
            dst.shutdown()
    finally:
        threading.excepthook = hook
        src.shutdown()


def test_transport_encrypted_round_trip_and_mismatch():
    """security.encrypt: the state crosses ChaCha20-Poly1305 sealed; a receiver without encryption is refused."""
    key = os.urandom(32)
    src = StateTransport("127.0.0.1", 5.0, key, encrypt=True)
    dst = StateTransport("127.0.0.1", 5.0, key, encrypt=True)
    plain = StateTransport("127.0.0.1", 5.0, key, encrypt=False)
    try:
        sd = _state()
        src.send_checkpoint([1], 2, sd, T)
        assert _equal(sd, dst.recv_checkpoint(0, src.metadata(), 2, T))
        with pytest.raises((PeerUnavailable, AuthError)):
            plain.recv_checkpoint(0, src.metadata(), 2, T)
        assert src.served == 1
    finally:
        for t in (src, dst, plain):
            t.shutdown()
