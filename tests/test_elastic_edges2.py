"""Edge cases of ``dilocox launch --elastic`` found by a second review (each test's docstring names its bug).

The launcher runs in a subprocess under a time bound, with fake replica and standby jobs (short Python scripts), so a
hang is a failed test, not a stuck suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
FAKE_LIGHTHOUSE = [sys.executable, "-c", "import time; print('x: http://127.0.0.1:1', flush=True); time.sleep(120)"]

# A replica (or, with STANDBY=1, a warm standby: it first waits for activate.json and continues at the live step the
# replicas wrote to RUN/live) that logs one training step per 0.05 s into its run dir's metrics.jsonl.
STEPPER = textwrap.dedent(
    """
    import json, os, sys, time
    d, end, standby = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    live = os.path.join(os.path.dirname(d), "live")
    os.makedirs(d, exist_ok=True)
    start = 0
    if standby:
        deadline = time.time() + 30
        while not os.path.exists(os.path.join(d, "activate.json")):
            if time.time() > deadline:
                sys.exit(0)
            time.sleep(0.02)
        start = int(open(live).read())
    for s in range(start, end):
        with open(os.path.join(d, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": s}) + "\\n")
        tmp = f"{live}.{os.getpid()}"  # (atomic: a reader racing a truncating write read "": int("") exit 1)
        with open(tmp, "w") as f:
            f.write(str(s))
        os.replace(tmp, live)
        time.sleep(0.05)
    """
)


def _run_launcher(code: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )


def test_the_step_clock_follows_a_standby_that_took_a_slot(tmp_path):
    """Bug: with ``--at step`` the schedule clock read only RUN/replica<r>/metrics.jsonl, but a warm standby that
    takes a dead replica's slot trains (and logs its steps) in RUN/standby<s>/: once the replicas there were gone the
    clock stood still and a later step-scheduled ``--restart`` never fired ("skipped: the run ended first") while the
    standby trained on to step 80. Here replica 0 is killed at step 5 (standby 0 takes its place), replica 1 at
    step 15, and ``--restart 1@25`` must happen."""
    run = tmp_path / "run"
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    code = textwrap.dedent(
        f"""
        import sys
        from dilocox.elastic.launch import ElasticLaunch, parse_schedule, step_clock
        run, w = {str(run)!r}, {str(script)!r}
        la = ElasticLaunch(
            2, lambda r, a: [sys.executable, w, f"{{run}}/replica{{r}}", "60", "0"], run,
            schedule=parse_schedule(["0@5", "1@15"], ["1@25"], 2), lighthouse_argv=lambda b: {FAKE_LIGHTHOUSE!r},
            timeout_s=40, stop_timeout_s=5, clock=step_clock(run, 2), log=lambda m: None, spares=1,
            spare_argv=lambda s, a: [sys.executable, w, f"{{run}}/standby{{s}}", "80", "1"],
        )
        sys.exit(la.run())
        """
    )
    p = _run_launcher(code)
    assert p.returncode == 0, p.stderr[-2000:]
    ev = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    acts = [(e["event"], e.get("replica"), e.get("skipped")) for e in ev if e["event"] in ("kill", "restart")]
    assert acts == [("kill", 0, None), ("kill", 1, None), ("restart", 1, None)], acts
    assert [(e["replica"], e["standby"]) for e in ev if e["event"] == "activate"] == [(0, 0)]


def _assert_one_line(tmp_path, flags: list[str], message: str) -> None:
    """``dilocox launch --replicas 2 --nproc-per-replica 2 FLAGS`` exits 2 with ``message`` as its one line."""
    p = subprocess.run(
        [sys.executable, "-m", "dilocox.cli", "launch", "--replicas", "2", "--nproc-per-replica", "2", *flags,
         os.path.join(ROOT, "configs", "tiny-dilocox.yaml"), f"--log.run_dir={tmp_path}"],
        env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [f"dilocox launch: error: {message}"], p.stderr


def test_launch_grace_nan_is_one_line_not_an_endless_wait(tmp_path):
    """Bug: ``dilocox launch --replicas R ... --grace nan`` was taken as the grace after a failed node: ``elapsed >
    nan`` is never true, so the nodes still running (stuck in a collective) were never killed and the launch waited
    for them without a bound. Now a --grace that is not a finite number >= 0 is one line (exit 2) before anything
    starts, without a traceback."""
    _assert_one_line(tmp_path, ["--grace", "nan"], "--grace nan must be a finite number of seconds >= 0")
    assert not (tmp_path / "replica0").exists()
    from dilocox.launch.emulate import launch

    for bad in (-1.0, float("inf")):  # (raised before anything is started)
        with pytest.raises(ValueError, match="--grace"):
            launch(None, 2, 1, entry=["never-run.py"], grace_s=bad, log=lambda m: None)


# A lighthouse whose first start prints its address at once and whose later starts (a scheduled restart) take 30 s.
SLOW_RESTART_LIGHTHOUSE = textwrap.dedent(
    """
    import os, sys, time
    f = sys.argv[1]
    n = int(open(f).read()) if os.path.exists(f) else 0
    open(f, "w").write(str(n + 1))
    if n:
        time.sleep(30)
    print("x: http://127.0.0.1:1", flush=True)
    time.sleep(120)
    """
)
TERM_NOTING_REPLICA = textwrap.dedent(
    """
    import signal, sys, time
    def term(signum, frame):
        open(sys.argv[1], "w").write("term")
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    time.sleep(60)
    """
)


def test_a_stop_signal_while_the_lighthouse_restarts_stops_the_replicas_gracefully(tmp_path):
    """Bug: SIGINT while a scheduled ``--restart L@T`` waited for the new lighthouse's address raised LaunchError out
    of the run ("dilocox launch: error: interrupted while starting the lighthouse", exit 2) and the replicas were
    SIGKILLed without the SIGTERM that lets them save. Now it is a stop like any other: the replicas get SIGTERM and
    the run returns 130."""
    (tmp_path / "lh.py").write_text(SLOW_RESTART_LIGHTHOUSE)
    (tmp_path / "rep.py").write_text(TERM_NOTING_REPLICA)
    code = textwrap.dedent(
        f"""
        import sys
        from dilocox.elastic.launch import ElasticLaunch, parse_schedule
        d = {str(tmp_path)!r}
        la = ElasticLaunch(
            1, lambda r, a: [sys.executable, d + "/rep.py", d + "/term"], d + "/run",
            schedule=parse_schedule(["L@0.5"], ["L@1"], 1),
            lighthouse_argv=lambda b: [sys.executable, d + "/lh.py", d + "/count"],
            timeout_s=40, stop_timeout_s=5, log=lambda m: print(m, flush=True),
        )
        sys.exit(la.run())
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in p.stdout:  # (bounded: the subprocess ends within its own --timeout 40 s at the latest)
            lines.append(line)
            if "killed the lighthouse" in line:
                break
        time.sleep(1.5)  # (the restart, at 1 s, is waiting for the new lighthouse's address now)
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, "".join(lines) + rest
    assert (tmp_path / "term").read_text() == "term"  # SIGTERM first: the replica could save
    ev = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e.get("signal") for e in ev if e["event"] == "stop"] == ["SIGINT"]


def test_launch_master_port_out_of_range_is_one_line(tmp_path):
    """Bug: ``dilocox launch --replicas R ... --master-port 99999`` started every node, and each node's torchrun died
    with a ValueError traceback of its own ("The port number of the rendezvous endpoint ... must be an integer
    between 0 and 65536"), exit 1. Now a port outside [1, 65535] is one line naming the flag (exit 2), nothing
    started."""
    _assert_one_line(tmp_path, ["--master-port", "99999"], "--master-port 99999 must be a TCP port in [1, 65535]")
    from dilocox.launch.emulate import launch

    with pytest.raises(ValueError, match="--master-port 0 "):
        launch(None, 2, 1, entry=["never-run.py"], master_port=0, log=lambda m: None)


def test_elastic_launch_bad_run_dir_is_one_line(tmp_path):
    """Bug: ``dilocox launch --elastic 2 CONFIG --log.run_dir=`` (an empty RUN), or a RUN under a plain file, ended in
    an OSError traceback from ``os.makedirs`` (exit 1). Now each is one line naming log.run_dir (exit 2)."""
    (tmp_path / "afile").write_text("")
    for run_dir, says in (("", "log.run_dir is empty"), (str(tmp_path / "afile" / "run"), "log.run_dir=")):
        p = subprocess.run(
            [sys.executable, "-m", "dilocox.cli", "launch", "--elastic", "2",
             os.path.join(ROOT, "configs", "tiny-dilocox.yaml"), "--no-netns", f"--log.run_dir={run_dir}", "--timeout",
             "5"],
            env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 2, p.stderr[-2000:]
        [line] = p.stderr.strip().splitlines()
        assert line.startswith(f"dilocox launch: error: {says}"), p.stderr
