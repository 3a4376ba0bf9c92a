"""Elastic launch (issue 10 §4): ``dilocox lighthouse``, ``dilocox launch --elastic`` process handling, the
elastic sbatch layout, and ``dilocox bench elastic``'s analysis on synthetic metrics.

The replicas here are fake short jobs (a Python script that starts a grandchild in its own session, as
``dilocox train --nproc K`` starts torchrun): the tests check the schedule (kill = the whole job, the
other-session grandchild included; restart = the same command), the events file, signal forwarding,
the bounded run time, and that nothing is left behind. Every test fails on the code before
``dilocox/elastic/launch.py`` existed (no module, no ``lighthouse`` command, no ``--elastic``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dilocox.distributed.signals import tagged_pids
from dilocox.elastic.launch import Action, ElasticLaunch, LaunchError, parse_schedule
from dilocox.launch.netns import Cluster, netns_available
from tests.fake_slurm import run_fake_sbatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launcher", "slurm", "elastic.sbatch")
NETNS_OK, NETNS_WHY = netns_available()
try:
    import torchft  # noqa: F401

    HAVE_TORCHFT = True
except ImportError:
    HAVE_TORCHFT = False
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")

# A replica job: writes its pid and a grandchild's (own session, like torchrun under `dilocox train --nproc`),
# beats once per 0.1 s, exits 0 after DURATION s; on SIGTERM writes "term" and exits 0 (unless IGNORE_TERM).
FAKE_REPLICA = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    r, out, duration, ignore_term = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    me = f"{out}/r{r}.{os.getpid()}"
    open(me + ".pids", "w").write(f"{os.getpid()} {child.pid}\\n")
    def on_term(signum, frame):
        if ignore_term:
            return
        open(me + ".term", "w").write("term")
        if r == 0:  # (as the trainer's logger says it; replica 1 says nothing: the launcher names its exit code)
            print(f"[t] interrupted by SIGTERM at step 7; checkpoint ck/step_7; run the same command again", flush=True)
        child.kill()
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    t0 = time.time()
    while time.time() - t0 < duration:
        time.sleep(0.1)
    child.kill()
    child.wait()
    open(me + ".done", "w").write("done")
    """
)
FAKE_LIGHTHOUSE = [sys.executable, "-c", "import time; print('x: http://127.0.0.1:1', flush=True); time.sleep(120)"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _events(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def _fake(tmp_path, duration: float, ignore_term: bool = False):
    script = tmp_path / "fake_replica.py"
    script.write_text(FAKE_REPLICA)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return lambda r, addr: [sys.executable, str(script), str(r), str(out), str(duration), "1" if ignore_term else "0"]


def _incarnations(tmp_path, r: int) -> list[tuple[int, int, bool, bool]]:
    """(pid, grandchild pid, finished, got SIGTERM) of each start of replica r, in start order."""
    out = tmp_path / "out"
    rows = []
    for p in sorted(out.glob(f"r{r}.*.pids"), key=os.path.getmtime):
        pid, child = map(int, p.read_text().split())
        base = str(p)[: -len(".pids")]
        rows.append((pid, child, os.path.exists(base + ".done"), os.path.exists(base + ".term")))
    return rows


# --------------------------------------------------------------------------- the schedule


def test_parse_schedule_sorts_and_checks():
    acts = parse_schedule(["1@10", "2@3.5"], ["1@20.5"], 3)
    assert acts == [Action("kill", 2, 3.5), Action("kill", 1, 10.0), Action("restart", 1, 20.5)]
    assert parse_schedule([], [], 1) == []
    for kills, restarts, msg in (
        (["1"], [], "is not R@SECONDS"),
        (["a@3"], [], "is not R@SECONDS"),
        (["3@1"], [], "replica 3 is not in [0, 3)"),
        (["1@-2"], [], ">= 0"),
        (["1@nan"], [], ">= 0"),
        ([], ["1@5"], "restart needs an earlier --kill 1@SECONDS"),
        (["1@5"], ["1@2"], "restart needs an earlier --kill"),
        (["1@2", "1@4"], [], "already killed"),
    ):
        with pytest.raises(LaunchError, match=msg.replace("[", r"\[").replace(")", r"\)")):
            parse_schedule(kills, restarts, 3)


# --------------------------------------------------------------------------- dilocox lighthouse


@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed (pip install torchft==0.2.0)")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_lighthouse_command_starts_serves_and_stops(sig):
    p = subprocess.Popen(
        [sys.executable, "-m", "dilocox.cli", "lighthouse", "--min-replicas", "2", "--bind", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        line = p.stdout.readline()  # bounded: the process is killed in `finally` if the test times out
        assert line.startswith("dilocox lighthouse: http://127.0.0.1:"), line
        port = int(line.split()[2].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it listens where it says
        time.sleep(0.3)
        assert p.poll() is None  # runs in the foreground until told to stop
        p.send_signal(sig)
        rc = p.wait(timeout=15)
        assert rc == 0, p.stderr.read()
        assert f"stopped ({signal.Signals(sig).name})" in p.stderr.read()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


QUIET_PROBE = textwrap.dedent(
    """
    import os, sys, time
    from dilocox.elastic.lighthouse import quiet_rust_log, start_lighthouse
    with (quiet_rust_log() if sys.argv[1] == "quiet" else open(__file__)):
        lh = start_lighthouse(min_replicas=1, bind="127.0.0.1:0")
    print(os.environ.get("RUST_LOG"))  # (put back after: the peers a job starts keep their own default)
    time.sleep(0.3)  # (its first quorum tick logs too)
    lh.shutdown()
    """
)


@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed (pip install torchft==0.2.0)")
@pytest.mark.parametrize("how", ["default", "quiet", "quiet, RUST_LOG=info"])
def test_a_lighthouse_in_a_jobs_own_process_keeps_its_info_lines_off_the_console(how, tmp_path):
    """Bug: ``dilocox swarm`` (its lighthouses live in the job's process) printed torchft's INFO lines on the console,
    several per quorum (~800 lines in 35 s of a 2 x 2 job). Under ``quiet_rust_log`` none come; a RUST_LOG the user
    set is kept (the lines are back with info); without it they come (the control)."""
    (tmp_path / "probe.py").write_text(QUIET_PROBE)
    env = {k: v for k, v in ENV.items() if k != "RUST_LOG"}
    if how.endswith("info"):
        env["RUST_LOG"] = "info"
    p = subprocess.run([sys.executable, str(tmp_path / "probe.py"), how.split(",")[0]], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("Lighthouse listening on" in p.stderr) == (how != "quiet"), p.stderr[-2000:]
    assert p.stdout.strip() == ("info" if how.endswith("info") else "None")
    if how == "quiet":
        assert "[torchft::" not in p.stderr, p.stderr[-2000:]


def test_lighthouse_command_rejects_bad_input(capsys):
    from dilocox.cli import main

    for args, msg in (
        (["--min-replicas", "0"], "--min-replicas 0 must be >= 1"),
        (["--min-replicas", "1", "--bind", "nohostport"], "is not HOST:PORT"),
        (["--min-replicas", "1", "--heartbeat-timeout-ms", "0"], "--heartbeat-timeout-ms 0 must be >= 1"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["lighthouse", *args])
        assert e.value.code == 2 and msg in capsys.readouterr().err


# --------------------------------------------------------------------------- launch --elastic, fake replicas


@pytest.mark.fault
@pytest.mark.slow
def test_elastic_launch_kills_and_restarts_on_schedule(tmp_path):
    run_dir = tmp_path / "run"
    la = ElasticLaunch(
        3,
        _fake(tmp_path, duration=5.0),
        str(run_dir),
        schedule=parse_schedule(["1@1.5"], ["1@3"], 3),
        env=ENV,
        lighthouse_argv=lambda bind: FAKE_LIGHTHOUSE,
        timeout_s=60,
        stop_timeout_s=5,
        log=lambda m: None,
    )
    t0 = time.monotonic()
    rc = la.run()
    wall = time.monotonic() - t0
    assert rc == 0
    assert wall < 30, wall  # 3 + 5 s of replica time, plus start-up
    ev = _events(run_dir)
    kinds = [(e["event"], e.get("replica")) for e in ev]
    assert kinds[0] == ("lighthouse", None) and ev[0]["address"] == "http://127.0.0.1:1"
    assert kinds[1:4] == [("start", 0), ("start", 1), ("start", 2)]
    kill = next(e for e in ev if e["event"] == "kill")
    restart = next(e for e in ev if e["event"] == "restart")
    assert kill["replica"] == restart["replica"] == 1 and restart["incarnation"] == 1
    start_t = ev[1]["t"]
    assert 1.5 <= kill["t"] - start_t < 3.0, ev
    assert 3.0 <= restart["t"] - start_t < 4.5, ev
    exits = {e["replica"]: e for e in ev if e["event"] == "exit"}
    assert set(exits) == {0, 1, 2} and all(e["code"] == 0 for e in exits.values())
    assert exits[1]["incarnation"] == 1 and exits[1]["t"] > exits[0]["t"]  # the restarted one ran 5 s from 3 s
    assert all(e["wall"] > 1e9 for e in ev)  # epoch seconds, to line up with the replicas' metrics
    # replica 1, first start: killed (never finished), its other-session grandchild too; second start finished
    first, second = _incarnations(tmp_path, 1)
    assert first[2] is False and second[2] is True
    assert not _alive(first[0]) and not _alive(first[1])
    assert [row[2] for r in (0, 2) for row in _incarnations(tmp_path, r)] == [True, True]
    for rep in la.replicas:
        assert tagged_pids(rep.tag) == []
    assert la.lighthouse.poll() is not None  # the lighthouse is stopped at the end
    assert ev[-1]["event"] == "lighthouse_stopped"


def test_elastic_launch_timeout_kills_everything(tmp_path):
    """Replicas that ignore SIGTERM and would run 120 s: --timeout 2 ends the run in bounded time."""
    run_dir = tmp_path / "run"
    la = ElasticLaunch(
        2,
        _fake(tmp_path, duration=120.0, ignore_term=True),
        str(run_dir),
        env=ENV,
        lighthouse_argv=lambda bind: FAKE_LIGHTHOUSE,
        timeout_s=2.0,
        stop_timeout_s=1.0,
        log=lambda m: None,
    )
    t0 = time.monotonic()
    assert la.run() == 124
    assert time.monotonic() - t0 < 20
    for r in range(2):
        for pid, child, done, term in _incarnations(tmp_path, r):
            assert not done and not term
            assert not _alive(pid) and not _alive(child)
    assert [e["event"] for e in _events(run_dir)].count("stop") == 1


def test_elastic_launch_forwards_sigterm(tmp_path):
    """SIGTERM to the launcher: each replica gets SIGTERM (saves and exits), the launcher exits 143, nothing is left."""
    run_dir = tmp_path / "run"
    script = tmp_path / "fake_replica.py"
    script.write_text(FAKE_REPLICA)
    (tmp_path / "out").mkdir()
    driver = textwrap.dedent(
        f"""
        import sys
        from dilocox.elastic.launch import ElasticLaunch
        argv = lambda r, a: [sys.executable, {str(script)!r}, str(r), {str(tmp_path / "out")!r}, "60", "0"]
        la = ElasticLaunch(2, argv, {str(run_dir)!r}, lighthouse_argv=lambda b: {FAKE_LIGHTHOUSE!r}, timeout_s=60,
                           stop_timeout_s=10, log=lambda m: print(m, file=sys.stderr, flush=True))
        sys.exit(la.run())
        """
    )
    err = open(tmp_path / "console", "w")
    p = subprocess.Popen([sys.executable, "-c", driver], env=ENV, start_new_session=True, stderr=err)
    try:
        deadline = time.monotonic() + 30
        while len(list((tmp_path / "out").glob("*.pids"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list((tmp_path / "out").glob("*.pids"))) == 2
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    for r in range(2):
        ((pid, child, done, term),) = _incarnations(tmp_path, r)
        assert term and not done
        assert not _alive(pid) and not _alive(child)
    ev = _events(run_dir)
    assert any(e["event"] == "stop" and e["signal"] == "SIGTERM" for e in ev)
    # the console says it (it said nothing: the lines were only in replicaN.log): where each replica stopped, and how
    # to resume
    console = (tmp_path / "console").read_text().splitlines()
    assert (
        "dilocox launch: replica 0: interrupted by SIGTERM at step 7; checkpoint ck/step_7; run the same command "
        "again" in console
    ), console
    assert f"dilocox launch: replica 1: exit code 0; its log names no checkpoint ({run_dir}/replica1.log)" in console
    assert console[-1].startswith("dilocox launch: interrupted (SIGTERM); the replicas were asked to save"), console
    assert console[-1].endswith("run the same command again to resume"), console


@pytest.mark.slow
@pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable: {NETNS_WHY}")
@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed")
def test_elastic_launch_in_namespaces_reaches_the_lighthouse(tmp_path):
    """netns: the real `dilocox lighthouse` runs in the switch namespace; every replica namespace reaches it at the
    address the launcher hands out, and the replica is told its own address (DILOCOX_ELASTIC_HOST)."""
    out = tmp_path / "out"
    out.mkdir()
    probe = textwrap.dedent(
        """
        import os, socket, sys
        r, addr, out = sys.argv[1], sys.argv[2], sys.argv[3]
        host, port = addr[len("http://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10):
            pass
        open(f"{out}/r{r}", "w").write(os.environ["DILOCOX_ELASTIC_HOST"] + " " + os.environ["GLOO_SOCKET_IFNAME"])
        """
    )
    script = tmp_path / "probe.py"
    script.write_text(probe)
    with Cluster(3, 100, hub=True) as c:
        la = ElasticLaunch(
            3,
            lambda r, addr: [sys.executable, str(script), str(r), addr, str(out)],
            str(tmp_path / "run"),
            min_replicas=2,
            env=ENV,
            cluster=c,
            timeout_s=60,
            log=lambda m: None,
        )
        assert la.run() == 0
        assert la.lighthouse_addr == "http://198.18.0.254:29510"
        names = c.namespaces()
    for r in range(3):
        assert (out / f"r{r}").read_text() == f"198.18.0.{r + 1} dxv{r}"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names)


def test_launch_cli_routes_elastic_and_reports_bad_schedule(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.cli",
            "launch",
            "--elastic",
            "3",
            os.path.join(ROOT, "configs", "tiny.yaml"),
            "--kill",
            "5@10",
            f"--log.run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert p.returncode == 2 and "replica 5 is not in [0, 3)" in p.stderr, p.stderr


# --------------------------------------------------------------------------- launcher/slurm/elastic.sbatch

SLURM_STUBS = {
    "scontrol": 'for h in $FAKE_HOSTS; do echo "$h"; done',
    # srun: log the step's nodes, run the task once per node of --nodelist (in the background steps interleave:
    # the test compares sorted lines)
    "srun": 'list=""\nwhile [[ $1 == --* ]]; do [[ $1 == --nodelist=* ]] && list=${1#--nodelist=}; shift; done\n'
    'IFS=, read -ra nodes <<< "$list"\n'
    'for h in "${nodes[@]}"; do SLURMD_NODENAME=$h "$@" || exit $?; done',
    "torchrun": 'echo "$SLURMD_NODENAME torchrun $*" >> "$LOG"',
    "fakepython": 'echo "$SLURMD_NODENAME python $*" >> "$LOG"',
}


def run_elastic_sbatch(tmp_path, hosts: str, **extra) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = dict(
        FAKE_HOSTS=hosts,
        SLURM_JOB_NODELIST="fake",
        DILOCOX_RUN_DIR=str(tmp_path / "run"),
        DILOCOX_LIGHTHOUSE_WAIT_S="0",
        PYTHON="fakepython",
        **extra,
    )
    p, lines = run_fake_sbatch(tmp_path, SBATCH, SLURM_STUBS, ["configs/x.yaml", "--train.steps=3"], env)
    return p, sorted(lines)


def test_elastic_sbatch_parses():
    p = subprocess.run(["bash", "-n", SBATCH], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_elastic_sbatch_one_step_per_replica_lighthouse_on_first_node(tmp_path):
    p, lines = run_elastic_sbatch(tmp_path, "gpu03 gpu04 gpu07 gpu08", DILOCOX_NODES_PER_REPLICA="2")
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    lh = "http://gpu03:29510"

    def replica(r: int, node: str, first: str) -> str:
        return (
            f"{node} python -m dilocox.launch.local_run --multi-host --nnodes 2 --nproc_per_node 8 --max-restarts 0 "
            f"--rdzv_backend c10d --rdzv_endpoint "
            f"{first}:29500 --rdzv_id 42-r{r} -m dilocox.cli train configs/x.yaml --train.steps=3 "
            f"--parallel.replicas=1 --outer.elastic.enabled=true --outer.elastic.lighthouse={lh} "
            f"--outer.elastic.replica_rank={r} --outer.elastic.min_replicas=1 --outer.elastic.initial_replicas=2 "
            f"--log.run_dir={run}/replica{r} --security.secret_file={run}/secret --outer.elastic.lighthouse_auth=true"
        )

    want = [
        "gpu03 python -m dilocox.cli lighthouse --min-replicas 1 --bind 0.0.0.0:29510 --heartbeat-timeout-ms 5000 "
        f"--join-timeout-ms 60000 --secret-file {run}/secret",
        replica(0, "gpu03", "gpu03"),
        replica(0, "gpu04", "gpu03"),
        replica(1, "gpu07", "gpu07"),
        replica(1, "gpu08", "gpu07"),
    ]
    assert lines == sorted(want)
    assert "2 replicas x 2 node(s)" in p.stdout
    # the run secret: written once, mode 0600, 32 bytes as hex (docs/SECURITY.md); a second job keeps it
    secret = run / "secret"
    assert (secret.stat().st_mode & 0o777) == 0o600 and len(bytes.fromhex(secret.read_text())) == 32
    before = secret.read_text()
    p2, _ = run_elastic_sbatch(tmp_path, "gpu03 gpu04 gpu07 gpu08", DILOCOX_NODES_PER_REPLICA="2")
    assert p2.returncode == 0, p2.stderr
    assert secret.read_text() == before
    # DILOCOX_LIGHTHOUSE_AUTH=0: a plain lighthouse (--insecure: it binds 0.0.0.0), and the replicas do not try to
    # authenticate to it (said explicitly: lighthouse_auth follows security.authenticate by default, issue 42)
    (tmp_path / "plain").mkdir()
    p3, plain = run_elastic_sbatch(
        tmp_path / "plain", "gpu03 gpu04", DILOCOX_NODES_PER_REPLICA="1", DILOCOX_LIGHTHOUSE_AUTH="0"
    )
    assert p3.returncode == 0, p3.stderr
    lh_lines = [x for x in plain if " lighthouse " in x]
    rep_lines = [x for x in plain if " train " in x]
    assert len(lh_lines) == 1 and lh_lines[0].endswith("--insecure") and "--secret-file" not in lh_lines[0], plain
    assert rep_lines and all(x.endswith("--outer.elastic.lighthouse_auth=false") for x in rep_lines), rep_lines


def test_elastic_sbatch_rejects_uneven_layout(tmp_path):
    p, lines = run_elastic_sbatch(tmp_path, "n1 n2 n3", DILOCOX_NODES_PER_REPLICA="2")
    assert p.returncode == 2 and "3 nodes are not a multiple of DILOCOX_NODES_PER_REPLICA=2" in p.stderr
    assert lines == []


# --------------------------------------------------------------------------- bench elastic: analysis


def _synthetic(kill: bool) -> dict:
    """3 replicas, 0.1 s per step, an outer step every 10 steps, 300 steps from 1 s after the launch (wall 1000).
    With ``kill``: replica 2 SIGKILLed at 1011.05 (after its step 100); the survivors stall 2 s before step 110
    (detection); replica 2 restarted at 1021.0 logs its first step at 1026.0 as step 220 (live join)."""
    t0 = 1000.0
    ev = [{"event": "lighthouse", "wall": t0 - 0.5}] + [{"event": "start", "replica": r, "wall": t0} for r in range(3)]

    def wall(s: int) -> float:
        return t0 + 1.0 + 0.1 * s + (2.0 if kill and s >= 110 else 0.0)

    reps = []
    for r in range(3):
        steps = [
            {"step": s, "wall": round(wall(s), 3), "outer_step": s // 10, "tokens_per_s": 1e4}
            for s in range(1, 301)
            if not (kill and r == 2 and 100 < s < 220)
        ]
        for x in steps:
            if x["step"] % 100 == 0:
                x["val_loss"] = 3.0 - x["step"] / 300
        reps.append({"steps": steps, "summary": {"final_val_loss": 2.0 + (0.02 if kill else 0.0)}})
    if kill:
        ev += [
            {"event": "kill", "replica": 2, "wall": t0 + 11.05},
            {"event": "restart", "replica": 2, "wall": t0 + 21.0},
        ]
        for x in reps[2]["steps"]:
            if x["step"] >= 220:
                x["wall"] = round(wall(x["step"]) + (26.0 - 25.0), 3)  # the joiner runs 1 s behind the others
    return {"events": ev, "replicas": reps}


def test_bench_elastic_analysis_on_synthetic_metrics():
    from dilocox.bench.elastic import analyze

    full = analyze(_synthetic(False), 1000, victim=2)
    assert full["tokens_per_s"] == pytest.approx(3 * 10 * 1000, rel=0.01)
    assert full["wall_s"] == pytest.approx(31.0)
    assert full["ready_t"] == pytest.approx(1.1) and full["end_t"] == pytest.approx(31.0)  # the bench's schedule
    cut = analyze(_synthetic(True), 1000, victim=2)
    assert cut["kill_t"] == pytest.approx(11.05)
    # survivors' outer step 10 -> 11 lands with step 110 at 1000 + 1 + 11 + 2 = 1014.0
    assert cut["kill_to_next_outer_s"] == pytest.approx(14.0 - 11.05, abs=1e-6)
    # outer steps every 1.0 s before the kill; the one across it took 3.0 s: 2.0 s beyond (the injected stall)
    assert cut["outer_interval_s"] == pytest.approx(1.0) and cut["kill_extra_s"] == pytest.approx(2.0)
    # before: steps 2..100 of 3 replicas over (1001.1, 1011.05]
    assert cut["tokens_per_s_before"] == pytest.approx(3 * 99 * 1000 / 9.95)
    # outage: survivors' steps 101..109 and 110..230 (wall <= 1026.0), nothing from the victim
    assert cut["tokens_per_s_outage"] == pytest.approx(2 * (9 + 121) * 1000 / (26.0 - 11.05), rel=1e-4)
    assert cut["outage_ratio"] == pytest.approx(cut["tokens_per_s_outage"] / cut["tokens_per_s_before"])
    assert 0.55 < cut["outage_ratio"] < 0.6  # 2 of 3 replicas, minus the 2 s detection stall
    assert cut["rejoin_first_step_s"] == pytest.approx(5.0) and cut["rejoin_at_step"] == 220
    assert cut["rejoin_outer_step_s"] == pytest.approx(6.0)  # step 230 (outer step 23) at 1027.0
    # after: all three from the rejoin to the first end (survivors' step 300 at 1033.0)
    assert cut["tokens_per_s_after"] == pytest.approx((2 * 70 + 70) * 1000 / 7.0, rel=1e-3)  # victim: 221..290


def test_bench_elastic_analysis_without_a_rejoin():
    """The victim never comes back: the outage runs to the survivors' end, not to the victim's last record."""
    from dilocox.bench.elastic import analyze

    run = _synthetic(True)
    run["events"] = [e for e in run["events"] if e["event"] != "restart"]
    run["replicas"][2]["steps"] = [x for x in run["replicas"][2]["steps"] if x["step"] <= 100]
    cut = analyze(run, 1000, victim=2)
    assert cut["end_t"] == pytest.approx(33.0)  # survivors' step 300 at 1 + 30 + 2
    assert cut["tokens_per_s_outage"] == pytest.approx(2 * 200 * 1000 / (33.0 - 11.05), rel=1e-4)
    assert cut["tokens_per_s_after"] is None and "rejoin_first_step_s" not in cut


def test_bench_elastic_loss_comparison_and_report(tmp_path):
    from dilocox.bench.elastic import compare_loss, markdown, plot, val_at_tokens

    assert val_at_tokens([(0, 4.0), (100, 2.0)], 25) == pytest.approx(3.5)
    assert val_at_tokens([(0, 4.0), (100, 2.0)], 150) is None
    full, cut = _synthetic(False), _synthetic(True)
    lo = compare_loss(full, cut, 1000)
    assert lo["final_val_loss_uninterrupted"] == 2.0 and lo["final_val_loss_interrupted"] == 2.02
    assert lo["loss_vs_uninterrupted_pct"] == pytest.approx(1.0)
    # the interrupted run trained 900 - 119 steps; the uninterrupted curve of replica 0 there: between its val at
    # step 300 (900 steps of all replicas, loss 2.0) and step 200 (600 steps, 2.333): 781 -> 2.1317
    assert lo["tokens_interrupted"] == (900 - 119) * 1000
    assert lo["uninterrupted_val_at_equal_tokens"] == pytest.approx(3.0 - 200 / 300 - (181 / 300) * (1 / 3), rel=1e-3)
    from dilocox.bench.elastic import analyze

    res = {
        "steps": 300,
        "H": 10,
        "rank": 8,
        "victim": 2,
        "emulation": "synthetic",
        "machine": "test",
        "uninterrupted": analyze(full, 1000, 2),
        "interrupted": analyze(cut, 1000, 2),
        "loss": lo,
        "bin_s": 1.0,
    }
    md = markdown(res)
    assert "| kill → survivors' next outer step | 2.95 s |" in md
    assert "(0.58 of before; expected ≈ 0.67)" in md
    png = plot(full, cut, res, 1000, str(tmp_path / "e.png"))
    assert os.path.getsize(png) > 10_000


def test_launch_elastic_builds_one_train_job_per_replica(tmp_path, monkeypatch):
    """The replica command: `dilocox train CONFIG --nproc P*T*D` with the elastic keys and RUN/replica{r}; the
    bandwidth cap without namespaces goes to the token bucket per rank; the lighthouse gets the min replicas and, by
    default, the run secret (its guard); --no-authenticate-lighthouse leaves it plain."""
    import dilocox.elastic.launch as L

    seen = {}

    class Recorder:
        def __init__(self, n, argv, run_dir, **kw):
            seen.update(n=n, argv=[argv(r, "http://10.1.2.3:4") for r in range(n)], run_dir=run_dir, **kw)

        def run(self):
            return 7

    monkeypatch.setattr(L, "ElasticLaunch", Recorder)
    run = str(tmp_path / "run")
    rc = L.launch_elastic(
        os.path.join(ROOT, "configs", "tiny-pp2-tp2.yaml"),
        3,
        ["--outer.method=diloco", "--log.run_dir", run, "--train.steps=20"],
        kills=["2@5"],
        restarts=["2@9"],
        netns=False,
        bandwidth="100mbit",
        log=lambda m: None,
    )
    assert rc == 7 and seen["n"] == 3 and seen["run_dir"] == run and seen["min_replicas"] == 2
    assert os.stat(f"{run}/secret").st_mode & 0o777 == 0o600  # the run secret, written by the launch
    assert seen["schedule"] == [Action("kill", 2, 5.0), Action("restart", 2, 9.0)]
    assert seen["env"]["DILOCOX_EMULATED_BANDWIDTH_BPS"] == f"{100e6 / 4:.0f}"  # 4 ranks share the replica's link
    assert seen["argv"][1] == [
        sys.executable,
        "-m",
        "dilocox.cli",
        "train",
        os.path.join(ROOT, "configs", "tiny-pp2-tp2.yaml"),
        "--nproc",
        "4",
        "--outer.method=diloco",
        "--train.steps=20",
        f"--security.secret_file={run}/secret",  # written by the launch (mode 0600), passed by path
        "--outer.elastic.lighthouse_auth=true",  # the lighthouse is authenticated by default (behind a guard)
        "--parallel.replicas=1",
        "--outer.elastic.enabled=true",
        "--outer.elastic.lighthouse=http://10.1.2.3:4",
        "--outer.elastic.replica_rank=1",
        "--outer.elastic.min_replicas=2",
        "--outer.elastic.initial_replicas=3",
        f"--log.run_dir={run}/replica1",
    ]
    assert seen["lighthouse_opts"][-2:] == ["--secret-file", f"{run}/secret"]
    L.launch_elastic(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        2,
        ["--outer.method=diloco", "--log.run_dir", run],
        auth_lighthouse=False,
    )
    assert "--secret-file" not in seen["lighthouse_opts"] and "--insecure" in seen["lighthouse_opts"]
    assert [x for x in seen["argv"][0] if "lighthouse_auth" in x] == ["--outer.elastic.lighthouse_auth=false"]
    with pytest.raises(LaunchError, match="--min-replicas 4 must be in"):
        L.launch_elastic(os.path.join(ROOT, "configs", "tiny.yaml"), 3, [], min_replicas=4, netns=False)


# --------------------------------------------------------------------------- launch --elastic + torchft, for real


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TORCHFT, reason="torchft is not installed")
def test_elastic_launch_kill_is_a_dead_replica_to_torchft(tmp_path):
    """The launcher's real lighthouse and 3 toy replicas (tools.elastic_toy: one outer all-reduce per 1.5 s
    phase) on loopback; the schedule SIGKILLs replica 2's job mid-run. The lighthouse drops it, the survivors
    finish every step over contributors [0, 1] with bit-identical theta, and nothing is left behind."""
    from tools.elastic_toy import read_records, replica_cmd

    steps = 20  # 1.5 s phases: the kill at 18 s comes after the replicas' start-up (up to ~10-15 s on 2 loaded cores)
    out = tmp_path / "out"
    out.mkdir()

    def argv(r: int, addr: str) -> list[str]:
        return replica_cmd(addr, r, str(out / f"r{r}.jsonl"), steps, 1000, 2, 20.0, 60.0, 1.5, initial_replicas=3)

    la = ElasticLaunch(
        3,
        argv,
        str(tmp_path / "run"),
        min_replicas=2,
        schedule=parse_schedule(["2@18"], [], 3),
        env=ENV,
        timeout_s=150,
        stop_timeout_s=5,
        lighthouse_opts=["--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "60000"],
        log=lambda m: None,
    )
    assert la.run() == 0, [(tmp_path / "run" / f"replica{r}.log").read_text()[-2000:] for r in range(3)]
    recs = [[x for x in read_records(str(out / f"r{r}.jsonl")) if x["event"] == "step"] for r in range(3)]
    assert recs[2], "replica 2 was killed before its first outer step: raise the kill time"
    assert len(recs[2]) < steps
    for r in (0, 1):
        assert [x["step"] for x in recs[r]] == list(range(steps))
        members = [x["contributors"] for x in recs[r]]
        k = members.index([0, 1])  # all three until the kill, then the two survivors for good
        assert members[:k] == [[0, 1, 2]] * k and members[k:] == [[0, 1]] * (steps - k)
        assert k >= len(recs[2])
    assert [x["theta"] for x in recs[0]] == [x["theta"] for x in recs[1]]
    for rep in la.replicas:
        assert tagged_pids(rep.tag) == []
    ev = _events(tmp_path / "run")
    kill = next(e for e in ev if e["event"] == "kill")
    started = max(e["t"] for e in ev if e["event"] == "start")
    assert kill["replica"] == 2 and 18.0 <= kill["t"] - started < 22.0, ev


def test_step_clock_reads_the_replicas_progress(tmp_path):
    from dilocox.elastic.launch import last_step, step_clock

    assert last_step(str(tmp_path / "none.jsonl")) == 0
    for r, body in ((0, '{"step": 1}\n{"step": 2}\n{"summary": {}}\n'), (1, '{"step": 7}\n{"step": 8, "lo')):
        (tmp_path / f"replica{r}").mkdir()
        (tmp_path / f"replica{r}" / "metrics.jsonl").write_text(body)
    assert last_step(str(tmp_path / "replica0" / "metrics.jsonl")) == 2  # the summary line has no step
    assert last_step(str(tmp_path / "replica1" / "metrics.jsonl")) == 7  # a line cut by a kill is skipped
    assert step_clock(str(tmp_path), 3)() == 7.0


def test_a_replicas_own_error_line_is_found_in_its_latest_incarnation(tmp_path):
    """``dilocox launch --elastic`` prints the one-line error of a replica that exits non-zero (issue 22 item 6):
    the last such line after the launcher's latest ``====`` marker (an earlier incarnation's error is not it)."""
    from dilocox.elastic.schedule import last_error

    log = tmp_path / "replica2.log"
    assert last_error(str(log)) is None  # no log yet
    log.write_text(
        "==== start (incarnation 0) at 1.0\n"
        "elastic run stopped (rank 1): replica 2: no quorum within elastic.quorum_timeout_s=30.0s: ...\n"
        "==== restart (incarnation 1) at 9.0\n"
        "step 5/10 | loss 2.5\n"
        "config error: the checkpoint resumed from (/r/step_00000300) is already at step 300, at or past "
        "train.steps=300: this run is finished and nothing was trained\n"
        "[rank0]: Traceback (most recent call last):\n"
    )
    assert last_error(str(log)).startswith("config error: the checkpoint resumed from")
    log.write_text(log.read_text() + "==== restart (incarnation 2) at 20.0\nstep 1/10\n")
    assert last_error(str(log)) is None  # the latest incarnation has none (yet)
    log.write_text(log.read_text() + "[rank 1] error: the outer all-reduce with replica(s) 0 failed after 20 s\n")
    assert last_error(str(log)) == "[rank 1] error: the outer all-reduce with replica(s) 0 failed after 20 s"


@pytest.mark.slow
def test_elastic_launch_schedule_by_training_step(tmp_path):
    """--at step: the kill and restart happen when a replica has logged step 10 and step 25 (0.1 s per step); a kill
    scheduled after the run's end is said to be skipped on the console, and every replica's final val loss is
    printed at the end (issue 22 item 6)."""
    from dilocox.elastic.launch import step_clock

    writer = tmp_path / "writer.py"
    writer.write_text(
        "import json, os, sys, time\n"
        "d = sys.argv[1]; os.makedirs(d, exist_ok=True)\n"
        "with open(os.path.join(d, 'metrics.jsonl'), 'a') as f:\n"
        "    for s in range(1, 41):\n"
        "        time.sleep(0.1); f.write(json.dumps({'step': s, 'wall': time.time()}) + '\\n'); f.flush()\n"
        "    f.write(json.dumps({'summary': {'steps': 40, 'final_val_loss': 2.5 + int(d[-1]) / 8}}) + '\\n')\n"
    )
    lines: list[str] = []
    run = tmp_path / "run"
    la = ElasticLaunch(
        3,
        lambda r, a: [sys.executable, str(writer), str(run / f"replica{r}")],
        str(run),
        schedule=parse_schedule(["1@10", "0@100"], ["1@25"], 3),
        env=ENV,
        lighthouse_argv=lambda bind: FAKE_LIGHTHOUSE,
        timeout_s=60,
        log=lines.append,
        clock=step_clock(str(run), 3),
    )
    assert la.run() == 0
    assert "dilocox launch: --kill 0@100 (step) skipped: the run ended first" in lines, lines
    for r in range(3):  # replica 1's second incarnation wrote its summary: it is the one reported
        want = f"replica {r}: final val loss {2.5 + r / 8:.4f} after 40 steps (incarnation {int(r == 1)})"
        assert f"dilocox launch: {want}" in lines, lines
    ev = _events(run)
    kill = next(e for e in ev if e["event"] == "kill")
    restart = next(e for e in ev if e["event"] == "restart")
    assert 10 <= kill["at"] < 15, kill
    # the clock is the highest step ANY replica logged (replica 2 may be a step ahead of replica 0)
    logged = [json.loads(x) for r in range(3) for x in (run / f"replica{r}" / "metrics.jsonl").read_text().splitlines()]
    at_restart = max(x["step"] for x in logged if "step" in x and x["wall"] <= restart["wall"])
    assert 25 <= at_restart < 30, (at_restart, restart)


@pytest.mark.parametrize("method", ["dilocox", "dilocox-adaptive", "streaming"])
def test_bench_elastic_presets_are_elastic_configs(tmp_path, method):
    """Each ``dilocox bench elastic --method`` config validates as an elastic replica's (streaming: 2 fragments with
    tau, overlap none; adaptive: the controller on), and the results text names the method."""
    from dilocox.bench.elastic import body, describe, preset
    from dilocox.bench.runner import write_config
    from dilocox.config import load_config

    path = write_config(str(tmp_path / "e.yaml"), ["tiny.yaml", preset(method)], body(10, method=method))
    cfg = load_config(path, ["--outer.elastic.enabled=true", "--outer.elastic.lighthouse=http://x:1"])
    assert (cfg.outer.streaming.fragments, cfg.outer.streaming.tau) == ((2, 2) if method == "streaming" else (1, 0))
    assert cfg.compress.adaptive.enabled == (method == "dilocox-adaptive")
    assert ("Streaming" in describe(method, 8, 10)) == (method == "streaming")


def test_elastic_launch_with_a_standby_lighthouse_hands_both_addresses_and_stops_both(tmp_path):
    """``--standby-lighthouse``: a second lighthouse, its address after the first in every replica's
    outer.elastic.lighthouse (the replicas' relays pick the first that listens), both stopped at the end."""
    run_dir, got = tmp_path / "run", []
    binds = iter(["http://127.0.0.1:1", "http://127.0.0.1:2"])

    def lh(bind):
        return [sys.executable, "-c", f"import time; print('x: {next(binds)}', flush=True); time.sleep(120)"]

    def replica(r, addr):
        got.append(addr)
        return [sys.executable, "-c", "pass"]

    la = ElasticLaunch(2, replica, str(run_dir), env=ENV, lighthouse_argv=lh, timeout_s=60, stop_timeout_s=5,
                       log=lambda m: None, standby=True)  # fmt: skip
    assert la.run() == 0
    assert got == ["http://127.0.0.1:1,http://127.0.0.1:2"] * 2
    ev = _events(run_dir)
    assert [(e["event"], e.get("standby")) for e in ev[:2]] == [("lighthouse", None), ("lighthouse", True)]
    assert la.lighthouse.poll() is not None and la.standby_lighthouse.poll() is not None


# A warm standby job: waits (bounded) for activate.json in its run dir, notes the replica rank it was given, then
# runs DURATION s as a replica; SIGTERM ends it at once (as the trainer's default action before it is activated).
FAKE_STANDBY = textwrap.dedent(
    """
    import json, os, sys, time
    s, run_dir, out, duration = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    path = os.path.join(run_dir, "activate.json")
    deadline = time.time() + 60
    while not os.path.exists(path):
        if time.time() > deadline:
            sys.exit(0)
        time.sleep(0.02)
    r = json.load(open(path))["replica_rank"]
    open(f"{out}/s{s}.{os.getpid()}.activated", "w").write(f"{r} {time.time()}")
    time.sleep(duration)
    open(f"{out}/s{s}.{os.getpid()}.done", "w").write("done")
    """
)


def test_a_standby_takes_a_killed_replicas_place_and_a_restart_refills_the_pool(tmp_path):
    """``--standby-replicas``: 2 replicas and 1 warm standby. Replica 1 is SIGKILLed at 1.5 s: standby 0 is activated
    at once as replica 1 (activate.json in its run dir names rank 1). The scheduled restart of replica 1 at 3 s finds
    the slot served, so a NEW standby (1) starts instead. Slot 1 is killed again at 4 s, now standby 0: standby 1
    takes over, and nothing else is hit (replica 0 runs to its end: the jobs' kill tags are unique). The run returns 0
    and nothing is left behind. A stale activate.json of an earlier run in a standby's dir is removed first."""
    run_dir = tmp_path / "run"
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "fake_standby.py"
    script.write_text(FAKE_STANDBY)
    (run_dir / "standby0").mkdir(parents=True)
    (run_dir / "standby0" / "activate.json").write_text('{"replica_rank": 0, "wall": 1}')  # an earlier run's

    def spare_argv(s: int, addr: str) -> list[str]:
        return [sys.executable, str(script), str(s), str(run_dir / f"standby{s}"), str(out), "4.0"]

    la = ElasticLaunch(
        2,
        _fake(tmp_path, duration=7.0),
        str(run_dir),
        schedule=parse_schedule(["1@1.5", "1@4"], ["1@3"], 2),
        env=ENV,
        lighthouse_argv=lambda bind: FAKE_LIGHTHOUSE,
        timeout_s=60,
        stop_timeout_s=5,
        log=lambda m: None,
        spares=1,
        spare_argv=spare_argv,
    )
    assert la.run() == 0
    ev = _events(run_dir)
    kills = [e for e in ev if e["event"] == "kill"]
    acts = [e for e in ev if e["event"] == "activate"]
    assert [(a["replica"], a["standby"], a["why"]) for a in acts] == [(1, 0, "killed"), (1, 1, "killed")]
    assert [k.get("standby") for k in kills] == [None, 0]  # the second kill hit the standby serving slot 1
    for k, a in zip(kills, acts):
        assert 0 <= a["t"] - k["t"] < 0.5, (k, a)  # at once: no process start in between
    for s, expect in ((0, "1"), (1, "1")):
        [activated] = list(out.glob(f"s{s}.*.activated"))
        assert activated.read_text().split()[0] == expect
    assert not [e for e in ev if e["event"] == "restart"]  # the slot was served: no second replica 1
    refill = [e for e in ev if e["event"] == "standby" and e.get("standby") == 1]
    assert len(refill) == 1 and 3.0 <= refill[0]["t"] - ev[1]["t"] < 4.0, ev
    assert not [e for e in ev if e["event"] == "stop_standby"]  # both were needed
    assert [row[2] for row in _incarnations(tmp_path, 0)] == [True]  # replica 0 ran to its end
    assert not list(out.glob("s0.*.done")) and list(out.glob("s1.*.done"))
    assert la.slots[1] is la.spares[1] and la.spares[1].serves == 1
    for rep in la.replicas + la.spares:
        assert tagged_pids(rep.tag) == []


def test_a_standby_never_needed_is_stopped_when_the_replicas_end(tmp_path):
    """No replica dies: the idle standby is stopped once every replica finished (the run does not wait for it), the
    run returns 0, nothing is left behind."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    script = tmp_path / "fake_standby.py"
    script.write_text(FAKE_STANDBY)
    la = ElasticLaunch(
        2, _fake(tmp_path, duration=2.0), str(run_dir), env=ENV, lighthouse_argv=lambda bind: FAKE_LIGHTHOUSE,
        timeout_s=60, stop_timeout_s=5, log=lambda m: None, spares=1,
        spare_argv=lambda s, addr: [sys.executable, str(script), str(s), str(run_dir / f"standby{s}"), str(out), "1"],
    )  # fmt: skip
    t0 = time.monotonic()
    assert la.run() == 0
    assert time.monotonic() - t0 < 30
    ev = _events(run_dir)
    assert [e["standby"] for e in ev if e["event"] == "stop_standby"] == [0]
    assert not list(out.glob("s0.*.activated"))
    assert tagged_pids(la.spares[0].tag) == []


def test_the_schedule_kills_and_restarts_the_lighthouse_on_its_address(tmp_path):
    """``--kill L@1 --restart L@2``: the lighthouse is SIGKILLed at 1 s and started again at 2 s with the bind
    address it printed (the replicas' relays reconnect to the same address); both are in events.jsonl, the first
    process is gone, the second is stopped at the end. ``L`` is checked like a replica (no restart before a kill)."""
    binds = []

    def lighthouse_argv(bind: str) -> list[str]:
        binds.append(bind)
        return FAKE_LIGHTHOUSE

    la = ElasticLaunch(
        2, _fake(tmp_path, duration=3.0), str(tmp_path / "run"), schedule=parse_schedule(["L@1"], ["l@2"], 2),
        env=ENV, lighthouse_argv=lighthouse_argv, timeout_s=60, stop_timeout_s=5, log=lambda m: None,
    )  # fmt: skip
    first = []
    real_start = la._start_one_lighthouse

    def start(bind, name):
        proc, addr = real_start(bind, name)
        first.append(proc)
        return proc, addr

    la._start_one_lighthouse = start
    assert la.run() == 0
    ev = _events(tmp_path / "run")
    kill = next(e for e in ev if e["event"] == "lighthouse_kill")
    back = next(e for e in ev if e["event"] == "lighthouse_restart")
    assert 1.0 <= kill["t"] - ev[1]["t"] < 2.0 and 2.0 <= back["t"] - ev[1]["t"] < 3.0, ev
    assert binds == ["127.0.0.1:0", "127.0.0.1:1"] and back["address"] == "http://127.0.0.1:1"
    assert len(first) == 2 and first[0].poll() is not None and first[1].poll() is not None
    assert sorted(e["replica"] for e in ev if e["event"] == "exit") == [0, 1]  # the replicas ran on (either first)
    with pytest.raises(LaunchError, match="the lighthouse is running then"):
        parse_schedule([], ["L@3"], 2)


def test_a_standby_takes_the_launchers_activation_whenever_it_came_and_only_its_own(tmp_path, monkeypatch):
    """The launcher's activate.json names the standby job's DILOCOX_RUN_TAG: taken even if written before the job
    reached its wait (a replica that died while the standby was still starting), never another job's; one written
    by hand (no tag) counts only if newer than the job's start. Past the bound: StandbyNotNeeded."""
    from dilocox.distributed.procs import RUN_TAG_ENV
    from dilocox.elastic.standby import StandbyNotNeeded, activate, await_activation

    monkeypatch.setenv(RUN_TAG_ENV, "job-a")
    d = str(tmp_path)
    activate(d, 2, tag="job-a")
    assert await_activation(d, 8, 1.0, since=time.time() + 100)["replica_rank"] == 2  # older than since: still ours
    activate(d, 3, tag="job-b")  # another job's (an earlier run's standby with the same dir)
    with pytest.raises(StandbyNotNeeded):
        await_activation(d, 8, 0.3, since=0.0)
    activate(d, 4)  # by hand
    assert await_activation(d, 8, 1.0, since=0.0)["replica_rank"] == 4
    with pytest.raises(StandbyNotNeeded):
        await_activation(d, 8, 0.3, since=time.time() + 100)
    with open(os.path.join(d, "activate.json"), "w") as f:
        f.write('{"replica_rank": 9}')
    with pytest.raises(ValueError, match="max_replicas=8"):
        await_activation(d, 8, 0.3, since=0.0)
