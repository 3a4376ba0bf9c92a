"""The lighthouse is not a single point of failure (issue 10 §6b): dilocox/elastic/failover.py.

Process tests: toy replicas (``python -m tools.elastic_toy replica``) and the lighthouse, each in its own
process group under a time bound (``tools.elastic_toy.lighthouse_scenario`` kills them all in ``finally``).
The lighthouse is SIGKILLed once replica 0 committed ``kill_step`` and restarted on the same port; the
replicas are never restarted. Unit tests drive ``start_quorum_with_failover`` and the quorum guard with fakes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from dilocox.elastic.failover import (
    LighthouseFailover,
    LighthouseUnreachable,
    QuorumTimeout,
    ReplicaAgreement,
    install_quorum_guard,
    lighthouse_endpoints,
    lighthouse_listening,
    rendezvous_salt,
    start_quorum_with_failover,
)
from tests.spawn import free_port

ATTEMPT_S = 2.0


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
    addr = f"http://127.0.0.1:{free_port()}"
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
    addr = f"http://127.0.0.1:{free_port()}"
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
    addr = f"http://127.0.0.1:{free_port()}"
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


def test_ranks_of_one_replica_keep_or_ask_together_by_rank_0s_decision():
    """A replica of 2 ranks (issue 22 item 5): rank 0 probes the lighthouse and decides for both through the
    replica's store. Rank 1 here sees a lighthouse that listens (it came back between the two probes): it still keeps
    the quorum when rank 0 keeps, sends no request, and both stop together when rank 0 finds the outage too long."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    down = f"http://127.0.0.1:{free_port()}"
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        threading.Thread(target=_accept_all, args=(srv,), daemon=True).start()
        up = f"http://127.0.0.1:{srv.getsockname()[1]}"
        m0, m1 = _FakeQuorumManager([]), _FakeQuorumManager([])
        f0 = LighthouseFailover(m0, down, max_outage_s=0.8, attempt_s=ATTEMPT_S, agreement=ReplicaAgreement(store, 0))
        f1 = LighthouseFailover(m1, up, max_outage_s=30.0, attempt_s=ATTEMPT_S, agreement=ReplicaAgreement(store, 1))
        for _ in range(3):  # rank 0 writes its decision, rank 1 reads it (the n-th call reads the n-th decision)
            assert f0.quorum(time.monotonic() + 10).kept_last_quorum
            assert f1.quorum(time.monotonic() + 10).kept_last_quorum
        assert m0.calls == [] and m1.calls == []  # neither asked: rank 1 did not go to the lighthouse it saw
        time.sleep(0.9)  # the outage outlasts rank 0's bound: both raise, together
        with pytest.raises(LighthouseUnreachable, match="refused connections"):
            f0.quorum(time.monotonic() + 10)
        with pytest.raises(LighthouseUnreachable, match=r"rank 0 of this replica"):
            f1.quorum(time.monotonic() + 10)
        # rank 0 may not keep (its last step failed): both ask; rank 1 reaches its lighthouse, rank 0 waits (bounded)
        m0, m1 = _FakeQuorumManager([]), _FakeQuorumManager([])
        m0._commit_failures = 1
        f0 = LighthouseFailover(m0, down, max_outage_s=30.0, attempt_s=ATTEMPT_S, agreement=ReplicaAgreement(store, 0))
        f1 = LighthouseFailover(m1, up, max_outage_s=30.0, attempt_s=ATTEMPT_S, agreement=ReplicaAgreement(store, 1))
        f0.agreement.calls = f1.agreement.calls = 10  # (fresh keys)
        with pytest.raises(LighthouseUnreachable):
            f0.quorum(time.monotonic() + 0.3)
        r = f1.quorum(time.monotonic() + 10)
        assert not r.kept_last_quorum and len(m1.calls) == 1
        # rank 0 gone: rank 1 waits for its decision only until its deadline
        t0 = time.monotonic()
        with pytest.raises(QuorumTimeout, match="rank 0 of this replica did not say"):
            f1.quorum(time.monotonic() + 0.3)
        assert time.monotonic() - t0 < 2.0


