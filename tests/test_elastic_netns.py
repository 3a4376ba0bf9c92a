"""A dropped link (the replica's veth in its network namespace set down, then up) behaves like a dead replica and
the replica rejoins when the link returns (issue 10). Needs root and `ip netns` (skipped otherwise).

Three replicas of the oracle's TinyNet run (tests/elastic_worker.py), each in its own namespace of a
``dilocox.launch.netns.Cluster(hub=True)``; the lighthouse (`dilocox lighthouse`) in the switch namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from dilocox.launch.emulate import netns_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OK, WHY = netns_available()
STEPS, H = 48, 4


def _records(path) -> list[dict]:
    from tests.spawn import read_records

    return read_records(path)


@pytest.mark.fault
@pytest.mark.slow  # ~60-120 s
@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_link_down_is_a_dead_replica_and_it_rejoins_when_the_link_returns(tmp_path):
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")
    from dilocox.launch.netns import HUB_ADDR, Cluster

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    lh = f"http://{HUB_ADDR}:29517"
    with Cluster(3, hub=True) as c:
        c.exec_hub(
            [sys.executable, "-m", "dilocox.cli", "lighthouse", "--min-replicas", "2", "--bind", f"{HUB_ADDR}:29517"]
            + ["--insecure"]  # (namespaces of this host only; the workers run without a secret)
            + ["--heartbeat-timeout-ms", "1500", "--join-timeout-ms", "20000"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "lh.err", "w"),
        )
        procs = []
        for r in range(3):
            cmd = [sys.executable, "-m", "tests.elastic_worker", "--lighthouse", lh, "--replica", str(r)]
            cmd += ["--host", c.addr(r), "--out", str(tmp_path / f"r{r}"), "--steps", str(STEPS), "--H", str(H)]
            cmd += ["--step-sleep", "0.3", "--initial-replicas", "3", "--timeout", "8", "--quorum-timeout", "90"]
            procs.append(
                c.exec(
                    r,
                    cmd,
                    cwd=ROOT,
                    env=dict(env, GLOO_SOCKET_IFNAME=c.ifname(r)),
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp_path / f"r{r}.err", "w"),
                )
            )
        deadline = time.monotonic() + 300
        while not any(x["event"] == "sync" and x["step"] >= 8 for x in _records(tmp_path / "r0.jsonl")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no progress"
            time.sleep(0.2)
        subprocess.run(["ip", "-n", c.ns(2), "link", "set", c.ifname(2), "down"], check=True, timeout=10)
        t_down = time.time()
        time.sleep(8.0)
        subprocess.run(["ip", "-n", c.ns(2), "link", "set", c.ifname(2), "up"], check=True, timeout=10)
        t_up = time.time()
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    errs = [open(tmp_path / f"r{r}.err").read()[-2000:] for r in range(3)]
    assert codes == [0, 0, 0], (codes, errs)
    syncs = [x for x in _records(tmp_path / "r0.jsonl") if x["event"] == "sync"]
    during = [x["contributors"] for x in syncs if t_down + 3 < x["t"] < t_up]
    assert during and all(m == [0, 1] for m in during), syncs  # cut off = dead to the others
    assert syncs[-1]["contributors"] == [0, 1, 2], syncs  # back in after the link returned
    healed = [x for x in _records(tmp_path / "r2.jsonl") if x["event"] == "healed"]
    assert healed and healed[0]["t"] > t_up, healed  # took the live state once the link was back
    got = [torch.load(tmp_path / f"r{r}.pt") for r in range(3)]
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]) and torch.equal(got[0][k], got[2][k]), k
