"""launcher/slurm/*.sbatch and tc_cap.sh under stub SLURM commands: what happens when a step fails or a signal comes.

- dilocox.sbatch: a tc cap that fails on one node is removed from the nodes it did cap (the removal was armed only
  after the cap step had succeeded everywhere), and a node name that does not resolve is named (pipefail made the
  message dead code: exit 2 and nothing said).
- elastic.sbatch / swarm.sbatch: SIGTERM or SIGINT to the batch shell (scancel, Ctrl-C under salloc) is forwarded to
  the steps, and the script then waits for every step's own status: `wait` returns 128+n as soon as a trapped signal
  arrives, so the script used to report 143 for the step it was waiting on and could end, ending the job, while that
  step was still saving.
- elastic.sbatch says how to resume (its default run dir is new in every job); swarm.sbatch prints the whole restart
  command of each peer; a run secret that cannot be written is named.
- tc_cap.sh: a rate without a unit below 1000 is refused (``100`` was 100 bit/s), and a per-destination cap can be
  applied again over an earlier one (``tc qdisc replace`` of a root htb by another one fails).
"""

import os
import shlex
import signal
import subprocess
import time

import pytest

from dilocox.launch.emulate import Cluster, netns_available
from tests.fake_slurm import run_fake_sbatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "launcher", "slurm")
DILOCOX, ELASTIC, SWARM = (os.path.join(SLURM, f"{n}.sbatch") for n in ("dilocox", "elastic", "swarm"))
TC_CAP = os.path.join(SLURM, "tc_cap.sh")
NETNS_OK, NETNS_WHY = netns_available()

SCONTROL = 'for h in $FAKE_HOSTS; do echo "$h"; done'
# srun for dilocox.sbatch: every node's task (SLURM_NODEID = its index), all of them even when one fails (as SLURM
# runs a step's tasks in parallel); the step's status is the highest
SRUN_ALL_NODES = (
    "while [[ $1 == --* ]]; do shift; done\n"
    'read -ra hosts <<< "$FAKE_HOSTS"; rc=0\n'
    'for i in "${!hosts[@]}"; do SLURM_NODEID=$i SLURMD_NODENAME=${hosts[$i]} "$@" || { c=$?; ((c > rc)) && rc=$c; }; '
    "done\nexit $rc"
)
# srun for the elastic / swarm steps: the task replaces srun, so a signal to the step's pid reaches the task
SRUN_ONE_NODE = (
    'node=""\nwhile [[ $1 == --* ]]; do [[ $1 == --nodelist=* ]] && node=${1#--nodelist=}; shift; done\n'
    'SLURMD_NODENAME=$node exec "$@"'
)


def _dilocox_cap(tmp_path, hosts: str, tc_cap_body: str, **env):
    stubs = {
        "scontrol": SCONTROL,
        "srun": SRUN_ALL_NODES,
        "fakepython": 'echo "node$SLURM_NODEID torchrun" >> "$LOG"',  # (python -m dilocox.launch.local_run)
        "getent": '[[ $2 == bad* ]] && exit 2; n=${2//[!0-9]/}; echo "10.0.0.$((10#$n)) STREAM $2"',
        "fake_tc_cap.sh": tc_cap_body,
    }
    env = dict(
        FAKE_HOSTS=hosts,
        SLURM_JOB_NODELIST="fake",
        SLURM_NNODES=str(len(hosts.split())),
        DILOCOX_TC_CAP_SCRIPT=str(tmp_path / "bin" / "fake_tc_cap.sh"),
        DILOCOX_TC_IFACE="eth9",
        DILOCOX_TC_RATE="1gbit",
        PYTHON="fakepython",
        **env,
    )
    return run_fake_sbatch(tmp_path, DILOCOX, stubs, ["configs/x.yaml"], env, timeout=30)


