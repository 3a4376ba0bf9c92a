"""Edges of SWARM mode found in the second review: a stage count that does not divide the model's layers, a malformed
``--store`` address, an ``--out`` that cannot be a directory, a store port in use, a hop that drops a microbatch at its
deadline, the summary of a job in which rebalancing moved a peer, and IWRR after two bans end at once."""

from __future__ import annotations

import os
import subprocess
import sys
from threading import Lock
from types import SimpleNamespace

import pytest
import torch

from dilocox.config import ConfigError
from dilocox.net.rpc import RemoteError
from dilocox.swarm import cli, hops
from dilocox.swarm.activations import ActCodec, pack_ids
from dilocox.swarm.hops import MicrobatchHops, SwarmError
from dilocox.swarm.routing import IWRRRouter
from dilocox.swarm.runtime import SwarmResult, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _peer(tmp_path, store: str, *over: str) -> subprocess.CompletedProcess:
    """``python -m dilocox.swarm.peer`` (swarm.sbatch's entry point) of s0p0, bounded."""
    cmd = [sys.executable, "-m", "dilocox.swarm.peer", "--config", TINY, "--stage", "0", "--index", "0",
           "--store", store, "--out", str(tmp_path), "--", "--security.authenticate=false",
           "--swarm.startup_timeout_s=1", *over]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=ENV)


def test_a_stage_count_that_does_not_divide_the_layers_is_one_config_line_before_any_peer_starts(tmp_path):
    """Bug: ``--peers 1,1,1`` of a 4-layer model passed the launcher's checks, started the store, lighthouses and every
    peer, and each peer died with a ``model.n_layers ... parallel.pipeline`` traceback (exit 1). Now one config
    line naming swarm.peers_per_stage, before anything starts, from the launcher and from a hand-started peer."""
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"swarm.peers_per_stage=\[1, 1, 1\] has 3 stages.*model.n_layers=4"):
        cli.main([TINY, "--peers", "1,1,1", "--steps", "1", "--out", str(out)])
    assert not out.exists()
    r = _peer(tmp_path, "127.0.0.1:1", "--swarm.peers_per_stage=[1,1,1]")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "has 3 stages, which do not divide model.n_layers=4" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("store", ["localhost", "127.0.0.1:abc", "127.0.0.1:99999"])
def test_a_malformed_store_address_is_one_line(store, tmp_path):
    """Bug: ``--store HOST`` without a port (or a port that is not one) was a ``ValueError`` traceback from a peer,
    and ``dilocox swarm rebalance`` logged it in its thread, then moved nothing until ``--max-s`` and exited 0."""
    r = _peer(tmp_path, store)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--store {store!r} must be HOST:PORT" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    argv = ["rebalance", "--config", TINY, "--store", store, "--out", str(tmp_path), "--lighthouse", "0=http://h:1",
            "--lighthouse", "1=http://h:1", "--max-s", "1", "--", "--swarm.rebalance_period_s=1",
            "--security.authenticate=false"]  # fmt: skip
    with pytest.raises(cli.SwarmUsageError, match="--store .* must be HOST:PORT"):
        cli.main(argv)


