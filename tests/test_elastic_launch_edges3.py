"""Edges of the elastic group and the launchers (third review): servers left running by a failed
``ElasticOuterGroup`` construction, and launch exit codes that hid what happened (a replica killed by a signal
exited 247, a failed node's code was replaced by that of the node killed after it).

Each test runs its scenario in a fresh interpreter (its victims, if any, in subprocesses of that one) under a
time bound, and reads the outcome from its output and exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")

try:
    import torchft  # noqa: F401

    HAVE_TORCHFT = True
except ImportError:
    HAVE_TORCHFT = False


def _run(code: str, timeout: float = 90.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- a failed construction leaves nothing

_THREADS = """
import threading
from dilocox.elastic import ElasticConfig, ElasticOuterGroup
def new_threads(before):
    import time
    time.sleep(0.3)
    return sorted(t.name for t in threading.enumerate() if t not in before)
"""


@pytest.mark.skipif(not HAVE_TORCHFT, reason="needs torchft")
def test_a_lighthouse_address_without_a_port_fails_before_any_server_starts():
    """``http://host`` passed the prefix check, then the heal server started, then the address failed: the server's
    accept thread (and its port) stayed for the life of the process."""
    r = _run(
        _THREADS
        + textwrap.dedent(
            """
        before = set(threading.enumerate())
        cfg = ElasticConfig(lighthouse_addr="http://127.0.0.1", replica_rank=0, timeout_s=5, quorum_timeout_s=5)
        try:
            ElasticOuterGroup(cfg)
        except ValueError as e:
            print("ERR", e)
        print("LEFT", new_threads(before))
        """
        )
    )
    assert r.returncode == 0, r.stderr
    assert "ERR elastic.lighthouse_addr='http://127.0.0.1' is invalid: give it as http://host:port" in r.stdout
    assert "LEFT []" in r.stdout, r.stdout


@pytest.mark.skipif(not HAVE_TORCHFT, reason="needs torchft")
def test_a_plain_lighthouse_refused_by_an_authenticating_replica_leaves_no_server():
    """An authenticating replica refuses a plain lighthouse (one line), but its store's guard and its mesh's accept
    thread (outer.elastic.collectives auto -> authenticated) were left listening."""
    r = _run(
        _THREADS
        + textwrap.dedent(
            """
        import os, socket
        srv = socket.create_server(("127.0.0.1", 0))  # a plain server: answers no handshake
        def serve():
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                c.sendall(b"HTTP/1.1 400 Bad Request\\r\\n\\r\\n")
        threading.Thread(target=serve, daemon=True).start()
        before = set(threading.enumerate())
        cfg = ElasticConfig(lighthouse_addr=f"http://127.0.0.1:{srv.getsockname()[1]}", replica_rank=0, timeout_s=5,
                            quorum_timeout_s=5, secret=os.urandom(32), lighthouse_auth=True)
        try:
            ElasticOuterGroup(cfg)
        except Exception as e:
            print("ERR", type(e).__name__, e)
        print("LEFT", new_threads(before))
        """
        )
    )
    assert r.returncode == 0, r.stderr
    assert "ERR ElasticError outer.elastic.lighthouse" in r.stdout and "plain lighthouse" in r.stdout, r.stdout
    assert "LEFT []" in r.stdout, r.stdout


# --------------------------------------------------------------------------- exit codes as a shell says them


def test_elastic_launch_of_a_replica_killed_by_a_signal_exits_128_plus_signal(tmp_path):
    """A replica SIGKILLed from outside the schedule (the OOM killer, say): ``run`` returned -9, which
    ``sys.exit`` turns into 247; a shell's 137 now."""
    r = _run(
        f"""
        import sys
        from dilocox.elastic.supervisor import ElasticLaunch
        LH = [sys.executable, "-c", "import time; print('x: http://127.0.0.1:1', flush=True); time.sleep(60)"]
        def argv(r, addr):
            code = "import os, time; time.sleep(0.3); os.kill(os.getpid(), 9)" if r == 1 else "pass"
            return [sys.executable, "-c", code]
        la = ElasticLaunch(2, argv, {str(tmp_path / "run")!r}, lighthouse_argv=lambda b: LH, timeout_s=30,
                           stop_timeout_s=2, log=lambda m: None)
        sys.exit(la.run())
        """
    )
    assert r.returncode == 137, (r.returncode, r.stderr[-2000:])


