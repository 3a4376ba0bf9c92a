"""Edges of starting and stopping a run's processes (dilocox/distributed/, dilocox/launch/local_run.py, the sbatch
scripts), each found by running the real code:

- RANK / WORLD_SIZE / LOCAL_RANK (or SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID) that are not whole numbers were a
  ValueError traceback; a rank outside [0, world size) waited in init_process_group for ranks that do not exist.
- ``dilocox train --nproc N`` exited 247 (``sys.exit(-9)``) when torchrun itself was SIGKILLed (OOM killer): 137 now.
- a stop signal to torchrun (SLURM's ``--signal``, scancel, a SIGTERM to an elastic replica's launcher) made it exit 1
  with a ``SignalException`` traceback after its ranks had saved; ``python -m dilocox.launch.local_run [--multi-host]``
  exits 128 + signal with one line, or with the code of a rank that did not stop cleanly, and kills the ranks that a
  third signal (torchrun's clean-up cut short) left running.
- the sbatch scripts ``cd $DILOCOX_ROOT`` before using CONFIG: a relative CONFIG resolved against the checkout, not
  where it was typed.

Every test that starts processes runs them in their own session under a time bound and kills what is left.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dilocox.config import ConfigError
from dilocox.distributed.topology import env_rank_world
from tests.fake_slurm import run_fake_sbatch
from tests.test_launch_elastic import _alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "launcher", "slurm")
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS and not k.startswith("DILOCOX_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


# --------------------------------------------------------------------------- rank variables


@pytest.mark.parametrize(
    "env, named",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": ""}, "LOCAL_RANK=''"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc"}, "SLURM_NTASKS='abc'"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 WORLD_SIZE=2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4"),
        ({"RANK": "3"}, "RANK=3 is set in the environment but WORLD_SIZE is not"),  # was: ran as rank 0 of 1
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is set in the environment but RANK is not"),
        ({"RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "WORLD_SIZE is not"),
    ],
)
def test_malformed_rank_variables_are_a_config_error(monkeypatch, env, named):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:  # was: ValueError (a traceback), or (3, 2, 0) and a hang in init
        env_rank_world()
    assert named in str(e.value)


def test_well_formed_rank_variables_still_parse(monkeypatch):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    assert env_rank_world() == (0, 1, 0)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert env_rank_world() == (1, 2, 0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert env_rank_world() == (3, 4, 1)  # torchrun's win


# --------------------------------------------------------------------------- supervise's exit code


def test_supervise_exits_128_plus_signal_when_torchrun_itself_is_killed():
    parent = (
        "import os, sys\nfrom dilocox.distributed.signals import supervise\n"
        "sys.exit(supervise([sys.executable, '-c', 'import os; os.kill(os.getpid(), 9)'], dict(os.environ), 5.0))\n"
    )
    p = subprocess.run([sys.executable, "-c", parent], env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGKILL, (p.returncode, p.stderr)  # was 247: sys.exit(-9)
    assert "torchrun was killed by SIGKILL" in p.stderr, p.stderr


# --------------------------------------------------------------------------- a stop signal to torchrun

RANK = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    out, mode, rank = pathlib.Path(sys.argv[1]), sys.argv[2], os.environ["LOCAL_RANK"]

    def stop(sig, frame):
        if mode == "fail" and rank == "1":
            sys.exit(1)  # (an error while saving)
        if mode == "slow":
            time.sleep(60)  # still saving when the second signal comes
        (out / f"saved{rank}").write_text("1")
        sys.exit(128 + sig)

    signal.signal(signal.SIGTERM, stop)
    (out / f"up{rank}").write_text(str(os.getpid()))
    time.sleep(60)
""")


