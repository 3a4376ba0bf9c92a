"""The lighthouse is not a single point of failure (issue 10 §6b): dilocox/elastic/failover.py.

Process tests: toy replicas (``python -m tools.elastic_toy replica``) and the lighthouse, each in its own
process group under a time bound (``tools.elastic_toy.lighthouse_scenario`` kills them all in ``finally``).
The lighthouse is SIGKILLed once replica 0 committed ``kill_step`` and restarted on the same port; the
replicas are never restarted. Unit tests drive ``start_quorum_with_failover`` and the quorum guard with fakes.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from dilocox.elastic.failover import (
    LighthouseFailover,
    LighthouseUnreachable,
    QuorumTimeout,
    install_quorum_guard,
    lighthouse_endpoints,
    lighthouse_listening,
    rendezvous_salt,
    start_quorum_with_failover,
)

ATTEMPT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accept_all(srv: socket.socket) -> None:
    while True:
        try:
            srv.accept()[0].close()
        except OSError:  # closed by the test
            return


class _FakeManager:
    """start_quorum raises ``errors`` in turn, then succeeds; records each call's timeout."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = list(errors)
        self.calls: list[float] = []
        self.heal_flags: list[bool] = []
        self._quorum_future = None
        self.future_at_call: list[object] = []

    def start_quorum(self, allow_heal: bool = True, timeout: timedelta | None = None) -> None:
        self.calls.append(timeout.total_seconds())
        self.heal_flags.append(allow_heal)
        self.future_at_call.append(self._quorum_future)
        self._quorum_future = "pending"
        if self.errors and getattr(self, "sleep_to_timeout", False):
            time.sleep(timeout.total_seconds())  # like the Rust client: the request runs to its timeout
        if self.errors:
            self._quorum_future = "failed"  # torchft keeps the failed future; the next call would re-raise it
            raise self.errors.pop(0)


def test_lighthouse_address_errors():
    assert lighthouse_endpoints("http://vm:29510") == [("vm", 29510)]
    for bad in ("vm:29510", "http://vm", "http://vm:notaport", "ftp://vm:1"):
        with pytest.raises(ValueError, match=r"elastic\.lighthouse_addr=.*http://host:port"):
            lighthouse_endpoints(bad)


def test_unreachable_lighthouse_is_not_asked_and_ends_at_the_deadline():
    addr = f"http://127.0.0.1:{_free_port()}"
    assert not lighthouse_listening(addr)
    m = _FakeManager([])
    t0 = time.monotonic()
    with pytest.raises(LighthouseUnreachable, match="refused connections") as ei:
        start_quorum_with_failover(m, addr, time.monotonic() + 1.0, attempt_s=ATTEMPT_S)
    took = time.monotonic() - t0
    assert 0.95 <= took < 1.8, took
    assert m.calls == []  # no request is sent to a lighthouse that refuses connections
    assert ei.value.lighthouse_down_s >= 0.9


def test_timed_out_attempts_are_retried_with_a_fresh_future():
    with socket.socket() as srv:  # a listening socket stands in for the lighthouse's port
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        threading.Thread(target=_accept_all, args=(srv,), daemon=True).start()
        addr = f"http://127.0.0.1:{srv.getsockname()[1]}"
        m = _FakeManager([RuntimeError('status: Cancelled, message: "Timeout expired"')] * 2)
        r = start_quorum_with_failover(m, addr, time.monotonic() + 30.0, attempt_s=ATTEMPT_S)
        assert r.attempts == 3 and r.lighthouse_down_s == 0.0
        assert m.calls == [ATTEMPT_S] * 3  # short attempts, not the whole deadline
        assert m.future_at_call == [None, None, None]  # the failed future is dropped before each retry
        # the last attempt gets only what is left of the deadline
        m = _FakeManager([RuntimeError("Timeout expired")] * 100)
        with pytest.raises(QuorumTimeout, match="no quorum after") as ei:
            start_quorum_with_failover(m, addr, time.monotonic() + 0.3, attempt_s=ATTEMPT_S)
        assert not isinstance(ei.value, LighthouseUnreachable)
        assert all(c <= 0.31 for c in m.calls), m.calls
        # other errors are not retried
        m = _FakeManager([ValueError("replica not participating in returned quorum")])
        with pytest.raises(ValueError, match="not participating"):
            start_quorum_with_failover(m, addr, time.monotonic() + 30.0, attempt_s=ATTEMPT_S)
        assert len(m.calls) == 1