def test_emulated_launch_exits_with_the_failed_nodes_code_not_the_killed_ones(tmp_path):
    """Node 1 fails (exit 3), node 0 is killed after --grace: ``dilocox launch`` exited 247 (node 0's -9, the first
    non-zero in replica order); now node 1's own 3. A node only killed by a signal: 128 + signal."""
    r = _run(
        """
        import subprocess, sys
        from dilocox.launch import emulate
        procs = [subprocess.Popen(["sleep", "30"], start_new_session=True),
                 subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)]
        codes = emulate._wait_all(procs, 0.3)  # (the real wait: node 0 SIGKILLed after the grace)
        print("CODES", codes, flush=True)
        emulate.launch = lambda *a, **k: codes
        sys.exit(emulate.launch_main(["--replicas", "2", "--nproc-per-replica", "1", "c.yaml"]))
        """
    )
    assert "CODES [-9, 3]" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    from dilocox.launch.local_run import launch_exit_code

    assert launch_exit_code([0, 0]) == 0 and launch_exit_code([0, -15]) == 143 and launch_exit_code([-9, 2]) == 2


# --------------------------------------------------------------------------- a lighthouse that prints no address


def test_a_lighthouse_that_closes_its_output_is_a_launch_error_and_is_stopped(tmp_path):
    """A lighthouse that closed its stdout but ran on: the 10 s wait for its exit raised ``TimeoutExpired`` out of
    ``run`` (a traceback from ``dilocox launch --elastic``, which reports LaunchError in one line)."""
    r = _run(
        f"""
        import os, sys
        from dilocox.elastic.supervisor import ElasticLaunch, LaunchError
        LH = [sys.executable, "-c", "import os, time; os.close(1); time.sleep(60)"]
        la = ElasticLaunch(1, lambda r, a: [sys.executable, "-c", "pass"], {str(tmp_path / "run")!r},
                           lighthouse_argv=lambda b: LH, timeout_s=30, stop_timeout_s=2, log=lambda m: None)
        try:
            la.run()
        except LaunchError as e:
            print("ERR", e)
        print("LIGHTHOUSE", la.lighthouse.poll() is not None)
        """
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERR the lighthouse closed its output (still running) before printing its address" in r.stdout, r.stdout
    assert "LIGHTHOUSE True" in r.stdout


@pytest.mark.parametrize("addr", ["http://127.0.0.1", "http://127.0.0.1:x", "http://:29510", "http://a:1,http://b"])
def test_the_config_refuses_a_lighthouse_address_without_host_and_port(addr):
    """The config check took any http:// prefix: a port-less address loaded and failed only when the group was
    built (after the store and its guard had started)."""
    from dilocox.config import ConfigError, load_config

    over = ["--outer.method=diloco", "--outer.elastic.enabled=true", f"--outer.elastic.lighthouse={addr}"]
    with pytest.raises(ConfigError, match=r"outer\.elastic\.lighthouse"):
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)
    ok = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*over[:2], "--outer.elastic.lighthouse=http://h:1"])
    assert ok.outer.elastic.lighthouse == "http://h:1"


def test_a_run_that_ends_on_an_error_asks_its_replicas_to_save_before_killing_them(tmp_path):
    """A scheduled lighthouse restart that fails ends the run with a LaunchError; the replicas still running were
    SIGKILLed at once (no SIGTERM: no checkpoint saved). Now they get SIGTERM and ``stop_timeout_s`` first."""
    r = _run(
        f"""
        import os, sys
        from dilocox.elastic.schedule import LIGHTHOUSE, Action, LaunchError
        from dilocox.elastic.supervisor import ElasticLaunch
        calls = []
        def lh(bind):  # the first prints its address; the restarted one exits without it
            calls.append(bind)
            if len(calls) == 1:
                return [sys.executable, "-c", "import time; print('x: http://127.0.0.1:1', flush=True); time.sleep(60)"]
            return [sys.executable, "-c", "pass"]
        saved = {str(tmp_path / "saved")!r}
        REP = ("import signal, sys, time\\n"
               "def bye(*a):\\n    open(sys.argv[1] + sys.argv[2], 'w').close(); sys.exit(143)\\n"
               "signal.signal(signal.SIGTERM, bye)\\nprint('up', flush=True)\\ntime.sleep(60)\\n")
        la = ElasticLaunch(2, lambda r, a: [sys.executable, "-c", REP, saved, str(r)], {str(tmp_path / "run")!r},
                           lighthouse_argv=lh, timeout_s=30, stop_timeout_s=10, log=lambda m: None,
                           schedule=[Action("kill", LIGHTHOUSE, 1.0), Action("restart", LIGHTHOUSE, 1.5)])
        try:
            la.run()
        except LaunchError as e:
            print("ERR", e)
        print("SAVED", sorted(os.path.exists(saved + str(r)) for r in range(2)))
        """
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERR the lighthouse exited" in r.stdout, r.stdout
    assert "SAVED [True, True]" in r.stdout, r.stdout
