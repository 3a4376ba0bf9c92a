"""Fault-handling edges of the launchers (review of dilocox/elastic, dilocox/launch, dilocox/distributed):

- ``--kill -1@T`` is refused (it killed the lighthouse: -1 is the lighthouse's number inside the schedule);
- ``dilocox launch --elastic`` without ``--log.run_dir`` uses the config's run dir (it used ``runs/x/replica0``);
- ``--timeout`` <= 0 or NaN and lighthouse timeouts < 1 ms are one-line errors before anything starts;
- Ctrl-C while the elastic launcher starts its lighthouse exits 130, not 2 ("error");
- ``dilocox train --nproc N`` exits with the failed rank's code (2 for a run dir in use), not always 1;
- a SIGKILLed launcher's children (torchrun and its ranks; the elastic replicas and lighthouse) stop with it;
- a replica whose peer replica dies says so in one line (``[rank R] error: ...``) and exits 1, with no traceback.
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

from dilocox.elastic import launch as elastic_launch
from dilocox.elastic.schedule import LaunchError, parse_schedule
from dilocox.elastic.supervisor import ElasticLaunch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny-dilocox.yaml")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("spec", ["-1@5", "-2@5", " -1 @5"])
def test_a_negative_replica_in_the_schedule_is_refused_not_taken_for_the_lighthouse(spec):
    with pytest.raises(LaunchError, match=r"is not in \[0, 2\)"):
        parse_schedule([spec], [], 2)
    assert parse_schedule(["L@5"], ["l@6"], 2)[0].replica == -1  # (the lighthouse is still named L)


def test_elastic_launch_without_a_run_dir_uses_the_configs(tmp_path, monkeypatch):
    seen = {}

    class Fake:
        def __init__(self, n, argv, run_dir, **kw):
            seen["run_dir"], seen["argv"] = run_dir, argv(1, "http://127.0.0.1:1")

        def run(self):
            return 0

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(elastic_launch, "ElasticLaunch", Fake)
    assert elastic_launch.launch_elastic(CONFIG, 2, ["--parallel.pipeline=1"], netns=False, log=lambda m: None) == 0
    assert seen["run_dir"] == "runs/tiny-dilocox"  # the config's log.run_dir (it was runs/x/replica0)
    assert "--log.run_dir=runs/tiny-dilocox/replica1" in seen["argv"]
    assert not os.path.exists(tmp_path / "runs" / "x")


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--timeout", "-5"], "--timeout -5"),
        (["--timeout", "nan"], "--timeout nan"),
        (["--timeout", "0"], "--timeout 0"),
        (["--heartbeat-timeout-ms", "0"], "--heartbeat-timeout-ms 0"),
        (["--join-timeout-ms", "-1"], "--join-timeout-ms -1"),
    ],
)
def test_bad_elastic_timeouts_are_one_line_errors_before_anything_starts(args, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(elastic_launch, "ElasticLaunch", None)  # (starting anything would raise)
    rc = elastic_launch.launch_main(
        ["--elastic", "2", CONFIG, "--no-netns", "--parallel.pipeline=1", f"--log.run_dir={tmp_path}", *args]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and flag in err[0], err


def test_ctrl_c_while_the_lighthouse_starts_exits_130(tmp_path):
    """The stand-in lighthouse sends SIGINT to the launcher (as Ctrl-C does) and never prints its address."""
    lh = ["-c", "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); time.sleep(60)"]
    launcher = textwrap.dedent(
        f"""
        import sys
        from dilocox.elastic.supervisor import ElasticLaunch
        ex = ElasticLaunch(1, lambda r, a: [sys.executable, "-c", "pass"], {str(tmp_path)!r},
                           lighthouse_argv=lambda bind: [sys.executable, *{lh!r}], log=print)
        sys.exit(ex.run())
        """
    )
    r = subprocess.run([sys.executable, "-c", launcher], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "stopped by SIGINT while the lighthouse was starting" in r.stdout
    assert '"event": "stop"' in (tmp_path / "events.jsonl").read_text()


def test_elastic_launch_class_still_raises_a_lighthouse_failure_without_a_signal(tmp_path):
    ex = ElasticLaunch(1, lambda r, a: [sys.executable, "-c", "pass"], str(tmp_path), log=lambda m: None,
                       lighthouse_argv=lambda bind: [sys.executable, "-c", "raise SystemExit(3)"])  # fmt: skip
    with pytest.raises(LaunchError, match=r"exited \(3\) before printing its address"):
        ex.run()


def test_the_failed_ranks_exit_code_is_the_launchs():
    from dilocox.launch.local_run import failed_exit_code

    assert failed_exit_code(2, [2, -15]) == 2  # a run dir in use: rank 0 exits 2, torchrun SIGTERMs rank 1
    assert failed_exit_code(-9, [-9, 1]) == 1  # a rank killed, the other failed on its collective
    assert failed_exit_code(-9, [-9, -15]) == 1
    assert failed_exit_code(143, [143]) == 143


def test_local_run_exits_with_the_failed_ranks_code(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(2)\ntime.sleep(60)\n")
    cmd = [sys.executable, "-m", "dilocox.launch.local_run", "--standalone", "--nproc_per_node=2", str(script)]
    p = subprocess.Popen(cmd, env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert p.returncode == 2


def _parent_then_kill(tmp_path, parent_code: str) -> tuple[int, subprocess.Popen]:
    """Start ``parent_code`` (it starts a child that writes its pid to tmp_path/child.pid and sleeps), SIGKILL the
    parent once the child runs; return the child's pid."""
    pidfile = tmp_path / "child.pid"
    p = subprocess.Popen([sys.executable, "-c", parent_code], env=_env(), start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline and p.poll() is None, "the child did not start"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        return child, p
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        raise


def test_a_sigkilled_supervise_parent_takes_its_torchrun_with_it(tmp_path):
    """`kill -9` of `dilocox train --nproc N`: torchrun (in its own session) ran on with its ranks, orphaned."""
    child = f"import os, time; open({str(tmp_path / 'child.pid')!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = (
        "import os, sys\nfrom dilocox.distributed.signals import supervise\n"
        f"supervise([sys.executable, '-c', {child!r}], dict(os.environ))\n"
    )
    pid, _ = _parent_then_kill(tmp_path, parent)
    try:
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the supervised child outlived its SIGKILLed parent"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_elastic_launcher_takes_its_replicas_and_lighthouse_with_it(tmp_path):
    child = f"import os, time; open({str(tmp_path / 'child.pid')!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    lh = "print('http://127.0.0.1:1', flush=True); import time; time.sleep(120)"
    parent = textwrap.dedent(
        f"""
        import sys
        from dilocox.elastic.supervisor import ElasticLaunch
        ElasticLaunch(1, lambda r, a: [sys.executable, "-c", {child!r}], {str(tmp_path)!r},
                      lighthouse_argv=lambda bind: [sys.executable, "-c", {lh!r}], log=print).run()
        """
    )
    pid, _ = _parent_then_kill(tmp_path, parent)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    lh_pids = [e["pid"] for e in events if e["event"] == "lighthouse"]
    try:
        deadline = time.monotonic() + 10
        while not all(map(_gone, [pid, *lh_pids])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid) and all(map(_gone, lh_pids)), "a replica or the lighthouse outlived the SIGKILLed launcher"
    finally:
        for q in [pid, *lh_pids]:
            if not _gone(q):
                os.kill(q, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in map(int, out) for d in (c, *_descendants(c))]


def _rank_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return env.get(b"RANK", b"").decode() or None


@pytest.mark.slow
def test_a_dead_peer_replica_is_one_line_and_exit_1_not_a_traceback(tmp_path):
    log = tmp_path / "out.log"
    cmd = [sys.executable, "-m", "dilocox.cli", "train", os.path.join(ROOT, "configs", "tiny.yaml"), "--nproc", "2",
           "--parallel.replicas=2", "--outer.method=diloco", "--train.steps=2000", f"--log.run_dir={tmp_path}/run",
           f"--data.cache_dir={tmp_path}/cache", "--checkpoint.every=0"]  # fmt: skip
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=_env(), start_new_session=True, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "step     25/" not in log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        victims = [c for c in _descendants(p.pid) if _rank_of(c) == "1"]
        assert victims, "rank 1 not found"
        for v in victims:
            os.kill(v, signal.SIGKILL)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    text = log.read_text()
    assert p.returncode == 1, text[-3000:]
    assert any(line.startswith("[rank 0] error: ") and "replica(s) 1" in line for line in text.splitlines()), text
    assert "Traceback" not in text and "[rank 0] [rank 0]" not in text, text[-4000:]
