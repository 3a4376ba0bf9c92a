"""``dilocox swarm --netns [--rate BW]`` (issue 11 point 7): every peer in its own network namespace behind a tc cap,
the store and lighthouses in the hub namespace, the kernel's veth byte counts beside the peers' own link counts."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

import dilocox.launch.netns as netns_mod
from dilocox.cli import main as cli_main
from dilocox.launch.netns import netns_available
from dilocox.swarm.netns import peer_slots
from dilocox.swarm.runtime import SwarmResult, summarize
from tests.spawn import processes_naming
from tests.test_launch_swarm import TINY, _dilocox

NETNS_OK, NETNS_WHY = netns_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli_main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--rate", "100mbit"], "--rate 100mbit needs --netns"),
        (["--netns", "--rate", "fast"], "--rate: bandwidth 'fast' is not a number with a unit"),
        (["--netns", "--rate", "0mbit"], "must be a finite number > 0"),
        (["--netns", "--peers", "200,51"], "--netns: 251 peers, at most 250"),
        (["--peer-rate", "s1p1=20mbit"], "--peer-rate s1p1=20mbit needs --netns"),
        (["--netns", "--peer-rate", "fast"], "--peer-rate 'fast' must be PEER=BW"),
        (["--netns", "--peer-rate", "s1p1=fast"], "--peer-rate s1p1=fast: bandwidth 'fast' is not a number"),
        (["--netns", "--peer-rate", "s9p0=1mbit"], "--peer-rate s9p0: no such peer"),
    ],
)
def test_swarm_netns_flags_bad_input_is_one_line_exit_2(args, needle, capsys, tmp_path):
    rc, _, err = _cli(["swarm", TINY_YAML, *args, "--out", str(tmp_path)], capsys)
    assert rc == 2, err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not os.listdir(tmp_path)  # nothing was started


def test_swarm_netns_without_namespaces_says_why_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(netns_mod, "_probe", (False, "not running as root (network namespaces need CAP_NET_ADMIN)"))
    rc, _, err = _cli(["swarm", TINY_YAML, "--netns", "--rate", "100mbit", "--out", str(tmp_path)], capsys)
    assert rc == 2, err
    assert "--netns: network namespaces are unavailable here: not running as root" in err, err
    assert len(err.strip().splitlines()) == 1, err
    rc, out, _ = _cli(["swarm", "--help"], capsys)
    assert rc == 0 and "--netns" in out and "--rate" in out


@pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable: {NETNS_WHY}")
def test_hub_that_fails_to_start_is_one_line_exit_1(capsys, monkeypatch, tmp_path):
    """The hub process dies at start (here: a port TCPStore refuses): one line naming the hub's own error, exit 1, no
    traceback, no namespace or process left."""
    import dilocox.swarm.netns as swarm_netns

    monkeypatch.setattr(swarm_netns, "STORE_PORT", 70000)
    mine = f"dilocox-{os.getpid()}-"  # the namespaces this process creates (other tests run beside it: -n)
    before = [
        n
        for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
        if n.startswith(mine)
    ]
    rc, _, err = _cli(["swarm", TINY_YAML, "--netns", "--peers", "1,1", "--out", str(tmp_path), *TINY], capsys)
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("swarm job: the swarm hub (store + lighthouses) exited with code"), err
    assert "hub.log" in last and "Traceback" not in err, err
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    after = [n for n in listed.split() if n.startswith(mine)]
    assert after == before, f"namespaces left: {after}"
    assert not _left_in(str(tmp_path))


# a child's ready line (the hub's addresses): each way it can fail is named right, and none waits out start_s
READY_CASES = [
    # (child's script, start_s, exit_s, expected (line, why), at most seconds)
    ("print('{}', flush=True); import time; time.sleep(30)", 30, 10, ("{}\n", ""), 20),
    # its output ends (EOF) a moment before it exits: the exit code, not "printed nothing" (issue 19)
    ("import os, time; os.close(1); time.sleep(0.5); raise SystemExit(3)", 30, 10, (None, "exited with code 3"), 20),
    # it exits while a child of its holds its output open: the exit code at once, not after start_s
    (
        "import subprocess, sys; subprocess.Popen(['sleep', '30']); sys.exit(4)",
        30,
        10,
        (None, "exited with code 4"),
        20,
    ),
    (
        "import os, time; os.close(1); time.sleep(30)",
        30,
        0.5,
        (None, "closed its output without printing x but was still running 0.5s later"),
        20,
    ),
    ("import time; time.sleep(30)", 1, 10, (None, "printed no x within 1s"), 20),
]


@pytest.mark.parametrize("script, start_s, exit_s, want, most_s", READY_CASES)
def test_ready_line_names_why_a_child_printed_none(script, start_s, exit_s, want, most_s):
    import contextlib
    import signal
    import sys
    import time

    from dilocox.swarm.netns import ready_line

    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert ready_line(p, start_s, "x", exit_s=exit_s) == want
        assert time.monotonic() - t0 < most_s
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # (the group: the sleeping child of the third case too)
        p.wait(timeout=30)


def test_peer_slots_and_summary_show_veth_bytes_beside_link_bytes():
    assert peer_slots([2, 1, 3]) == {"s0p0": 0, "s0p1": 1, "s1p0": 2, "s2p0": 3, "s2p1": 4, "s2p2": 5}
    recs = [{"step": k, "sync_s": 0.0, "link_bytes": {"s1p0": [1_000_000, 500_000]}} for k in range(2)]
    res = SwarmResult("o", {"s0p0": 0, "s1p0": 0}, 1.0, records={"s0p0": recs}, net_bytes={"s0p0": (3_000_000, 2e6)})
    lines = summarize(res).splitlines()
    assert lines[1].endswith("; veth tx 3.000 MB rx 2.000 MB (links: 2.000 / 1.000)"), lines
    assert "veth" not in lines[2]  # no counters for that peer: nothing printed


def _left_in(out_dir: str) -> list[str]:
    """Live processes whose command line names ``out_dir`` (peers or the hub that outlived the job)."""
    return processes_naming(out_dir, "dilocox.swarm.")


@pytest.mark.slow
@pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable: {NETNS_WHY}")
def test_swarm_2x2_in_namespaces_counts_bytes_and_leaves_nothing(tmp_path):
    out = str(tmp_path / "job")
    p = _dilocox(
        ["swarm", "configs/tiny.yaml", "--peers", "2,2", "--steps", "2", "--out", out, "--timeout-s", "150",
         "--netns", "--rate", "100mbit", "--peer-rate", "s1p1=50mbit", *TINY],
        timeout=200,
    )  # fmt: skip
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    m = re.search(
        r"--netns: 4 peers in namespaces (dilocox-\d+-\d+)-r0\.\.r3 \(s0p0 198\.18\.0\.1, .*s1p1 198\.18\.0\.4\)"
        r".* links 100 Mbit/s \(tc tbf\); s1p1 50 Mbit/s each way",
        p.stderr,
    )
    assert m, p.stderr[-3000:]
    veth, links = {}, {}
    for name in ("s0p0", "s0p1", "s1p0", "s1p1"):
        line = next((x for x in p.stdout.splitlines() if x.strip().startswith(f"{name}: exit 0, 2 steps")), None)
        assert line, p.stdout
        g = re.search(r"veth tx ([\d.]+) MB rx ([\d.]+) MB \(links: ([\d.]+) / ([\d.]+)\)", line)
        assert g, line
        veth[name] = (float(g[1]) * 1e6, float(g[2]) * 1e6)
        with open(os.path.join(out, f"{name}.jsonl")) as f:
            links[name] = [r.get("link_bytes", {}) for r in map(json.loads, f)]
    # what each stage-0 peer counted on its links to stage 1 (both ways) crossed its own veth ...
    for name in ("s0p0", "s0p1"):
        sent = sum(v[0] for rec in links[name] for v in rec.values())
        got = sum(v[1] for rec in links[name] for v in rec.values())
        assert 0 < sent <= veth[name][0] and 0 < got <= veth[name][1], (name, sent, got, veth[name])
        # ... and its veth carried not much else (stage sync, store, lighthouse heartbeats, headers): a sane factor
        assert veth[name][0] <= 40 * sent, (name, sent, veth[name])
    # and the receiving stage-1 peer's veth: what stage 0 sent to it came in, its replies went out
    for name in ("s1p0", "s1p1"):
        to = sum(rec.get(name, [0, 0])[0] for s in ("s0p0", "s0p1") for rec in links[s])
        back = sum(rec.get(name, [0, 0])[1] for s in ("s0p0", "s0p1") for rec in links[s])
        assert 0 < to <= veth[name][1] and 0 < back <= veth[name][0], (name, to, back, veth[name])
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert m[1] not in listed, f"namespaces of {m[1]} left: {listed}"
    assert not _left_in(out), "a process outlived the job"


@pytest.mark.slow
@pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable: {NETNS_WHY}")
def test_rebalancing_in_namespaces_moves_a_peer(tmp_path):
    """--netns with rebalancing: the launcher's rebalancing thread enters the hub namespace (setns, that thread only)
    and reaches the store and every peer from there; [2, 1] with stage 1 paced: a stage-0 peer moves to stage 1
    (same process, same namespace and address; its command keeps ``-- --swarm.host=...``), serves, and stage 1's
    peers end bit-identical; nothing is left over."""
    import torch

    from dilocox.config import load_config
    from dilocox.swarm.netns import netns_launcher
    from dilocox.swarm.runtime import launch

    over = [
        "--model.n_layers=2", "--model.d_model=64", "--data.max_bytes=200000", "--train.batch_size=8",
        "--train.seq_len=32", "--optim.warmup_steps=0", "--optim.schedule=constant", "--swarm.microbatch_size=2",
        "--swarm.max_inflight=4", "--swarm.step_timeout_s=60", "--swarm.sync_timeout_s=60",
        "--swarm.rpc_timeout_s=20", "--swarm.ban_s=0.5", "--swarm.rebalance_period_s=2",
    ]  # fmt: skip
    cfg = load_config(TINY_YAML, over)
    out = str(tmp_path / "job")
    res = launch(
        cfg, out, peers_per_stage=[2, 1], steps=40, timeout_s=240, stage_paces={1: 0.08}, launcher=netns_launcher()
    )
    for name, rc in res.returncodes.items():
        assert rc == 0, f"{name} exited {rc}:\n{res.log_tail(name)}"
    with open(os.path.join(out, "rebalance.jsonl")) as f:
        moves = [json.loads(line) for line in f]
    done = [m for m in moves if "line" in m]
    assert len(done) == 1 and not any("error" in m for m in moves), moves
    assert done[0]["from"] == 0 and done[0]["to"] == 1 and done[0]["joiner"] == "s1p1", done[0]
    served = [r for r in res.records["s1p1"] if not r.get("joined")]
    assert served and sum(r["microbatches"] for r in served) > 0, "the moved peer never served"
    a, b = res.peers["s1p0"]["params"], res.peers["s1p1"]["params"]
    assert all(torch.equal(a[n], b[n]) for n in a), "the moved peer differs from its new stage"
    assert set(res.net_bytes) == {"s0p0", "s0p1", "s1p0"}  # the kernel's counts of the three namespaces
    assert not _left_in(out), "a process outlived the job"