def test_a_kept_quorum_is_left_by_all_its_replicas_at_the_same_step():
    """The exit race: the lighthouse comes back between two replicas' probes of one step; one would keep (and wait in
    the kept all-reduce), the other ask the lighthouse (and wait there for the first). With the slot of the kept
    step's all-reduce (``peers_saw_up``: did ANY replica see it listening just before that step) every replica of
    the kept quorum keeps once more when none saw it, even one whose own probe sees it listening now, and all ask at
    the step after one saw it. The stay is bounded like the outage."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        threading.Thread(target=_accept_all, args=(srv,), daemon=True).start()
        up = f"http://127.0.0.1:{srv.getsockname()[1]}"
        m = _FakeQuorumManager([])
        f = LighthouseFailover(m, up, max_outage_s=30.0, attempt_s=ATTEMPT_S)
        f._last_kept, f.down_since = True, time.monotonic()  # the last step ran on a kept quorum (outage began)
        f.peers_saw_up = False  # ... and no replica saw the lighthouse before it
        r = f.quorum(time.monotonic() + 10)
        assert r.kept_last_quorum and m.calls == [] and f.on_kept_quorum  # kept although it listens now
        f.peers_saw_up = True  # some replica saw it before this kept step: everyone asks now
        r = f.quorum(time.monotonic() + 10)
        assert not r.kept_last_quorum and len(m.calls) == 1 and not f.on_kept_quorum
        m2 = _FakeQuorumManager([])
        f2 = LighthouseFailover(m2, up, max_outage_s=0.2, attempt_s=ATTEMPT_S)
        f2._last_kept, f2.down_since, f2.peers_saw_up = True, time.monotonic() - 1.0, False
        assert not f2.quorum(time.monotonic() + 10).kept_last_quorum  # past the outage bound: no more staying


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
    res, s = _scenario(  # (an outage of 3 s: a step that waited for the lighthouse stands apart from a loaded host's)
        tmp_path, monkeypatch, replicas=2, steps=steps, kill_step=kill_step, restart_after=3.0, phase_s=phase_s,
        timeout=5.0, quorum_timeout=60.0,
    )  # fmt: skip
    assert res["exit_codes"] == [0, 0], s
    assert s["oracle_ok"] == [True, True], s
    for recs in res["records"]:
        st = _steps(recs)
        assert [x["step"] for x in st] == list(range(steps)) and all(x["contributors"] == [0, 1] for x in st)
        gaps = [b["t"] - a["t"] for a, b in zip(st, st[1:])]
        assert max(gaps) < phase_s + 2.0, (max(gaps), s)  # no step waited for the lighthouse (>= 3 s if one did)
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
        assert qt - 0.5 <= since_kill <= qt + 3.0, s  # within quorum_timeout_s of the outage (+ a loaded host's step)
        st = _steps(recs)
        if keep:  # trained on through the outage, then stopped
            assert st[-1]["step"] > kill_step + 5 and st[-1]["kept_total"] == st[-1]["step"] - kill_step, s
        else:  # waited at the first step after the kill
            assert st[-1]["step"] == kill_step and err[0]["step"] == kill_step + 1, s
            assert qt - 0.5 <= err[0]["wait_s"] <= qt + 1.5, s


def _lighthouse_proc(root: str, env: dict, port: int, out):
    """A real lighthouse on 127.0.0.1:``port`` for 2 replicas, in its own session (``failover.py lighthouse``)."""
    import os
    import subprocess
    import sys

    from dilocox.distributed.procs import spawn

    cmd = [sys.executable, os.path.join(root, "dilocox", "elastic", "failover.py"), "lighthouse", "--min-replicas",
           "2", "--bind", f"127.0.0.1:{port}", "--join-timeout-ms", "20000"]  # fmt: skip
    return spawn(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _metrics(tmp_path, r: int) -> list[dict]:
    from tests.spawn import read_records

    return read_records(tmp_path / f"replica{r}" / "metrics.jsonl")


@pytest.mark.fault
@pytest.mark.slow  # ~40-60 s: 2 replicas x 2 ranks of `dilocox train` and a lighthouse, on 2 cores
def test_replicas_of_two_ranks_keep_their_quorum_through_a_lighthouse_restart(tmp_path):
    """Two `dilocox train --nproc 2` replicas (2 pipeline stages each, H = 5): the lighthouse is SIGKILLed at step 40
    and started again on the same port once every rank kept its quorum (bounded: 20 s) and 1 s more. Rank 0 of
    each replica keeps the quorum for both its ranks (``ReplicaAgreement``): both ranks log the kept quorum, the
    outer steps go on through the outage, both replicas finish with the same final validation loss (the same θ).
    Before, replicas of several ranks waited for the lighthouse (no kept quorum; a 2.5-2.7 s stall here)."""
    import os
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    secret = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "dilocox.cli", "secret", str(secret)], env=env, check=True, cwd=root)
    lh_log = open(tmp_path / "lighthouse.log", "ab")

    def lighthouse() -> subprocess.Popen:
        return _lighthouse_proc(root, env, port, lh_log)

    def metrics(r: int) -> list[dict]:
        return _metrics(tmp_path, r)

    procs = [lighthouse()]
    try:
        for r in range(2):
            cmd = [sys.executable, "-m", "dilocox.cli", "train", "configs/tiny.yaml", "--nproc", "2",
                   "--parallel.pipeline=2", "--parallel.microbatches=2", "--outer.method=diloco",
                   "--outer.sync_every=5", "--train.steps=100", "--train.eval_every=0", "--log.every=1",
                   "--log.progress=false", "--log.tensorboard=false", "--checkpoint.every=0", "--model.n_layers=2",
                   "--outer.elastic.enabled=true",
                   f"--outer.elastic.lighthouse=http://127.0.0.1:{port}", f"--outer.elastic.replica_rank={r}",
                   "--outer.elastic.lighthouse_auth=false",  # (a plain lighthouse: this test is about its restart)
                   "--outer.elastic.min_replicas=2", "--outer.elastic.initial_replicas=2",
                   "--outer.elastic.quorum_timeout_s=30", f"--security.secret_file={secret}",
                   f"--log.run_dir={tmp_path / f'replica{r}'}"]  # fmt: skip
            log = open(tmp_path / f"r{r}.log", "wb")
            procs.append(subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True, stdout=log, stderr=log))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and max([x.get("step", 0) for x in metrics(0)] or [0]) < 40:
            assert all(p.poll() is None for p in procs[1:]), "a replica exited before the outage"
            time.sleep(0.1)
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=10)
        down_until = time.monotonic() + 20  # (< quorum_timeout_s) until both ranks of both replicas kept a quorum
        while time.monotonic() < down_until and not all(
            (tmp_path / f"r{r}.log").read_text(errors="replace").count("keeping the last quorum") >= 2 for r in range(2)
        ):
            time.sleep(0.1)
        time.sleep(1.0)  # an outer step or two more on the kept quorum
        procs[0] = lighthouse()
        rcs = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    logs = [(tmp_path / f"r{r}.log").read_text(errors="replace") for r in range(2)]
    assert rcs == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for text in logs:  # both ranks of each replica kept the quorum (each logs it once per outage)
        assert text.count("keeping the last quorum") >= 2, text[-3000:]
    finals = [next(x["summary"]["final_val_loss"] for x in metrics(r) if "summary" in x) for r in range(2)]
    assert finals[0] == finals[1], finals


# ------------------------------------------------------------------------------------------- the standby lighthouse
def test_standby_addresses_are_parsed_in_order_and_any_one_listening_counts():
    assert lighthouse_endpoints("http://a:1,http://b:2") == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError, match="standby"):
        lighthouse_endpoints("http://a:1,b:2")
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        up = f"http://127.0.0.1:{srv.getsockname()[1]}"
        assert lighthouse_listening(f"http://127.0.0.1:{free_port()},{up}")  # the primary refuses, the standby not
        assert not lighthouse_listening(f"http://127.0.0.1:{free_port()}")
    finally:
        srv.close()


class _Echo:
    """A TCP server that answers every message with ``tag + message`` (stands in for a lighthouse)."""

    def __init__(self, tag: bytes, port: int = 0):
        self.tag = tag
        self.srv = socket.create_server(("127.0.0.1", port))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    def _echo(self, c: socket.socket) -> None:
        with c:
            try:
                while data := c.recv(1024):
                    c.sendall(self.tag + data)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a bare close() would leave it listening)
        except OSError:
            pass
        self.srv.close()


def _ask(addr: str, msg: bytes = b"quorum?") -> bytes:
    host, port = lighthouse_endpoints(addr)[0]
    with socket.create_connection((host, port), timeout=5) as s:
        s.settimeout(5)
        s.sendall(msg)
        try:
            return s.recv(1024)
        except ConnectionResetError:  # closed with our message unread
            return b""


def test_relay_goes_to_the_standby_while_the_primary_refuses_and_back_when_it_listens():
    """The relay in front of [primary, standby]: the primary while it listens; the standby's answer once the primary
    is gone (a new connection, as torchft's channel reconnects); the standby's connection closed by the fail-back
    once the primary listens again (on its old port), and the next connection goes to the primary."""
    from dilocox.net.relay import LighthouseRelay

    primary, standby = _Echo(b"P:"), _Echo(b"S:")
    relay = LighthouseRelay([("127.0.0.1", primary.port), ("127.0.0.1", standby.port)], check_every_s=0.2)
    try:
        assert _ask(relay.address) == b"P:quorum?"
        port = primary.port
        primary.close()
        assert _ask(relay.address) == b"S:quorum?"
        host, rport = lighthouse_endpoints(relay.address)[0]
        held = socket.create_connection((host, rport), timeout=5)  # a long-lived channel, on the standby
        held.settimeout(5)
        held.sendall(b"x")
        assert held.recv(1024) == b"S:x"
        primary = _Echo(b"P:", port)  # the primary is back
        assert held.recv(1024) == b"", "the fail-back did not close the standby's connection"
        held.close()
        assert _ask(relay.address) == b"P:quorum?"
        assert relay.used == [0, 1, 1, 0]
    finally:
        relay.close()
        primary.close()
        standby.close()


def test_relay_with_no_lighthouse_listening_closes_at_once():
    from dilocox.net.relay import LighthouseRelay

    relay = LighthouseRelay([("127.0.0.1", free_port()), ("127.0.0.1", free_port())], connect_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        assert _ask(relay.address) == b""  # closed: torchft's request fails and is retried, bounded
        assert time.monotonic() - t0 < 3.0
        assert relay.used == []
    finally:
        relay.close()


@pytest.mark.slow
@pytest.mark.fault
def test_replicas_go_on_through_the_standby_when_the_primary_lighthouse_dies(tmp_path):
    """Two elastic replicas given a primary and a standby lighthouse (``http://p,http://s``): the primary is
    SIGKILLed at step 20 and never comes back; the replicas' relays reconnect to the standby, which forms the next
    quorums; both replicas finish every step with the same final validation loss (the same θ), and each logs the
    move to the standby. Without a standby the same outage ends the run after quorum_timeout_s (tested above)."""
    import os
    import subprocess
    import sys

    from dilocox.distributed.procs import kill_and_reap, kill_group, spawn

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ports = [free_port(), free_port()]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    secret = tmp_path / "secret"
    subprocess.run([sys.executable, "-m", "dilocox.cli", "secret", str(secret)], env=env, check=True, cwd=root)

    def lighthouse(port: int) -> subprocess.Popen:
        return _lighthouse_proc(root, env, port, open(tmp_path / f"lh{port}.log", "ab"))

    def metrics(r: int) -> list[dict]:
        return _metrics(tmp_path, r)

    lhs = [lighthouse(p) for p in ports]
    addrs = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    procs = []
    try:
        for r in range(2):
            cmd = [sys.executable, "-m", "dilocox.cli", "train", "configs/tiny.yaml", "--outer.method=diloco",
                   "--outer.sync_every=5", "--train.steps=80", "--train.eval_every=0", "--log.every=1",
                   "--log.progress=false", "--log.tensorboard=false", "--checkpoint.every=0", "--model.n_layers=2",
                   "--outer.elastic.enabled=true", f"--outer.elastic.lighthouse={addrs}",
                   "--outer.elastic.lighthouse_auth=false",  # (plain lighthouses: this test is about the standby)
                   f"--outer.elastic.replica_rank={r}", "--outer.elastic.min_replicas=2",
                   "--outer.elastic.initial_replicas=2", "--outer.elastic.quorum_timeout_s=30",
                   f"--security.secret_file={secret}", f"--log.run_dir={tmp_path / f'replica{r}'}"]  # fmt: skip
            log = open(tmp_path / f"r{r}.log", "wb")
            procs.append(spawn(cmd, cwd=root, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and max([x.get("step", 0) for x in metrics(0)] or [0]) < 20:
            assert all(p.poll() is None for p in procs), "a replica exited before the primary died"
            time.sleep(0.1)
        kill_group(lhs[0])  # SIGKILL: the primary never comes back
        lhs[0].wait(timeout=10)
        rcs = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs + lhs:
            kill_and_reap(p)
    logs = [(tmp_path / f"r{r}.log").read_text(errors="replace") for r in range(2)]
    assert rcs == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    for text in logs:
        assert f"now relaying to 127.0.0.1:{ports[1]}, standby 1" in text, text[-3000:]
    finals = [next(x["summary"]["final_val_loss"] for x in metrics(r) if "summary" in x) for r in range(2)]
    assert finals[0] == finals[1], finals
    assert all(max(x.get("step", 0) for x in metrics(r)) == 80 for r in range(2))


# ------------------------------------------------------------------------------------------ the lighthouse's guard
def test_guard_counts_a_port_probe_but_logs_only_a_stranger(caplog):
    """A connection closed before its first byte (``lighthouse_listening``'s readiness probe, which every guarded run
    makes) is counted but not logged as a refusal; a stranger who sends anything is logged, once per address."""
    from dilocox.net.relay import LighthouseGuard

    inner = _Echo(b"L:")
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", inner.port), b"s" * 32, "lighthouse")
    caplog.set_level(logging.WARNING, logger="dilocox")

    def refused(n: int) -> list[str]:
        deadline = time.monotonic() + 10
        while guard.rejected < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard.rejected == n
        return [r.getMessage() for r in caplog.records if "guard: refused" in r.getMessage()]

    try:
        for _ in range(2):
            assert lighthouse_listening(f"http://127.0.0.1:{guard.port}")
        assert refused(2) == []
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as s:
                s.settimeout(5)
                assert s.recv(64).startswith(b"DXA1")  # (read: a close with unread bytes would be a reset)
                s.sendall(b"PRI * HTTP/2.0\r\n")
                s.shutdown(socket.SHUT_WR)
                assert s.recv(64) == b""  # the guard closes it
        assert refused(4) == ["lighthouse guard: refused 127.0.0.1 (connection closed during authentication)"]
    finally:
        guard.close()
        inner.close()


def test_guard_lets_only_a_secret_holder_through_to_the_lighthouse(tmp_path):
    """``dilocox lighthouse --secret-file``'s guard in front of a stand-in lighthouse (an echo server): a relay that
    holds the secret is served; a stranger speaking HTTP/2 and a relay with another secret are closed without a
    byte reaching the lighthouse, and counted."""
    from dilocox.net.relay import LighthouseGuard, LighthouseRelay

    secret, other = b"s" * 32, b"o" * 32
    inner = _Echo(b"L:")
    reached = []
    orig = inner._echo
    inner._echo = lambda c: (reached.append(1), orig(c))
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", inner.port), secret, "lighthouse")
    good = LighthouseRelay([("127.0.0.1", guard.port)], secret=secret, service="lighthouse")
    bad = LighthouseRelay([("127.0.0.1", guard.port)], secret=other, service="lighthouse")
    try:
        assert _ask(good.address) == b"L:quorum?"
        assert len(reached) == 1
        with socket.create_connection(("127.0.0.1", guard.port), timeout=5) as s:  # a stranger: gRPC's preface
            s.settimeout(6)
            hello = s.recv(64)  # the guard's challenge, then nothing for a preface that proves nothing
            assert hello.startswith(b"DXA1")
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0" * 40)
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
        assert _ask(bad.address) == b""  # the relay could not authenticate: it closes its client
        time.sleep(0.2)
        assert len(reached) == 1, "a connection without the secret reached the lighthouse"
        assert guard.rejected >= 2
    finally:
        for x in (good, bad, guard, inner):
            x.close()


@pytest.mark.parametrize("flip", [False, True])
def test_a_byte_changed_between_relay_and_guard_never_reaches_the_lighthouse(flip):
    """Issue 21: after the handshake every chunk between a relay and the guard is framed and MACed (FramedPipe). A
    tap on the path sees the frame ([4-byte length][chunk][32-byte MAC]); with one byte of the chunk flipped the
    guard closes the pair and the lighthouse never sees the changed message (a hijacked connection cannot inject)."""
    from dilocox.net.relay import LighthouseGuard, LighthouseRelay
    from tests.test_security import _Tap

    secret = b"s" * 32
    inner = _Echo(b"L:")
    reached = bytearray()  # what the lighthouse received

    def echo(c):
        with c:
            while data := c.recv(1024):
                reached.extend(data)
                c.sendall(b"L:" + data)

    inner._echo = echo
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", inner.port), secret, "lighthouse")
    hs = 32 + 32  # the relay's half of the handshake: its challenge and its proof
    tap = _Tap(f"127.0.0.1:{guard.port}", flip_at=hs + 4 + 2 if flip else None)
    relay = LighthouseRelay([("127.0.0.1", int(tap.addr.rsplit(":", 1)[1]))], secret=secret, service="lighthouse")
    try:
        got = _ask(relay.address)
        time.sleep(0.3)
        assert bytes(tap.seen[hs : hs + 4]) == len(b"quorum?").to_bytes(4, "big")
        assert len(tap.seen) == hs + 4 + len(b"quorum?") + 32
        if flip:
            assert got == b"" and not reached  # the guard dropped the pair before a byte went on to the lighthouse
        else:
            assert got == b"L:quorum?" and reached == b"quorum?"
    finally:
        for x in (relay, tap, guard, inner):
            x.close()


def _auth_launch(tmp_path, name: str, noise: bool) -> tuple[int, str, list[str], Path]:
    """``dilocox launch --elastic 2 --authenticate-lighthouse`` of a short run into ``tmp_path/name``; with ``noise``
    a stranger hammers the lighthouse's public port (random bytes, gRPC's preface, silent connections) from the
    moment it is up until the run ends; the first such connection must get the challenge and nothing more."""
    import os
    import random
    import subprocess
    import sys

    from dilocox.distributed.procs import kill_and_reap, spawn

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = tmp_path / name
    cmd = [sys.executable, "-m", "dilocox.cli", "launch", "--elastic", "2", "configs/tiny.yaml",
           "--authenticate-lighthouse", "--no-netns", "--timeout", "240", "--outer.method=diloco",
           "--outer.sync_every=5", "--train.steps=40", "--train.eval_every=0", "--model.n_layers=2",
           f"--log.run_dir={run}"]  # fmt: skip
    proc = spawn(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first: list[bytes] = []
    try:
        addr, deadline = None, time.monotonic() + 120
        while noise and addr is None and time.monotonic() < deadline:
            from tests.spawn import read_records

            addr = next(
                (e["address"] for e in read_records(run / "events.jsonl") if e.get("event") == "lighthouse"), None
            )
            time.sleep(0.1)

        def hammer() -> None:
            rng = random.Random(3)
            host, port = lighthouse_endpoints(addr)[0]
            for i in range(2000):
                if proc.poll() is not None:
                    return
                try:
                    with socket.create_connection((host, port), timeout=2) as s:
                        s.settimeout(6)
                        junk = [rng.randbytes(rng.randrange(1, 300)), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b""][i % 3]
                        s.sendall(junk)
                        got = b""
                        while chunk := s.recv(1024):
                            got += chunk
                        if i == 1:
                            first.append(got)
                except OSError:
                    pass

        if noise:
            assert addr, "no lighthouse address"
            threading.Thread(target=hammer, daemon=True).start()
        out, _ = proc.communicate(timeout=max(1.0, deadline + 120 - time.monotonic()))
    finally:
        kill_and_reap(proc)
    if noise:
        assert first and first[0][:4] == b"DXA1" and len(first[0]) == 36, first  # the challenge, then closed
    finals = [line.split("final val loss")[1].split()[0] for line in out.splitlines() if "final val loss" in line]
    return proc.returncode, out, finals, run


@pytest.mark.slow
@pytest.mark.fault
def test_elastic_run_behind_an_authenticated_lighthouse_ends_equal_under_a_strangers_noise(tmp_path):
    """Issue 21: two elastic replicas train through the lighthouse's guard (``--authenticate-lighthouse``); the
    same run while a stranger hammers the lighthouse's public port ends with the same final validation loss on
    both replicas, to the printed digit, as the undisturbed run; the guard logged the refusals."""
    rc, out, quiet, _ = _auth_launch(tmp_path, "quiet", noise=False)
    assert rc == 0 and len(quiet) == 2 and quiet[0] == quiet[1], out[-3000:]
    rc, out, loud, run = _auth_launch(tmp_path, "loud", noise=True)
    assert rc == 0, out[-3000:]
    assert loud == quiet, (quiet, loud)
    assert "lighthouse guard: refused" in (run / "lighthouse.log").read_text()
