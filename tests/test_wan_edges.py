"""Edges of the WAN emulation (dilocox/launch): the token-bucket fallback's per-rank cap, bad link values refused by
name, the delay switch's start-up wait, and the namespace probe (threads, a stale probe namespace, a kernel without
tbf) and a stale namespace that already carries a new Cluster's name (pid reuse).

The tests that create namespaces need root, ``ip`` and ``tc``; they are skipped with the reason elsewhere."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import pytest

import dilocox.launch.emulate as emulate
from dilocox.launch import netns
from dilocox.launch.netns import Cluster, netns_available
from dilocox.launch.switch import SwitchError, argv, wait_ready

OK, WHY = netns_available()
needs_netns = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")


def _listed() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout


def test_token_bucket_cap_is_shared_by_a_replicas_ranks(monkeypatch):
    """Each rank paces its own outer traffic at BANDWIDTH_ENV; a replica's N ranks share its link (one tbf under
    netns), so each gets cap / N (as ``launch --elastic`` and ``bench wan`` give them). It used to get the whole cap:
    a replica of 2 ranks moved 200 Mbit/s over a "100mbit" link."""
    seen = {}
    monkeypatch.setattr(emulate, "netns_available", lambda: (False, "test"))
    monkeypatch.setattr(emulate, "supervise", lambda argv, env, *a, **kw: seen.update(env=env) or 0)
    logs: list[str] = []
    assert emulate.launch(None, 2, 2, "100mbit", entry=["x.py"], emulation="token-bucket", log=logs.append) == [0]
    assert seen["env"][emulate.BANDWIDTH_ENV] == f"{100e6 / 2:.0f}"
    assert "per rank" in logs[0]
    seen.clear()
    assert emulate.launch(None, 2, 2, None, entry=["x.py"], emulation="token-bucket", log=logs.append) == [0]
    assert emulate.BANDWIDTH_ENV not in seen["env"] or not seen["env"][emulate.BANDWIDTH_ENV]


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"rtt_ms": -5.0}, "rtt_ms=-5"),  # these four used to turn the delay switch off without a word
        ({"rtt_ms": math.nan}, "rtt_ms=nan"),
        ({"jitter_ms": math.nan}, "jitter_ms=nan"),
        ({"loss": -0.1}, "loss=-0.1"),
        ({"loss": math.nan}, "loss=nan"),
        ({"rtt_ms": math.inf}, "rtt_ms=inf"),  # used to start the switch with an infinite delay
        ({"latency_ms": -1.0}, "latency_ms=-1"),  # used to become a tbf queue bound of 859 s
        ({"latency_ms": 0.0}, "latency_ms=0"),
        ({"rate_mbit": math.inf}, "rate_mbit=inf"),  # used to raise OverflowError
        ({"rate_mbit": 1e-7}, "rate_mbit=1e-07"),  # used to become tc's "rate 0bit"
        ({"burst_bytes": -5}, "burst_bytes=-5"),
    ],
)
def test_bad_link_values_are_refused_naming_the_field(kw, field):
    kw = {"rate_mbit": 10.0, **kw}
    with pytest.raises(ValueError, match=f"^{field}"):
        Cluster(2, **kw)  # refused when built: no namespace needed


def test_switch_argv_refuses_a_non_finite_delay():
    for rtt, jitter in ((math.inf, 0.0), (math.nan, 0.0), (10.0, math.nan)):
        with pytest.raises(SwitchError, match="need latency >= jitter >= 0, both finite"):
            argv([], rtt, jitter)


def test_wait_ready_on_a_switch_that_closed_its_output_but_runs_on():
    """EOF on stdout while the process still runs: one prompt, true line (it used to wait 5 s more and say
    "exited with code None")."""
    code = "import os, time; os.close(1); time.sleep(30)"
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(SwitchError, match=r"closed its output without a ready line \(still running\)$"):
            wait_ready(p, "test", timeout_s=10)
        assert time.monotonic() - t0 < 4.5
    finally:
        p.kill()
        p.wait(timeout=10)


@needs_netns
def test_probe_is_thread_safe_and_removes_a_stale_probe_namespace(monkeypatch):
    """Threads asking at once shared one probe name: the losers got "File exists", and a False could be cached for
    the process; a probe namespace left by a dead process with our pid did the same."""
    name = f"dilocox-{os.getpid()}-probe"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    try:
        for _ in range(2):  # the stale namespace first, then a plain race
            monkeypatch.setattr(netns, "_probe", None)
            got: list[tuple[bool, str]] = []
            threads = [threading.Thread(target=lambda: got.append(netns.netns_available())) for _ in range(4)]
            [t.start() for t in threads]
            [t.join(timeout=60) for t in threads]
            assert got == [(True, "")] * 4, got
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    assert name not in _listed()


@needs_netns
def test_probe_says_no_where_the_kernel_has_no_tbf(monkeypatch, tmp_path):
    """A kernel (or container) without sch_tbf: the probe used to say yes, and `dilocox launch` failed on its tc
    command instead of falling back to the token bucket."""
    fake = tmp_path / "tc"
    fake.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = tbf ] && { echo \'Error: Specified qdisc kind is unknown.\' >&2;'
        ' exit 2; }; done\nexec tc.real "$@"\n'
    )
    fake.chmod(0o755)
    real = tmp_path / "tc.real"
    real.symlink_to(subprocess.run(["sh", "-c", "command -v tc"], capture_output=True, text=True).stdout.strip())
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(netns, "_probe", None)
    ok, why = netns.netns_available()
    assert not ok and "tbf" in why and "Specified qdisc kind is unknown" in why, why
    assert f"dilocox-{os.getpid()}-probe" not in _listed()


@needs_netns
def test_a_dead_runs_namespace_with_our_name_does_not_block_start():
    """Names are dilocox-<pid>-<counter>-...: after pid reuse (the old launcher and its reaper SIGKILLed together)
    a new run's name can exist already; `ip netns add` used to fail on it."""
    c = Cluster(2, 10.0)
    subprocess.run(["ip", "netns", "add", c.switch], check=True, capture_output=True, timeout=30)
    try:
        with c:
            assert all(ns in _listed() for ns in c.namespaces())
            assert (
                "tbf"
                in subprocess.run(
                    ["tc", "-n", c.ns(0), "qdisc", "show", "dev", c.ifname(0)], capture_output=True, text=True
                ).stdout
            )
    finally:
        subprocess.run(["ip", "netns", "del", c.switch], capture_output=True, timeout=30)
    assert not any(ns in _listed() for ns in c.namespaces())