def test_dilocox_sbatch_removes_a_cap_that_failed_on_another_node(tmp_path):
    body = (
        'echo "node$SLURM_NODEID tc_cap $*" >> "$LOG"\n'
        'if [[ $SLURM_NODEID == 1 && $2 != --remove ]]; then echo "no interface $1 here" >&2; exit 1; fi'
    )
    p, lines = _dilocox_cap(tmp_path, "gpu03 gpu04", body)
    assert p.returncode != 0
    assert not any("torchrun" in ln for ln in lines), lines  # no training on a half-capped job
    assert "node0 tc_cap eth9 1gbit" in lines  # node 0 was capped ...
    assert "node0 tc_cap eth9 --remove" in lines, lines  # ... and is uncapped again (it stayed capped)
    assert "capping eth9 at 1gbit failed" in p.stderr, p.stderr


def test_dilocox_sbatch_names_a_node_that_does_not_resolve(tmp_path):
    body = 'echo "node$SLURM_NODEID tc_cap $*" >> "$LOG"'
    p, lines = _dilocox_cap(tmp_path, "gpu03 bad07", body, DILOCOX_NODES_PER_REPLICA="1")
    assert p.returncode != 0
    assert "tc: cannot resolve bad07" in p.stderr, p.stderr  # was: exit 2, nothing said
    assert "node1 tc_cap eth9 1gbit 10.0.0.3/32" in lines  # node 1 (bad07) capped its link to node 0 ...
    assert "node1 tc_cap eth9 --remove" in lines, lines  # ... and that cap is removed
    assert not any("torchrun" in ln for ln in lines), lines


# --------------------------------------------------------------------------- a signal to the batch shell

# A step task: logs "started"; on SIGTERM the one on gpu03 takes 3 s (a replica saving its checkpoint) and exits 7,
# the others exit 143 at once; services (the lighthouse, the store) exit 0. Short sleeps: a trap runs between them.
TASK = r"""
if [[ " $* " == *" lighthouse "* || " $* " == *" swarm store "* ]]; then
  trap 'exit 0' TERM; for ((i = 0; i < 600; i++)); do sleep 0.05; done; exit 0
fi
stop() {
  if [[ $SLURMD_NODENAME == gpu03 ]]; then sleep 3; echo "$SLURMD_NODENAME saved" >> "$LOG"; exit 7; fi
  exit 143
}
trap stop TERM
echo "$SLURMD_NODENAME started" >> "$LOG"
for ((i = 0; i < 600; i++)); do sleep 0.05; done
"""


