"""Elastic outer group on torchft (issue 10, first slice): quorum of live replicas per outer step.

Every replica is its own process (``python -m tools.elastic_toy replica``) under a time bound,
killed (process group) in ``finally``; the lighthouse runs in the test process. The toy replicas
contribute known vectors, so the mean over the live set is computed here (``tools.elastic_toy.oracle``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dilocox.elastic import ElasticConfig
from dilocox.elastic.torchft import CLIENT_PRIVATE, MANAGER_PRIVATE, check_torchft_version, quorum_id
from tools.elastic_toy import oracle, read_records, replica_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchft():
    return pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")


def _run_replicas(
    tmp_path,
    n: int,
    steps: int,
    min_replicas: int,
    victim: int,
    die_at: int,
    die_mode: str,
    timeout: float,
    quorum_timeout: float,
    phase_s: float,
    heartbeat_timeout_ms: int,
    size: int = 1000,
    bound_s: float = 120.0,
    late: tuple[int, int] | None = None,
):
    """Start a lighthouse and ``n`` replica processes; return (records per replica, exit codes).

    ``late=(rank, step)``: replica ``rank`` is started only once replica 0 has committed ``step``."""
    _torchft()
    from dilocox.elastic import start_lighthouse

    lh = start_lighthouse(min_replicas, heartbeat_timeout_ms=heartbeat_timeout_ms)
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        deadline = time.monotonic() + bound_s
        for r in sorted(range(n), key=lambda r: late is not None and r == late[0]):
            if late is not None and r == late[0]:
                while not any(x.get("step") == late[1] for x in read_records(str(tmp_path / "r0.jsonl"))):
                    assert time.monotonic() < deadline and procs[0].poll() is None, "replica 0 did not get there"
                    time.sleep(0.05)
            cmd = replica_cmd(
                lh.address(),
                r,
                str(tmp_path / f"r{r}.jsonl"),
                steps,
                size,
                min_replicas,
                timeout,
                quorum_timeout,
                phase_s,
                die_at if r == victim else None,
                die_mode,
                initial_replicas=None if late is not None else n,
            )
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp_path / f"r{r}.err", "w"),
                )
            )
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        lh.shutdown()
    order = sorted(range(n), key=lambda r: late is not None and r == late[0])
    codes = {r: p.returncode for r, p in zip(order, procs)}
    return [read_records(str(tmp_path / f"r{r}.jsonl")) for r in range(n)], [codes[r] for r in range(n)]


def _err_tail(tmp_path, r: int) -> str:
    with open(tmp_path / f"r{r}.err") as f:
        return "".join(line for line in f.readlines() if "[INFO]" not in line)[-3000:]


@pytest.mark.fault
@pytest.mark.slow  # ~10-15 s: 3 replica processes + torchft start-up on 2 shared cores
@pytest.mark.parametrize("die_mode", ["inflight"])  # mid-phase: tests/test_elastic_outer.py (real outer loop)
def test_kill9_one_of_three_survivors_average_over_live(tmp_path, die_mode):
    """3 replicas, replica 2 SIGKILLed at step 3 (mid-phase, or after the quorum while the peers all-reduce):
    the survivors finish every step; steps 0-2 are the mean over {0,1,2}, steps 3-5 the mean over {0,1}
    (sum / 2, not / 3), bit for bit equal to the oracle and to each other, within timeout + one step."""
    steps, die_at, timeout, hb_ms, phase_s = 6, 3, 5.0, 1500, 0.3
    recs, codes = _run_replicas(
        tmp_path,
        3,
        steps,
        2,
        victim=2,
        die_at=die_at,
        die_mode=die_mode,
        timeout=timeout,
        quorum_timeout=20.0,
        phase_s=phase_s,
        heartbeat_timeout_ms=hb_ms,
    )
    assert codes[2] == -signal.SIGKILL, f"victim exit {codes[2]}"
    assert codes[:2] == [0, 0], f"survivors exit {codes}: {_err_tail(tmp_path, 0)}"
    schedule = [[0, 1, 2]] * die_at + [[0, 1]] * (steps - die_at)
    want = oracle(schedule, 1000)
    t_kill = next(x["t"] for x in recs[2] if x["event"] == "kill")
    for r in (0, 1):
        st = [x for x in recs[r] if x["event"] == "step"]
        assert [x["step"] for x in st] == list(range(steps))
        assert [x["contributors"] for x in st] == schedule
        assert [(x["mean"], x["theta"]) for x in st] == want, f"replica {r} differs from the oracle mean"
        after = st[die_at]
        # detection by heartbeat expiry (+ one failed all-reduce and its retry in flight mode)
        # (+ 6 s of a loaded host's slack: still below quorum_timeout, what a missed detection waits)
        assert after["t"] - t_kill < timeout + hb_ms / 1000 + phase_s + 6.0, after
        if die_mode == "inflight":
            assert after["attempts"] >= 2, "the all-reduce with the dead peer in flight must fail and be retried"
    assert [x["theta"] for x in recs[0] if x["event"] == "step"] == [
        x["theta"] for x in recs[1] if x["event"] == "step"
    ]
    victim_steps = [x for x in recs[2] if x["event"] == "step"]
    assert [(x["mean"], x["theta"]) for x in victim_steps] == want[:die_at]


@pytest.mark.slow  # ~10 s
def test_below_min_replicas_clear_error_within_wait(tmp_path):
    """min_replicas=3 and one of 3 killed: both survivors stop with ElasticMinReplicasError naming
    elastic.min_replicas, after waiting about quorum_timeout_s (bounded), not forever and not at once."""
    quorum_timeout = 4.0
    recs, codes = _run_replicas(
        tmp_path,
        3,
        5,
        3,
        victim=2,
        die_at=2,
        die_mode="phase",
        timeout=5.0,
        quorum_timeout=quorum_timeout,
        phase_s=0.2,
        heartbeat_timeout_ms=1000,
        bound_s=90.0,
    )
    assert codes[2] == -signal.SIGKILL
    assert codes[:2] == [3, 3], f"survivors exit {codes}: {_err_tail(tmp_path, 0)}"
    for r in (0, 1):
        err = [x for x in recs[r] if x["event"] == "error"]
        assert len(err) == 1 and err[0]["step"] == 2, recs[r]
        assert err[0]["type"] == "ElasticMinReplicasError"
        assert "elastic.min_replicas=3" in err[0]["msg"] and "quorum_timeout_s" in err[0]["msg"]
        assert quorum_timeout - 0.5 <= err[0]["wait_s"] <= quorum_timeout + 5.0, err[0]
        assert [x["step"] for x in recs[r] if x["event"] == "step"] == [0, 1]


@pytest.mark.fault
@pytest.mark.slow  # ~15 s
def test_late_replica_is_not_averaged_in_and_stops_clearly(tmp_path):
    """A replica started after the others committed step 1 is behind torchft's max step: its buffer is
    zeroed and NOT counted (the survivors' steps stay the oracle mean over {0,1}, sum / 2), and it stops
    with ElasticBehindError naming the live join it lacks (a group without state functions: the toy), instead of
    silently diverging (`dilocox train` sets the state functions up: tests/test_elastic_train.py)."""
    steps = 60  # long enough (~24 s) for the late replica's start-up (import torch + torchft) on loaded cores
    recs, codes = _run_replicas(
        tmp_path,
        3,
        steps,
        2,
        victim=-1,
        die_at=-1,
        die_mode="phase",
        timeout=5.0,
        quorum_timeout=20.0,
        phase_s=0.4,
        heartbeat_timeout_ms=1500,
        late=(2, 1),
    )
    assert codes == [0, 0, 3], f"exit codes {codes}: {_err_tail(tmp_path, 2)}"
    want = oracle([[0, 1]] * steps, 1000)
    for r in (0, 1):
        st = [x for x in recs[r] if x["event"] == "step"]
        assert [x["contributors"] for x in st] == [[0, 1]] * steps
        assert [(x["mean"], x["theta"]) for x in st] == want, f"replica {r} differs from the oracle mean over {{0,1}}"
    err = [x for x in recs[2] if x["event"] == "error"]
    assert len(err) == 1 and err[0]["type"] == "ElasticBehindError" and "live join" in err[0]["msg"], recs[2]
    assert not [x for x in recs[2] if x["event"] == "step"]


@pytest.mark.parametrize(
    "field,value,fix",
    [
        ("lighthouse_addr", "localhost:29510", "http://host:port"),
        ("replica_rank", 8, "[0, max_replicas=8)"),
        ("min_replicas", 0, "[1, max_replicas=8]"),
        ("initial_replicas", 1, "min_replicas=2"),
        ("timeout_s", 0, "positive"),
        ("quorum_timeout_s", -1.0, "positive"),
        ("max_attempts", 0, ">= 1"),
    ],
)
def test_config_errors_name_field_and_fix(field, value, fix):
    kw = dict(lighthouse_addr="http://127.0.0.1:1", replica_rank=0, min_replicas=2, max_replicas=8)
    kw[field] = value
    with pytest.raises(ValueError) as e:
        ElasticConfig(**kw).validate()
    assert f"elastic.{field}={value!r}" in str(e.value) and fix in str(e.value)


def test_elastic_config_defaults_are_the_config_sections():
    """One source of defaults: the group's settings default to ``outer.elastic``'s (issue 25)."""
    import dataclasses

    from dilocox.config.sections import ElasticSection

    section = {f.name: f.default for f in dataclasses.fields(ElasticSection)}
    shared = [
        f for f in dataclasses.fields(ElasticConfig) if f.name in section and f.default is not dataclasses.MISSING
    ]
    assert len(shared) >= 7
    for f in shared:
        assert f.default == section[f.name], f.name


def test_unsupported_torchft_is_refused_with_the_fix():
    assert check_torchft_version("0.2.0") == "0.2.0"
    with pytest.raises(ImportError, match=r"torchft 0\.3\.1 is not supported.*_quorum_id.*torchft==0\.2\.0"):
        check_torchft_version("0.3.1")


def test_allreduce_mean_rejects_bad_input_and_runs_alone(tmp_path):
    """One replica with min_replicas=1: the mean is the input itself; 2-D or integer input is refused."""
    _torchft()
    import torch

    from dilocox.elastic import ElasticOuterGroup, start_lighthouse

    lh = start_lighthouse(1, heartbeat_timeout_ms=1000)
    g = None
    try:
        g = ElasticOuterGroup(
            ElasticConfig(
                lighthouse_addr=lh.address(),
                replica_rank=3,
                min_replicas=1,
                max_replicas=4,
                timeout_s=5.0,
                quorum_timeout_s=10.0,
            )
        )
        x = torch.arange(10, dtype=torch.float32) * 0.1
        res = g.allreduce_mean(x)
        assert res.contributors == [3] and torch.equal(res.mean, x) and res.step == 1
        # the contract with torchft: the real Manager (no fake) has every private name failover.py touches
        m = g._manager
        missing = [n for n in MANAGER_PRIVATE if n not in vars(m)]
        client = getattr(m._client, "_inner", m._client)  # under failover's quorum guard
        missing += [f"_client.{n}" for n in CLIENT_PRIVATE if not callable(getattr(client, n, None))]
        assert not missing, f"torchft {check_torchft_version()} renamed {missing}: update dilocox/elastic/failover.py"
        assert res.quorum_id == quorum_id(m) >= 0 and isinstance(m._commit_failures, int)
        assert torch.equal(x, torch.arange(10, dtype=torch.float32) * 0.1), "input must not be modified"
        with pytest.raises(ValueError, match="1-D floating"):
            g.allreduce_mean(torch.zeros(2, 2))
        with pytest.raises(ValueError, match="1-D floating"):
            g.allreduce_mean(torch.zeros(4, dtype=torch.int64))
    finally:
        if g is not None:
            g.close()
        lh.shutdown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
