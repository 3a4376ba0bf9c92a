"""Issue 9 item 1: a signal to ``dilocox train --nproc N`` reaches every rank; they save and exit; nothing survives.

Every process of a run carries ``DILOCOX_RUN_TAG=<uuid>`` in its environment (set here, inherited by
torchrun and the ranks), so a /proc scan finds them, orphans included. Victims run in their own
session under a time bound and are SIGKILLed by tag in ``finally``.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from dilocox.distributed import signals
from tests.small_run import TINY_RUN_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(path: str, text: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    with open(path) as f:
        raise AssertionError(f"{text!r} not seen within {timeout} s (exit {proc.poll()}):\n{f.read()[-3000:]}")


def _wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    try:
        return proc.wait(timeout=timeout), time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0


@pytest.mark.fault
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_every_rank_with_a_checkpoint(tmp_path, sig):
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    out = tmp_path / "out.txt"
    cmd = [
        sys.executable,
        "-m",
        "dilocox.cli",
        "train",
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--nproc",
        "2",
        "--parallel.replicas=2",
        "--outer.method=diloco",
        "--outer.sync_every=4",
        "--train.steps=100000",
        f"--log.run_dir={run}",
        f"--data.cache_dir={tmp_path}/cache",
        *TINY_RUN_ARGS,
        "--checkpoint.every=1000",
        "--train.stop_timeout_s=60",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **{signals.RUN_TAG_ENV: tag})
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        _wait_for(str(out), "step      3/", 240, proc)
        assert len(signals.tagged_pids(tag)) >= 4  # dilocox, torchrun, 2 ranks
        os.kill(proc.pid, sig)
        code, secs = _wait_exit(proc, 90)
        log = out.read_text()
        assert code is not None, f"dilocox did not exit within 90 s of {sig.name}:\n{log[-3000:]}"
        left = signals.tagged_pids(tag)
        assert not left, f"processes of the run still alive after dilocox exited: {left}\n{log[-3000:]}"
        assert code == 128 + sig, f"exit code {code}, want {128 + sig}:\n{log[-3000:]}"
        assert secs < 65, secs  # bounded by train.stop_timeout_s (plus polling)
        print(f"{sig.name}: dilocox and all its processes exited {secs:.1f} s after the signal")
        assert f"interrupted by {sig.name} at step" in log, log[-3000:]
        step = int(log.split(f"interrupted by {sig.name} at step ")[1].split(";")[0])
        assert step >= 3
        ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
        assert ckpts == [f"step_{step:08d}"], ckpts  # saved at the stop step (checkpoint.every=1000 saved nothing)
        meta = json.loads((run / "checkpoints" / ckpts[0] / "COMPLETE.json").read_text())
        assert meta["step"] == step and meta["world_size"] == 2
        data = [rec for name, rec in meta["files"].items() if name.endswith(".distcp")]
        assert len(data) == 2 and all(rec["bytes"] > 0 for rec in data)  # each rank's DCP file, hashed
    finally:
        signals.kill_tagged(tag)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


CHILD = textwrap.dedent("""
    import signal, sys, time
    mode = sys.argv[1]
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *a: (print("child saving", flush=True), time.sleep(0.5), sys.exit(7)))
    print("child up", flush=True)
    for _ in range(600):
        time.sleep(0.1)
""")

PARENT = textwrap.dedent("""
    import sys
    from dilocox.distributed.signals import supervise
    sys.exit(supervise([sys.executable, "-c", sys.argv[1], sys.argv[2]], dict(__import__("os").environ), 3.0))
""")


@pytest.mark.parametrize("mode", ["save", "ignore"])
def test_supervise_forwards_waits_and_bounds(tmp_path, mode):
    """The parent forwards SIGTERM, waits for the child; a child that ignores it is killed after the bound."""
    tag = uuid.uuid4().hex
    out = tmp_path / "out.txt"
    env = dict(os.environ, PYTHONPATH=ROOT, **{signals.RUN_TAG_ENV: tag})
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", PARENT, CHILD, mode],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for(str(out), "child up", 60, proc)
        os.kill(proc.pid, signal.SIGTERM)
        code, secs = _wait_exit(proc, 30)
        assert code == 128 + signal.SIGTERM, out.read_text()
        assert not signals.tagged_pids(tag)
        if mode == "save":
            # waited for the child, which exited on its own (code 7), not killed at the bound (a wall-clock bound of
            # 3 s failed once under CI's load: 4.1 s with the child's own exit, 2026-12-03)
            assert "child saving" in out.read_text() and "did not stop within" not in out.read_text(), (
                secs,
                out.read_text(),
            )
            assert "torchrun exit code 7" in out.read_text() and secs < 10, (secs, out.read_text())
        else:
            assert 2.5 < secs < 20, secs  # (the bound of 3 s + a loaded host's start-up; no kill would be 30)
            assert "did not stop within 3 s" in out.read_text()
    finally:
        signals.kill_tagged(tag)
        if proc.poll() is None:
            proc.kill()


def test_stop_flag_single_process():
    flag = signals.StopFlag(log=lambda m: None)
    prev = signal.getsignal(signal.SIGTERM)
    flag.install()
    try:
        assert not flag.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert flag.should_stop() and flag.agreed_signum == signal.SIGTERM
        assert signals.Interrupted(flag.agreed_signum, 5, None).exit_code == 143
    finally:
        flag.close()
    assert signal.getsignal(signal.SIGTERM) == prev


@pytest.mark.slow
def test_sigterm_to_dilocox_launch_saves_then_removes_namespaces(tmp_path):
    from dilocox.launch.emulate import netns_available

    ok, why = netns_available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    run, out = tmp_path / "run", tmp_path / "out.txt"
    cmd = [
        sys.executable,
        "-m",
        "dilocox.cli",
        "launch",
        "--replicas",
        "2",
        "--nproc-per-replica",
        "1",
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--outer.method=diloco",
        "--outer.sync_every=4",
        "--train.steps=100000",
        f"--log.run_dir={run}",
        f"--data.cache_dir={tmp_path}/cache",
        *TINY_RUN_ARGS,
        "--checkpoint.every=1000",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        _wait_for(str(out), "step      3/", 240, proc)
        os.kill(proc.pid, signal.SIGTERM)
        code, secs = _wait_exit(proc, 90)
        log = out.read_text()
        assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), f"exit {code}:\n{log[-3000:]}"
        assert "interrupted by SIGTERM at step" in log, log[-3000:]
        # each node's torchrun ends with one line, not a SignalException traceback per node (found by review)
        assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
        assert log.count("torchrun: stopped by SIGTERM: every local rank (1) stopped") == 2, log[-3000:]
        # nor torch's own lines around it: its stop warnings per node and rank, and c10d's failed reverse lookup per
        # connection (a namespace has no DNS: each now has a hosts file naming every node, deleted with it)
        for said in ("death signal", "closing signal", "hostname of the client socket cannot be retrieved"):
            assert said not in log, log[-3000:]
        assert not glob.glob(f"/etc/netns/dilocox-{proc.pid}-*"), "a namespace's hosts file outlived it"
        step = int(log.split("interrupted by SIGTERM at step ")[1].split(";")[0])
        assert (run / "checkpoints" / f"step_{step:08d}" / "COMPLETE.json").exists()
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"dilocox-{proc.pid}-" not in ns, ns
        print(f"dilocox launch: saved step {step} and removed the namespaces {secs:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