class _FakeQuorumManager(_FakeManager):
    """A manager after its first quorum (id 1, participating, last step committed)."""

    def __init__(self, errors: list[Exception]) -> None:
        super().__init__(errors)
        self._client = SimpleNamespace()
        self._quorum_id = 1
        self._participating_replica_rank = 0
        self._participating_replica_world_size = 2
        self._commit_failures = 0
        self._errored = "stale"
        self._healing = True

    def errored(self):
        return None


def test_kept_quorum_while_the_lighthouse_is_down_is_bounded():
    addr = f"http://127.0.0.1:{_free_port()}"
    m = _FakeQuorumManager([])
    f = LighthouseFailover(m, addr, max_outage_s=0.6, attempt_s=ATTEMPT_S)
    r = f.quorum(time.monotonic() + 30.0)
    assert r.kept_last_quorum and r.attempts == 0 and m.calls == []  # no request, the old group is used
    assert m._quorum_future.done() and m._quorum_future.result() is None
    assert m._errored is None and m._healing is False
    t0 = time.monotonic()
    with pytest.raises(LighthouseUnreachable, match="refused connections"):
        while time.monotonic() - t0 < 5.0:
            f.quorum(time.monotonic() + 30.0)
            time.sleep(0.05)
    assert 0.4 <= time.monotonic() - t0 < 1.5 and f.kept_steps >= 5
    assert m.calls == []


def test_no_kept_quorum_after_a_failed_step_or_before_the_first_quorum():
    addr = f"http://127.0.0.1:{_free_port()}"
    m = _FakeQuorumManager([])
    f = LighthouseFailover(m, addr, max_outage_s=30.0, attempt_s=ATTEMPT_S)
    assert f.quorum(time.monotonic() + 30.0).kept_last_quorum
    m._commit_failures = 1  # the step on the kept group failed (a member died meanwhile)
    t0 = time.monotonic()
    with pytest.raises(LighthouseUnreachable):
        f.quorum(time.monotonic() + 0.5)  # waits (bounded) for the lighthouse instead
    assert 0.45 <= time.monotonic() - t0 < 1.5
    assert f.guard.force_reconfigure  # the new lighthouse's first quorum configures a fresh group
    m = _FakeQuorumManager([])
    m._quorum_id = -1
    with pytest.raises(LighthouseUnreachable):
        LighthouseFailover(m, addr, max_outage_s=30.0).quorum(time.monotonic() + 0.3)
    with pytest.raises(ValueError, match="elastic.lighthouse_addr"):
        LighthouseFailover(m, "127.0.0.1:1", max_outage_s=30.0)
    with socket.socket() as srv:  # lighthouse up: a normal request, not a kept quorum
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        threading.Thread(target=_accept_all, args=(srv,), daemon=True).start()
        m = _FakeQuorumManager([RuntimeError("Timeout expired")] * 3)
        m.sleep_to_timeout = True
        r = LighthouseFailover(m, f"http://127.0.0.1:{srv.getsockname()[1]}", 30.0, attempt_s=0.2).quorum(
            time.monotonic() + 30, allow_heal=True
        )
        assert not r.kept_last_quorum and r.attempts == 4 and m.heal_flags == [True] * 4  # the live join heals
        # a live lighthouse gets longer requests each time (fewer request boundaries)
        assert [round(c, 1) for c in m.calls] == [0.2, 0.4, 0.8, 1.6], m.calls


def _qr(quorum_id: int, ids: list[str], max_step: int = 4) -> SimpleNamespace:
    return SimpleNamespace(quorum_id=quorum_id, replica_ids=ids, max_step=max_step, store_address="h:1", heal=False)