@pytest.mark.parametrize("where", ["a_file", "a_file/below"])
def test_an_out_that_cannot_be_a_directory_is_one_line(where, tmp_path):
    """Bug: ``dilocox swarm --out PATH`` where PATH is a file (or below one) was a FileExistsError/NotADirectoryError
    traceback from the launcher (exit 1), not one line naming --out (exit 2)."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(cli.SwarmUsageError, match="--out .*cannot be the job's output directory"):
        cli.main([TINY, "--peers", "1,1", "--steps", "1", "--out", str(tmp_path / where)])


@pytest.mark.parametrize("guarded", [True, False])
def test_a_store_port_in_use_is_one_line(guarded, tmp_path):
    """Bug: ``dilocox swarm store --port P`` with P taken (or a --bind that is not this host's) was an OSError /
    DistNetworkError traceback (exit 1), not one line naming --bind/--port (exit 2)."""
    import socket

    from dilocox.net.secure import load_or_create_secret

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "dilocox.cli", "swarm", "store", "--port", str(port), "--bind", "127.0.0.1",
           "--max-s", "5"]  # fmt: skip
    if guarded:
        load_or_create_secret(str(tmp_path / "secret"))
        cmd += ["--secret-file", str(tmp_path / "secret")]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=ENV)
    finally:
        sock.close()
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--port {port}: the store cannot listen there" in r.stderr and "Traceback" not in r.stderr, r.stderr


class _Hop(MicrobatchHops):
    """Stage 1 of 3 of a SWARM peer as far as ``MicrobatchHops._send`` reads it: two stage-2 peers, s2p0 first."""

    def __init__(self) -> None:
        self.name, self.stage, self.n = "s1p0", 1, 3
        self.s = SimpleNamespace(rpc_timeout_s=10.0, ban_s=30.0)
        self.router, self.router_lock, self.lock = IWRRRouter(["s2p0", "s2p1"], ban_s=30.0), Lock(), Lock()
        self.addrs = {"s2p0": "127.0.0.1:1", "s2p1": "127.0.0.1:2"}
        self.bans, self.last_done, self.link_bytes, self.completed = [], {}, {}, {}
        self.codec = ActCodec("none", 8)

    def _refresh_addr(self, peer: str) -> bool:
        return False


def test_a_hop_that_drops_a_microbatch_at_its_deadline_is_banned_and_the_microbatch_re_sent(monkeypatch):
    """Bug: a hop drops a microbatch that would come back after its caller's budget with a margin (10 %, at most 2 s)
    to spare, so its error reply reaches the caller BEFORE the caller's timeout: a RemoteError, which ``_send`` did not
    handle, so the chain unwound and every peer of the job exited 3 (seen: [1, 1, 2], s2p0 9.3 s into a 10 s hop;
    /tmp/review-swarm2/repro_late.sh). A peer that misses the deadline by more (no reply in time) was banned and the
    microbatch re-sent; now so is this one (a replay's error still goes to its caller, which counts it lost)."""
    y = torch.randn(1, 2, 8)
    grad, gmeta = ActCodec("none", 8).encode(torch.ones(1, 2, 8))
    sent = []

    def call(addr, method, meta, tensors, timeout_s):
        sent.append(addr)
        if addr.endswith(":1"):
            raise RemoteError(addr, "SwarmError: s2p0: microbatch m came back after its caller's timeout: dropped here")
        return {"gact": gmeta.to_dict(), "route": ["s2p1"]}, {"grad": grad}

    monkeypatch.setattr(hops, "call", call)
    hop = _Hop()
    ids = pack_ids(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 256)
    gy, _, peer = hop._send(0, "m", y, ids)
    assert peer == "s2p1" and torch.equal(gy, torch.ones(1, 2, 8)) and sent == ["127.0.0.1:1", "127.0.0.1:2"]
    assert [b["peer"] for b in hop.bans] == ["s2p0"] and "dropped here" in hop.bans[0]["reason"]
    assert hop.router.live() == ["s2p1"]
    hop.router.unban("s2p0")
    with pytest.raises(RemoteError):  # a replay: not re-sent here
        hop._send(0, "m", None, ids, mode="replay", enc=ActCodec("none", 8).encode(y))


def test_an_error_that_never_clears_is_given_up_after_two_tries_per_peer(monkeypatch):
    """Bug: a next stage whose every peer fails a microbatch (a RemoteError or a timeout) more slowly than
    ``swarm.ban_s`` was re-sent without end: each ban had run out by the next choice. Now it is sent at most twice
    per peer of the stage, then a SwarmError names the microbatch and the last reason."""
    sent = []

    def call(addr, method, meta, tensors, timeout_s):
        sent.append(addr)
        assert len(sent) < 50, "re-sent without end"
        raise RemoteError(addr, "RuntimeError: the handler fails every time")

    monkeypatch.setattr(hops, "call", call)
    hop = _Hop()
    hop.router = IWRRRouter(["s2p0", "s2p1"], ban_s=1e-9)  # every ban has run out by the next choice
    ids = pack_ids(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 256)
    with pytest.raises(SwarmError, match="microbatch m failed 4 times.*fails every time"):
        hop._send(0, "m", torch.randn(1, 2, 8), ids)
    assert len(sent) == 4  # (which peers: the router's choice after each ban ran out)


def test_summary_of_a_job_in_which_a_peer_moved():
    """Bug: ``dilocox swarm --rebalance-s T`` ended with a ``KeyError: 'sync_s'`` traceback (exit 1) after every peer
    exited 0 once a peer had moved: the summary averaged ``sync_s`` over every record, and the moved peer's ``left``
    record (and a joiner's ``joined`` one) has none. The records are those of such a run (``[2, 1]``, s0p0 moved)."""
    step = lambda k, who, **kw: {"step": k, "peer": who, "seconds": 0.5, "sync_s": 0.1, **kw}  # noqa: E731
    records = {
        "s0p0": [step(k, "s0p0", loss=4.0 - k / 10) for k in range(7)]
        + [{"step": 6, "peer": "s0p0", "left": True, "seconds": 1.4, "moved_to": "s1p1"}],
        "s0p1": [step(k, "s0p1", loss=4.0 - k / 10) for k in range(10)],
        "s1p0": [step(k, "s1p0") for k in range(10)],
        "s1p1": [{"step": 6, "peer": "s1p1", "joined": True, "contributors": [0], "lr": 3e-3, "seconds": 2.0}]
        + [step(k, "s1p1") for k in range(7, 10)],
    }
    res = SwarmResult("/nowhere", {"s0p0": 0, "s0p1": 0, "s1p0": 0}, 30.0, records=records)
    text = summarize(res)
    assert "s0p0: exit 0, 7 steps, loss 4.0000 -> 3.4000" in text and "sync 100.0 ms/step" in text, text


def test_iwrr_peers_unbanned_at_once_start_at_the_live_minimum_and_do_not_flood():
    """Bug: two peers whose bans ran out at the same check each took the OTHER's stale priority (from before its ban)
    as the live minimum, so both came back far below the peer that served meanwhile and took every microbatch (b and
    c got all of the next 30 of three equally fast peers; a none)."""
    t = [0.0]
    r = IWRRRouter(["a", "b", "c"], ban_s=10.0, clock=lambda: t[0])
    for p in "abc":
        r.done(p, 1.0)
    for _ in range(3):
        r.choose()
    r.ban("b")
    r.ban("c")
    for _ in range(50):
        assert r.choose() == "a"
    t[0] = 11.0
    picks = [r.choose() for _ in range(30)]
    assert {p: picks.count(p) for p in "abc"} == {"a": 10, "b": 10, "c": 10}