def _stop_torchrun(tmp_path, mode: str, multi_host: bool, signals: int = 1):
    """Start 2 ranks of RANK under dilocox's torchrun, SIGTERM the launcher once both are up (``signals`` times, 1 s
    apart); return (exit code, stderr, the ranks' pids)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [sys.executable, "-m", "dilocox.launch.local_run", *(["--multi-host"] if multi_host else [])]
    cmd += ["--standalone", "--nproc_per_node=2", str(script), str(tmp_path), mode]
    err = open(tmp_path / "err.txt", "w+")
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"up{r}").exists() and (tmp_path / f"up{r}").read_text() for r in "01"):
            assert time.monotonic() < deadline and p.poll() is None, open(tmp_path / "err.txt").read()
            time.sleep(0.05)
        pids = [int((tmp_path / f"up{r}").read_text()) for r in "01"]
        for i in range(signals):
            time.sleep(1.0 if i else 0.2)
            p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=15)
        err.seek(0)
        return code, err.read(), pids
    finally:
        for pid in [p.pid, *pids]:
            try:
                os.killpg(pid, signal.SIGKILL)  # (torchrun's ranks run in sessions of their own)
            except OSError:
                pass
        if p.poll() is None:
            p.wait(timeout=10)
        err.close()


@pytest.mark.parametrize("multi_host", [False, True], ids=["loopback", "multi-host"])
def test_sigterm_to_torchrun_exits_128_plus_signal_without_a_traceback(tmp_path, multi_host):
    code, err, pids = _stop_torchrun(tmp_path, "ok", multi_host)
    assert (tmp_path / "saved0").exists() and (tmp_path / "saved1").exists(), err
    assert code == 128 + signal.SIGTERM, (code, err)  # was 1 (and with plain torchrun a SignalException traceback)
    assert "Traceback" not in err and "SignalException" not in err, err
    assert "torchrun: stopped by SIGTERM: every local rank (2) stopped" in err, err
    assert not any(_alive(pid) for pid in pids)


def test_a_rank_that_fails_while_stopping_is_the_launchs_exit_code(tmp_path):
    code, err, _ = _stop_torchrun(tmp_path, "fail", multi_host=True)
    assert code == 1, (code, err)
    assert "local rank 1 exited 1" in err and "Traceback" not in err, err


def test_a_third_signal_leaves_no_rank_running(tmp_path):
    """Ranks that do not stop (stuck in a collective): torchrun forwards a second signal and waits again, and a third
    one ends it at once (a SignalException out of its clean-up), while its ranks, in sessions of their own, ran on
    orphaned; they are killed now, and the launch says so."""
    code, err, pids = _stop_torchrun(tmp_path, "slow", multi_host=True, signals=3)
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), f"ranks outlived their torchrun: {pids}\n{err}"
    assert code == 128 + signal.SIGKILL and "still running: killed" in err, (code, err)
    assert "Traceback" not in err, err


# --------------------------------------------------------------------------- sbatch: a relative CONFIG


@pytest.mark.parametrize("script", ["dilocox", "elastic", "swarm"])
@pytest.mark.parametrize("where", ["submit", "chdir", "checkout"])
def test_sbatch_finds_a_relative_config_where_it_was_typed(tmp_path, monkeypatch, script, where):
    """DILOCOX_ROOT is the checkout; the job ran ``cd $DILOCOX_ROOT`` and then read CONFIG relative to it."""
    sub, job = tmp_path / "submit", tmp_path / "job"
    sub.mkdir()
    job.mkdir()
    name = "configs/tiny.yaml" if where == "checkout" else "my.yaml"  # (the checkout's own configs still work)
    want = {"submit": sub / name, "chdir": job / name, "checkout": os.path.join(ROOT, name)}[where]
    if where != "checkout":
        open(want, "w").write("train: {steps: 1}\n")
    monkeypatch.chdir(job)  # the job's working directory (sbatch --chdir), the submit dir elsewhere
    stubs = {
        "scontrol": 'echo "$FAKE_HOSTS"',
        "srun": 'while [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=0 "$@"',
        "fakepython": 'printf "%s\\n" "$*" >> "$LOG"',
        "torchrun": 'printf "%s\\n" "$*" >> "$LOG"',  # (what the scripts ran before: never the real one here)
    }
    env = dict(
        FAKE_HOSTS="gpu03",
        SLURM_JOB_NODELIST="gpu03",
        SLURM_NNODES="1",
        SLURM_SUBMIT_DIR=str(sub),
        DILOCOX_ROOT=ROOT,
        DILOCOX_RUN_DIR=str(tmp_path / "run"),
        DILOCOX_LIGHTHOUSE_WAIT_S="0",
        DILOCOX_WAIT_S="0",
        DILOCOX_SWARM_PEERS="1",
        PYTHON="fakepython",
    )
    p, lines = run_fake_sbatch(tmp_path, os.path.join(SLURM, f"{script}.sbatch"), stubs, [name], env, timeout=30)
    assert p.returncode == 0, p.stderr
    runs = [ln for ln in lines if " train " in ln or "--config" in ln]
    assert runs and all(f" {want} " in f"{ln} " for ln in runs), (str(want), lines)


def test_kill_and_reap_kills_what_an_exited_child_left_in_its_group(tmp_path):
    """A ``spawn``ed child that exited (not reaped yet) but left a process in its group: ``kill_and_reap`` saw
    ``poll()`` return its exit code and skipped the group kill, so the grandchild ran on, orphaned."""
    from dilocox.distributed.procs import kill_and_reap, spawn

    pidfile = tmp_path / "grandchild.pid"
    code = f"import subprocess; p = subprocess.Popen(['sleep', '120']); open({str(pidfile)!r}, 'w').write(str(p.pid))"
    child = spawn([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    while time.monotonic() < deadline:  # the child exits (a zombie until reaped): wait without reaping it
        if os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            break
        time.sleep(0.05)
    try:
        assert kill_and_reap(child, timeout_s=10) == 0
        for _ in range(100):
            if not _alive(grandchild):
                break
            time.sleep(0.05)
        assert not _alive(grandchild), "the grandchild outlived kill_and_reap"
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