def test_quorum_guard_salts_the_rendezvous_and_forces_reconfigure_on_a_reused_id():
    results = [_qr(1, ["r0:a", "r1:b", "r2:c"], 0), _qr(1, ["r0:a", "r1:b", "r2:c"], 3), _qr(1, ["r0:a", "r1:b"], 4)]
    client = SimpleNamespace(_quorum=lambda **kw: results.pop(0), should_commit=lambda *a, **kw: True)
    manager = SimpleNamespace(_client=client, _quorum_id=-1)
    guard = install_quorum_guard(manager)
    assert install_quorum_guard(manager) is guard and manager._client is guard
    assert guard.should_commit() is True  # everything else goes to the real client
    q = manager._client._quorum(group_rank=0)
    assert q.store_address == "h:1/" + rendezvous_salt(0, ["r0:a", "r1:b", "r2:c"]) and q.heal is False
    manager._quorum_id = 1  # what torchft's Manager records after configuring
    manager._client._quorum(group_rank=0)  # same id, same members: torchft keeps its process group
    assert manager._quorum_id == 1 and guard.forced_reconfigures == 0
    manager._client._quorum(group_rank=0)  # a restarted lighthouse reuses id 1 for other members
    assert manager._quorum_id == -1 and guard.forced_reconfigures == 1
    # the salt is the same on every member of a quorum and differs between lighthouse lives
    assert rendezvous_salt(4, ["r1:b", "r0:a"]) == rendezvous_salt(4, ["r0:a", "r1:b"])
    assert rendezvous_salt(4, ["r0:a", "r1:b"]) != rendezvous_salt(5, ["r0:a", "r1:b"])
    assert rendezvous_salt(4, ["r0:a", "r1:b"]) != rendezvous_salt(4, ["r0:a", "r1:x"])


def _scenario(tmp_path, monkeypatch, **kw) -> tuple[dict, dict]:
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")
    from tools.elastic_toy import lighthouse_scenario, summarize_lighthouse

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (the replicas find tools/ themselves: tools.child_env)
    res = lighthouse_scenario(str(tmp_path), attempt_s=ATTEMPT_S, **kw)
    return res, summarize_lighthouse(res)


def _steps(recs: list[dict]) -> list[dict]:
    return [x for x in recs if x["event"] == "step"]


@pytest.mark.fault
@pytest.mark.slow
def test_lighthouse_restarted_replicas_wait_and_continue(tmp_path, monkeypatch):
    """Without keeping the quorum: the survivors wait for the new lighthouse and go on without a restart."""
    steps, kill_step, phase_s = 6, 2, 0.3
    res, s = _scenario(
        tmp_path, monkeypatch, replicas=2, steps=steps, kill_step=kill_step, restart_after=1.0, phase_s=phase_s,
        timeout=5.0, quorum_timeout=40.0, keep_last_quorum=False,
    )  # fmt: skip
    assert res["exit_codes"] == [0, 0], s
    for recs in res["records"]:
        st = _steps(recs)
        assert [x["step"] for x in st] == list(range(steps)), s  # all steps, nobody restarted
        assert all(x["contributors"] == [0, 1] for x in st) and st[-1]["kept_total"] == 0, s
    assert s["oracle_ok"] == [True, True], s  # theta bit-identical to the oracle (and so to each other)
    assert _steps(res["records"][0])[-1]["theta"] == _steps(res["records"][1])[-1]["theta"]
    # the step after the restart completes soon after the new lighthouse listens: one phase plus slack
    for r in range(2):
        nxt = next(x for x in _steps(res["records"][r]) if x["step"] == kill_step + 1)
        assert nxt["t"] - res["t_lighthouse_listening"] < phase_s + 3.0, s
        assert nxt["t"] - res["t_lighthouse_kill"] < 1.0 + s["restart_to_listening_s"] + phase_s + 3.0, s