def _catches_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM (bash: once ``trap ... TERM`` has run), from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
@pytest.mark.parametrize("script", [ELASTIC, SWARM], ids=["elastic", "swarm"])
def test_sigterm_to_the_batch_shell_waits_for_every_step(tmp_path, script):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"scontrol": SCONTROL, "srun": SRUN_ONE_NODE, "torchrun": TASK, "fakepython": TASK}.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    with open(script) as f:
        text = f.read()
    env = {k: v for k, v in os.environ.items() if not (k.startswith("DILOCOX_") and k in text)}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        LOG=str(log),
        SLURM_JOB_ID="42",
        SLURM_JOB_NODELIST="fake",
        FAKE_HOSTS="gpu03 gpu04",
        DILOCOX_ROOT=ROOT,
        DILOCOX_RUN_DIR=str(tmp_path / "run"),
        DILOCOX_LIGHTHOUSE_WAIT_S="0",
        DILOCOX_WAIT_S="0",
        DILOCOX_SWARM_PEERS="1,1",  # s0p0 on gpu03, s1p0 on gpu04
        PYTHON="fakepython",
    )
    p = subprocess.Popen(
        ["bash", script, "configs/x.yaml"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # both steps' tasks are up and the script has set its trap
            started = log.read_text().splitlines() if log.exists() else []
            if sum(ln.endswith(" started") for ln in started) == 2 and _catches_sigterm(p.pid):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the steps did not start: {log.read_text() if log.exists() else ''}")
        p.send_signal(signal.SIGTERM)  # scancel: the batch shell gets SIGTERM
        out, err = p.communicate(timeout=25)
        done = log.read_text().splitlines()  # what the steps had done when the script (= the job) ended
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "gpu03 saved" in done, f"the job ended before the step on gpu03 had saved\n{out}\n{err}\n{done}"
    first = "replica 0" if script == ELASTIC else "peer s0p0"
    assert f"{first} exited with 7" in out, out  # the step's own status, not the interrupted wait's 143
    assert p.returncode == 7, (p.returncode, out, err)


# --------------------------------------------------------------------------- what the scripts say


ELASTIC_STUBS = {"scontrol": SCONTROL, "srun": SRUN_ONE_NODE, "fakepython": "exit 0"}


def test_elastic_sbatch_says_how_to_resume(tmp_path):
    """The default run dir is runs/elastic-$SLURM_JOB_ID, new in every job: resubmitting as is starts over (while
    each rank says "run the same command again to resume"), so the job says which DILOCOX_RUN_DIR to give."""
    # a replica fails (or is stopped by SIGTERM after its save); the lighthouse exits 0
    stubs = dict(ELASTIC_STUBS, fakepython='[[ " $* " == *" train "* ]] && exit 3; exit 0')
    run = tmp_path / "run"
    env = dict(
        FAKE_HOSTS="gpu03 gpu04",
        SLURM_JOB_NODELIST="fake",
        DILOCOX_RUN_DIR=str(run),
        DILOCOX_LIGHTHOUSE_WAIT_S="0",
        PYTHON="fakepython",
    )
    p, _ = run_fake_sbatch(tmp_path, ELASTIC, stubs, ["configs/x.yaml"], env, timeout=30)
    assert p.returncode == 3
    assert f"resubmit with DILOCOX_RUN_DIR={run}" in p.stdout, p.stdout


def test_run_secret_that_cannot_be_written_is_named(tmp_path):
    secret = tmp_path / "no-such-dir" / "secret"
    env = dict(
        FAKE_HOSTS="gpu03",
        SLURM_JOB_NODELIST="fake",
        DILOCOX_RUN_DIR=str(tmp_path / "run"),
        DILOCOX_SECRET_FILE=str(secret),
        DILOCOX_LIGHTHOUSE_WAIT_S="0",
        PYTHON="fakepython",
    )
    p, lines = run_fake_sbatch(tmp_path, ELASTIC, ELASTIC_STUBS, ["c.yaml"], env, timeout=30)
    assert p.returncode == 2 and not lines
    assert str(secret) in p.stderr, p.stderr  # was: exit 2, nothing said


def test_swarm_sbatch_prints_the_whole_restart_command(tmp_path):
    stubs = {
        "scontrol": SCONTROL,
        "srun": SRUN_ONE_NODE,
        "fakepython": 'printf "%q " "$@" >> "$LOG"; echo >> "$LOG"',
    }
    env = dict(
        FAKE_HOSTS="gpu03 gpu04",
        SLURM_JOB_NODELIST="fake",
        DILOCOX_RUN_DIR=str(tmp_path / "run dir"),
        DILOCOX_SWARM_PEERS="1,2",
        DILOCOX_WAIT_S="0",
        PYTHON="fakepython",
    )
    p, lines = run_fake_sbatch(tmp_path, SWARM, stubs, ["my configs/x.yaml", "--train.steps=3"], env, timeout=30)
    assert p.returncode == 0, p.stderr
    started = {}
    for ln in lines:
        argv = shlex.split(ln)
        if "dilocox.swarm.peer" in argv:
            started[(argv[argv.index("--stage") + 1], argv[argv.index("--index") + 1])] = argv
    restarts = [ln.split(f"from {ROOT}: ", 1)[1][:-1] for ln in p.stdout.splitlines() if "to restart it" in ln]
    assert len(restarts) == len(started) == 3, p.stdout
    for cmd in restarts:
        argv = shlex.split(cmd)
        assert argv[:3] == ["srun", "--jobid=42", "--overlap"] and argv[5].startswith("--nodelist=gpu0"), argv
        peer = argv[6:]
        orig = started[(peer[peer.index("--stage") + 1], peer[peer.index("--index") + 1])]
        cut = orig.index("--")
        assert peer == ["fakepython", *orig[:cut], "--join", *orig[cut:]], (peer, orig)  # the same, as a joiner


def test_swarm_sbatch_stops_at_once_when_its_store_exits(tmp_path):
    """The store's step died at start-up: swarm.sbatch waited its whole DILOCOX_WAIT_S (60 s by default) for a port
    nothing would open; it now stops when the step ends, as elastic.sbatch does for its lighthouse."""
    stubs = {"scontrol": SCONTROL, "srun": SRUN_ONE_NODE, "fakepython": "exit 1"}
    env = dict(FAKE_HOSTS="127.0.0.1", SLURM_JOB_NODELIST="fake", DILOCOX_RUN_DIR=str(tmp_path / "run"),
               DILOCOX_SWARM_PEERS="1,1", DILOCOX_WAIT_S="60", DILOCOX_STORE_PORT="1", PYTHON="fakepython")  # fmt: skip
    t0 = time.monotonic()
    p, _ = run_fake_sbatch(tmp_path, SWARM, stubs, ["configs/x.yaml"], env, timeout=50)
    assert p.returncode == 1 and "the service for 127.0.0.1:1 exited" in p.stderr, p.stderr[-2000:]
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- tc_cap.sh


def _tc_cap_with_stub_tc(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """tc_cap.sh with a ``tc`` that only logs: no root, nothing changed on this machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "tc").write_text('#!/bin/bash\necho "tc $*" >> "$LOG"\n')
    (bin_dir / "tc").chmod(0o755)
    log = tmp_path / "tc.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log))
    p = subprocess.run(["bash", TC_CAP, "lo", *args], env=env, capture_output=True, text=True, timeout=20)
    return p, log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(not os.path.exists("/sys/class/net/lo"), reason="no /sys/class/net/lo")
def test_tc_cap_refuses_a_rate_without_a_unit_below_1000(tmp_path):
    p, calls = _tc_cap_with_stub_tc(tmp_path, "100")
    assert p.returncode != 0 and "'100'" in p.stderr and not calls, (p.stderr, calls)  # was: capped at 100 bit/s
    p, calls = _tc_cap_with_stub_tc(tmp_path, "1000000")  # a bare number of 1000 or more is bit/s
    assert p.returncode == 0 and calls == [
        "tc qdisc replace dev lo root tbf rate 1000000bit burst 65536 latency 100ms"
    ], calls


@pytest.mark.skipif(not os.path.exists("/sys/class/net/lo"), reason="no /sys/class/net/lo")
def test_tc_cap_per_destination_replaces_an_earlier_cap(tmp_path):
    p, calls = _tc_cap_with_stub_tc(tmp_path, "1gbit", "10.0.0.7/32")
    assert p.returncode == 0, p.stderr
    assert calls[:2] == ["tc qdisc del dev lo root", "tc qdisc add dev lo root handle 1: htb default 0"], calls


@pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces unavailable: {NETNS_WHY}")
def test_tc_cap_twice_in_a_namespace():
    """The same per-destination cap applied twice (a job after one killed hard), then another: each one replaces
    the last (it was "Error: Change operation not supported by specified qdisc" and exit 2)."""

    def cap(c: Cluster, *args: str) -> subprocess.CompletedProcess:
        argv = ["ip", "netns", "exec", c.ns(0), "bash", TC_CAP, c.ifname(0), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=20)

    with Cluster(2) as c:
        for args in (["1gbit", "10.0.0.7/32"], ["1gbit", "10.0.0.7/32"], ["2gbit", "10.0.0.9/32"]):
            p = cap(c, *args)
            assert p.returncode == 0, (args, p.stderr)
        filters = subprocess.run(
            ["tc", "-n", c.ns(0), "filter", "show", "dev", c.ifname(0)], capture_output=True, text=True
        ).stdout
        classes = subprocess.run(
            ["tc", "-n", c.ns(0), "class", "show", "dev", c.ifname(0)], capture_output=True, text=True
        ).stdout
        assert "0a000009" in filters and "0a000007" not in filters, filters  # only the last cap's destination
        assert "rate 2Gbit" in classes, classes
        assert cap(c, "--remove").returncode == 0


def test_log_lines_under_plain_srun_name_slurms_rank(monkeypatch, capsys):
    """Plain ``srun python -m dilocox.cli train`` sets SLURM_PROCID, not RANK: every rank's line said [rank 0]."""
    from dilocox.distributed import signals

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    signals._rank_log("received SIGTERM")
    assert capsys.readouterr().err == "[rank 3] received SIGTERM\n"
    monkeypatch.setenv("RANK", "5")  # (torchrun's, where both are set)
    signals._rank_log("x")
    assert capsys.readouterr().err == "[rank 5] x\n"
