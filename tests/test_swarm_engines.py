"""The membership-engine measurement tool (tools/swarm_engines.py, issue 11 item 6): torchft side only.

hivemind is not a dependency of dilocox (it runs in a separate venv, docs/SWARM.md); here only the
clear error for an interpreter without it is checked. Every peer is its own process, started in its
own session by the tool, killed in ``finally``, and every wait is bounded.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

import pytest

from tools import swarm_engines as engines


def _torchft():
    return pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")


def _args(**kw) -> argparse.Namespace:
    d = dict(
        size=1000,
        rounds=4,
        period=0.5,
        t0_offset=1.0,
        timeout=10.0,
        quorum_timeout=15.0,
        heartbeat_timeout_ms=1000,
        min_matchmaking_time=5.0,
        request_timeout=3.0,
        joiner_initial="same",
        hivemind_python=None,
        kill_round=2,
        restart=False,
        restart_after=1.0,
    )
    d.update(kw)
    return argparse.Namespace(**d)


def test_summarize_median_and_spread():
    s = engines.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (5, 3.0, 1.0, 5.0)
    assert engines.summarize([]) == {"n": 0}


@pytest.mark.parametrize(
    "transport",
    ["tcp", pytest.param("rpc", marks=pytest.mark.slow)],  # gloo: a floor for the docs, not a behaviour
)
def test_round_trip_returns_the_gradient(transport):
    # the client checks the reply is 0.5 * activation (bit for bit) and raises otherwise
    res = engines.measure_rtt(transport, iters=10, warmup=2)
    assert res["bytes_each_way"] == 8 * 128 * 64 * 4
    assert res["ms"]["n"] == 10 and 0 < res["ms"]["min"] <= res["ms"]["median"] <= res["ms"]["max"] < 5000


def test_torchft_average_two_peers_exact_mean():
    _torchft()
    res = engines.measure_average(_args(engine="torchft", peers=2, min_peers=2))
    assert res["failed_rounds"] == 0, res["fail_msgs"]
    assert res["groups"] == [(0, 1)]
    assert res["max_abs_err"] == 0.0  # (1 + 2) / 2 + 0.25 k exactly, on both peers
    assert res["ms"]["n"] == 2 * 3 and res["first_round_ms"]["n"] == 2
    assert res["startup"]["lighthouse_s"] is not None and res["startup"]["start_s"]["n"] == 2


@pytest.mark.fault
@pytest.mark.slow
def test_torchft_recovery_after_kill_within_heartbeat_bound():
    _torchft()
    a = _args(engine="torchft", peers=3, min_peers=2, rounds=6, period=1.0, kill_round=2)
    res = engines.measure_recovery(a)
    # the kill lands half a period before round 2; the survivors' round waits for the 1 s heartbeat timeout
    assert res["kill_to_next_avg_done_s"] is not None
    assert res["kill_to_next_avg_done_s"] < 1.0 + a.period + 5.0, res  # (+ a loaded host's reconfiguration)
    assert {g for _, g in res["groups_after_kill"]} == {(0, 1)}, res
    assert res["failed_after_kill"] == [], res


@pytest.mark.slow
def test_hivemind_without_it_is_a_clear_error():
    if importlib.util.find_spec("hivemind") is not None:
        pytest.skip("hivemind is importable here; the error path needs an interpreter without it")
    r = subprocess.run(
        [sys.executable, "-m", "tools.swarm_engines", "average", "--engine", "hivemind"],
        capture_output=True,
        text=True,
        timeout=120,
        env=engines._env(),
    )
    assert r.returncode == 2
    assert "--hivemind-python" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "tools.swarm_engines", "average", "--engine", "hivemind"]
        + ["--hivemind-python", sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
        env=engines._env(),
    )
    assert r.returncode == 2 and "cannot import hivemind" in r.stderr and "pip install hivemind" in r.stderr


def test_the_tool_runs_from_any_directory(tmp_path):
    """The tool lives in tools/ (not installed): its children get the repository root on PYTHONPATH, so
    ``python -m tools.swarm_engines`` resolves from any working directory."""
    r = subprocess.run(
        [sys.executable, "-m", "tools.swarm_engines", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=engines._env(),
    )
    assert r.returncode == 0 and "python -m tools.swarm_engines" in r.stdout, r.stderr
    assert engines._cmd("py", "rtt")[:3] == ["py", "-m", "tools.swarm_engines"]


def test_footprint_follows_requirements():
    _torchft()
    fp = engines.footprint(["torchft"])
    assert "torchft" in fp["packages"] and "torch" in fp["packages"]
    # torch (and everything else dilocox already requires) is not counted as pulled by torchft
    assert "torchft" in fp["new"] and "torch" not in fp["new"] and fp["MB_new"] > 1