@pytest.mark.fault
@pytest.mark.slow
def test_lighthouse_restart_keeps_the_quorum_without_a_stall(tmp_path, monkeypatch):
    """Keeping the last quorum: the survivors train through the outage at phase pace, then use the new
    lighthouse's quorums again (the torch-free lighthouse listens ~1 s after its restart here)."""
    steps, kill_step, phase_s = 30, 2, 0.3
    res, s = _scenario(
        tmp_path, monkeypatch, replicas=2, steps=steps, kill_step=kill_step, restart_after=1.0, phase_s=phase_s,
        timeout=5.0, quorum_timeout=60.0,
    )  # fmt: skip
    assert res["exit_codes"] == [0, 0], s
    assert s["oracle_ok"] == [True, True], s
    for recs in res["records"]:
        st = _steps(recs)
        assert [x["step"] for x in st] == list(range(steps)) and all(x["contributors"] == [0, 1] for x in st)
        gaps = [b["t"] - a["t"] for a, b in zip(st, st[1:])]
        assert max(gaps) < phase_s + 1.0, (max(gaps), s)  # no step waited for the lighthouse
        during = [x for x in st if res["t_lighthouse_kill"] < x["t"] < res["t_lighthouse_listening"]]
        assert during and during[-1]["kept_total"] >= len(during) - 1, s  # kept the quorum while it was down
        after = [x for x in st if x["t"] > res["t_lighthouse_listening"] + 1.0]
        assert len(after) >= 3, f"the lighthouse took too long to start here: {s}"
        assert after[0]["kept_total"] == after[-1]["kept_total"], s  # new quorums from the restarted lighthouse


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.parametrize("keep", [True, False], ids=["keep", "wait"])
def test_lighthouse_restart_with_a_replica_lost_during_the_outage(tmp_path, monkeypatch, keep):
    """Replica 2 dies while the lighthouse is down: the new lighthouse hands out quorum id 1 again, now for
    {0, 1}; the guard makes torchft reconfigure at once (without it the first all-reduce after the restart
    runs on the old 3-replica group and fails: one attempt more). Keeping the quorum, the step on the old
    group fails at once (the dead member's connections are closed) and is redone on the new quorum."""
    steps, kill_step, phase_s = 6, 2, 0.4
    res, s = _scenario(
        tmp_path, monkeypatch, replicas=3, steps=steps, kill_step=kill_step, restart_after=1.0, phase_s=phase_s,
        replica_die_step=kill_step + 1, timeout=5.0, quorum_timeout=40.0, keep_last_quorum=keep,
    )  # fmt: skip
    assert res["exit_codes"][:2] == [0, 0], s
    for r in range(2):
        st = _steps(res["records"][r])
        assert [x["step"] for x in st] == list(range(steps)), s
        assert [x["contributors"] for x in st] == [[0, 1, 2]] * (kill_step + 1) + [[0, 1]] * (steps - kill_step - 1)
        nxt = st[kill_step + 1]
        assert nxt["attempts"] == (2 if keep else 1), s
        assert nxt["t"] - res["t_lighthouse_listening"] < phase_s + 3.0, s
    assert s["oracle_ok"][:2] == [True, True], s


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.parametrize("keep", [True], ids=["keep"])  # wait mode's bound: the unit test of the deadline above
def test_lighthouse_that_stays_down_gives_the_clear_error_in_time(tmp_path, monkeypatch, keep):
    qt, phase_s, kill_step = 6.0, 0.3, 2
    res, s = _scenario(
        tmp_path, monkeypatch, replicas=2, steps=60, kill_step=kill_step, restart_after=None, phase_s=phase_s,
        timeout=5.0, quorum_timeout=qt, keep_last_quorum=keep,
    )  # fmt: skip
    assert res["exit_codes"] == [3, 3], s
    for recs in res["records"]:
        err = [x for x in recs if x["event"] == "error"]
        assert len(err) == 1 and err[0]["type"] == "ElasticMinReplicasError", s
        assert "elastic.quorum_timeout_s" in err[0]["msg"] and "refused connections" in err[0]["msg"], s
        since_kill = err[0]["t"] - res["t_lighthouse_kill"]
        assert qt - 0.5 <= since_kill <= qt + phase_s + 1.5, s  # within quorum_timeout_s of the outage
        st = _steps(recs)
        if keep:  # trained on through the outage, then stopped
            assert st[-1]["step"] > kill_step + 5 and st[-1]["kept_total"] == st[-1]["step"] - kill_step, s
        else:  # waited at the first step after the kill
            assert st[-1]["step"] == kill_step and err[0]["step"] == kill_step + 1, s
            assert qt - 0.5 <= err[0]["wait_s"] <= qt + 1.5, s
