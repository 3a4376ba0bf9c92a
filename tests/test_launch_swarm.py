"""SWARM's launch surface (issue 11 part 7): ``dilocox swarm`` / ``dilocox launch --swarm`` and
``launcher/slurm/swarm.sbatch`` (its commands under stub srun/scontrol, and a real 2+1-peer job through it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.fake_slurm import run_fake_sbatch
from tests.spawn import free_port, processes_naming

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launcher", "slurm", "swarm.sbatch")
CFG = os.path.join(ROOT, "configs", "tiny.yaml")  # (the script passes a relative CONFIG on as an absolute path)
TINY = [
    "--model.n_layers=2",
    "--model.d_model=64",
    "--data.max_bytes=200000",
    "--train.batch_size=4",
    "--train.seq_len=32",
    "--optim.warmup_steps=0",
    "--swarm.step_timeout_s=60",
    "--swarm.sync_timeout_s=60",
    "--swarm.rpc_timeout_s=20",
]


def _dilocox(args: list[str], timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dilocox.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, **kw,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"dilocox {' '.join(args)} ran past {timeout}s:\n{out[-2000:]}\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _peer_processes(out_dir: str) -> list[str]:
    """Live processes whose command line names ``out_dir`` (peers of that job that outlived it)."""
    return processes_naming(out_dir, "dilocox.swarm.peer")


# --------------------------------------------------------------------------- dilocox swarm / launch --swarm


def test_swarm_help_lists_options_and_bench_is_registered():
    swarm, launch, top, bench = _cli_cases(
        [["swarm", "--help"], ["launch", "--swarm", "--help"], ["--help"], ["bench", "--help"]]
    )
    assert swarm[0] == 0, swarm[2]
    for opt in ("--peers", "--steps", "--out", "--timeout-s", "--delay", "--section.key=value"):
        assert opt in swarm[1], opt
    assert launch[0] == 0 and "dilocox launch --swarm" in launch[1], launch[2]
    assert "dilocox swarm CONFIG" in top[1]
    assert "swarm " in bench[1] and "DiLoCo-SWARM" in bench[1]


BAD_INPUT = [
    (["swarm"], "needs a CONFIG file"),
    (["launch", "--swarm"], "--swarm needs a CONFIG file"),
    (["swarm", "configs/tiny.yaml", "--peers", "2,x"], "--peers '2,x' must be peers per stage"),
    (["swarm", "configs/tiny.yaml", "--peers", "0,2"], "--peers '0,2' must be peers per stage"),
    (["swarm", "configs/tiny.yaml", "--steps", "0"], "--steps 0 must be at least 1"),
    (["swarm", "configs/tiny.yaml", "--delay", "s5p0=1"], "--delay s5p0: no such peer"),
    (["swarm", "configs/tiny.yaml", "--delay", "s1p0=fast"], "must be PEER=SECONDS"),
    (["swarm", "configs/tiny.yaml", "stray"], "unexpected argument 'stray'"),
    (["swarm", "configs/tiny.yaml", "--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["swarm", "no/such.yaml"], "does not exist"),
    (["launch", "--swarm", "configs/tiny.yaml", "--swarm.routing=nope"], "swarm.routing"),
    (["swarm", "configs/tiny.yaml", "--model.tie_embeddings=true"], "model.tie_embeddings=True must be false"),
    (["swarm", "configs/tiny.yaml", "--swarm.microbatch_size=3"], "must divide train.batch_size"),
    (["swarm", "configs/tiny.yaml", "--resume", "--checkpoint.every=2"], "--resume: no complete SWARM checkpoint in"),
]

# every case in ONE child process (an interpreter + torch import per case cost ~5 s each): the child calls the CLI's
# main() per case with stdout and stderr captured and reports (exit code, stdout, stderr) as JSON
_CLI_DRIVER = """
import contextlib, io, json, sys
from dilocox.cli import main
res = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    res.append([rc, out.getvalue(), err.getvalue()])
print(json.dumps(res))
"""


def _cli_cases(argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of ``dilocox <argv>`` for each argv, all in one child process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-c", _CLI_DRIVER, json.dumps(argvs)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return [tuple(r) for r in json.loads(p.stdout.strip().splitlines()[-1])]


def test_swarm_bad_input_is_one_line_exit_2(tmp_path):
    argvs = [[*a, "--out", str(tmp_path)] if any(".yaml" in x for x in a) else a for a, _ in BAD_INPUT]
    for (args, needle), (rc, _, err) in zip(BAD_INPUT, _cli_cases(argvs), strict=True):
        assert rc == 2, (args, rc, err[-2000:])
        assert needle in err, (args, err)
        assert len(err.strip().splitlines()) == 1, (args, err)
    assert not _peer_processes(str(tmp_path))
    # a fresh run into a directory that holds an earlier run's SWARM checkpoints: refused before any peer starts
    os.makedirs(tmp_path / "checkpoints" / "step_00000004")
    [(rc, _, err)] = _cli_cases([["swarm", "configs/tiny.yaml", "--out", str(tmp_path), "--checkpoint.every=2"]])
    assert rc == 2 and "already holds SWARM checkpoints of an earlier run (steps 4..4): resume it with --resume" in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("form", [["launch", "--swarm"]])  # `dilocox swarm` is the same entry point (bad-input tests)
def test_cli_runs_a_2x2_swarm_job_and_leaves_nothing(form, tmp_path):
    out = str(tmp_path / "job")
    p = _dilocox(
        [*form, "configs/tiny.yaml", "--peers", "2,2", "--steps", "1", "--out", out, "--timeout-s", "200", *TINY],
        timeout=280,
    )
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "swarm job: 4 peers" in p.stdout
    for name in ("s0p0", "s0p1", "s1p0", "s1p1"):
        assert f"{name}: exit 0, 1 steps" in p.stdout, p.stdout
        with open(os.path.join(out, f"{name}.jsonl")) as f:
            recs = [json.loads(line) for line in f]
        assert [r["step"] for r in recs] == [0]
    # 2 stage-0 peers x 4 sequences / 2 per microbatch = 4 microbatches, all trained by stage 1
    with open(os.path.join(out, "s1p0.jsonl")) as f, open(os.path.join(out, "s1p1.jsonl")) as g:
        assert json.loads(f.readline())["microbatches"] + json.loads(g.readline())["microbatches"] == 4
    assert not _peer_processes(out), "a peer outlived the job"


# --------------------------------------------------------------------------- launcher/slurm/swarm.sbatch

STUBS = {
    "scontrol": 'for h in $FAKE_HOSTS; do echo "$h"; done',
    # srun: log the step's node and run its task there (background steps interleave: compare sorted lines)
    # (the script's closing SIGTERM to its services cannot cut a fake service's line: run_fake_sbatch runs the script
    # with SIGTERM ignored, from before it starts any step)
    "srun": 'node=""\nwhile [[ $1 == --* ]]; do [[ $1 == --nodelist=* ]] && node=${1#--nodelist=}; shift; done\n'
    'SLURMD_NODENAME=$node exec "$@"',
    "fakepython": 'echo "$SLURMD_NODENAME python $*" >> "$LOG"',
}


def run_sbatch(tmp_path, hosts: str, peers: str = "2,2", python: str = "fakepython", extra_env=None, args=(),
               timeout: float = 60) -> tuple[subprocess.CompletedProcess, list[str]]:  # fmt: skip
    """``python``: a stub that logs each task (fakepython, or a test's own), or a real interpreter (sys.executable)."""
    env = dict(
        FAKE_HOSTS=hosts,
        SLURM_JOB_NODELIST="fake",
        DILOCOX_RUN_DIR=str(tmp_path / "run"),
        DILOCOX_SWARM_PEERS=peers,
        DILOCOX_WAIT_S="0",
        PYTHON=python,
        OMP_NUM_THREADS="1",
    )
    env.update(extra_env or {})
    argv = ["configs/tiny.yaml", *(args or ["--train.steps=3"])]
    p, lines = run_fake_sbatch(tmp_path, SBATCH, STUBS, argv, env, timeout=timeout, fake_tasks=python != sys.executable)
    return p, sorted(lines)


def test_swarm_sbatch_parses():
    p = subprocess.run(["bash", "-n", SBATCH], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_swarm_sbatch_one_step_per_peer_store_and_lighthouses_on_first_node(tmp_path):
    p, lines = run_sbatch(tmp_path, "gpu03 gpu04 gpu07", peers="3,1,2")
    assert p.returncode == 0, p.stderr
    services = [ln for ln in lines if "dilocox.swarm.peer" not in ln]
    run = str(tmp_path / "run")
    auth = f"--secret-file {run}/secret"  # store and lighthouses behind guards (docs/SECURITY.md)
    assert services == sorted(
        [
            f"gpu03 python -m dilocox.cli swarm store --port 29520 {auth}",
            "gpu03 python -m dilocox.cli lighthouse --min-replicas 1 --bind 0.0.0.0:29530 --heartbeat-timeout-ms "
            f"5000 --join-timeout-ms 60000 {auth}",
            "gpu03 python -m dilocox.cli lighthouse --min-replicas 1 --bind 0.0.0.0:29532 --heartbeat-timeout-ms "
            f"5000 --join-timeout-ms 60000 {auth}",
        ]
    ), services  # no lighthouse for stage 1: it has one peer
    peers = [ln for ln in lines if "dilocox.swarm.peer" in ln]
    want = []
    for n, (j, k) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]):
        node = ["gpu03", "gpu04", "gpu07"][n % 3]
        lh = {0: " --lighthouse http://gpu03:29530", 2: " --lighthouse http://gpu03:29532"}.get(j, "")
        want.append(
            f"{node} python -m dilocox.swarm.peer --config {CFG} --stage {j} --index {k} "
            f"--store gpu03:29520 --out {run}{lh} -- --train.steps=3 --swarm.peers_per_stage=[3,1,2] "
            f"--security.secret_file={run}/secret --security.guard_services=true --swarm.host={node}"
        )
    assert peers == sorted(want)
    assert p.stdout.count("exited with 0") == 6
    (tmp_path / "plain").mkdir()  # DILOCOX_LIGHTHOUSE_AUTH=0: plain services, and the peers are told so
    p, lines = run_sbatch(tmp_path / "plain", "gpu03", peers="2", extra_env={"DILOCOX_LIGHTHOUSE_AUTH": "0"})
    assert p.returncode == 0, p.stderr
    assert not any("--secret-file" in ln for ln in lines), lines
    assert all(ln.endswith("--security.guard_services=false --swarm.host=gpu03") for ln in lines if ".peer " in ln)
    plain = [ln for ln in lines if "cli lighthouse " in ln or "swarm store " in ln]  # on 0.0.0.0 without a secret:
    assert len(plain) >= 2 and all(ln.endswith("--insecure") for ln in plain), plain  # said --insecure (issue 42)


def test_swarm_sbatch_with_rebalancing_starts_the_rebalancer_and_every_lighthouse(tmp_path):
    p, lines = run_sbatch(tmp_path, "gpu03 gpu04", peers="2,1", extra_env={"DILOCOX_SWARM_REBALANCE_S": "300"})
    assert p.returncode == 0, p.stderr
    run = str(tmp_path / "run")
    services = [ln for ln in lines if "dilocox.swarm.peer" not in ln]
    lh = f"--heartbeat-timeout-ms 5000 --join-timeout-ms 60000 --secret-file {run}/secret"
    ovr = (
        f"--train.steps=3 --swarm.peers_per_stage=[2,1] --swarm.rebalance_period_s=300 "
        f"--security.secret_file={run}/secret --security.guard_services=true"
    )
    assert services == sorted(
        [
            f"gpu03 python -m dilocox.cli swarm store --port 29520 --secret-file {run}/secret",
            f"gpu03 python -m dilocox.cli lighthouse --min-replicas 1 --bind 0.0.0.0:29530 {lh}",
            f"gpu03 python -m dilocox.cli lighthouse --min-replicas 1 --bind 0.0.0.0:29531 {lh}",  # one-peer stage too
            f"gpu03 python -m dilocox.cli swarm rebalance --config {CFG} --store gpu03:29520 --out {run} "
            f"--lighthouse 0=http://gpu03:29530 --lighthouse 1=http://gpu03:29531 -- {ovr}",
        ]
    ), services
    peers = [ln for ln in lines if "dilocox.swarm.peer" in ln]
    assert len(peers) == 3 and all(f"-- {ovr} --swarm.host=" in ln for ln in peers), peers
    assert any("--stage 1 --index 0 --store gpu03:29520 --out " + run + " --lighthouse http://gpu03:29531" in ln
               for ln in peers), peers  # fmt: skip
    (tmp_path / "bad").mkdir()
    p, lines = run_sbatch(tmp_path / "bad", "n1", extra_env={"DILOCOX_SWARM_REBALANCE_S": "soon"})
    assert p.returncode == 2 and "DILOCOX_SWARM_REBALANCE_S=soon must be seconds" in p.stderr and not lines


@pytest.mark.parametrize("peers", ["2,x", "0,2", "2,,2"])
def test_swarm_sbatch_rejects_bad_peers(tmp_path, peers):
    p, lines = run_sbatch(tmp_path, "n1 n2", peers=peers)
    assert p.returncode == 2 and "DILOCOX_SWARM_PEERS" in p.stderr and not lines, p.stderr


def test_swarm_sbatch_reports_a_failed_peer_but_waits_for_the_others(tmp_path):
    """A peer whose step fails ends only that step: the others run to the end; the job's status is the failure."""
    stub = tmp_path / "failpython"
    stub.write_text('#!/bin/bash\necho "$SLURMD_NODENAME python $*" >> "$LOG"\n[[ "$*" == *"--stage 1 --index 0"* ]] '
                    '&& exit 3\nexit 0\n')  # fmt: skip
    stub.chmod(0o755)
    p, lines = run_sbatch(tmp_path, "n1 n2", python=str(stub))
    assert p.returncode == 3, p.stderr
    assert "peer s1p0 exited with 3" in p.stdout and p.stdout.count("exited with 0") == 3
    assert sum("dilocox.swarm.peer" in ln for ln in lines) == 4
    assert f"DILOCOX_RUN_DIR={tmp_path / 'run'} DILOCOX_SWARM_RESUME=1" in p.stdout  # how to go on


def test_swarm_sbatch_resume_passes_it_to_every_peer(tmp_path):
    p, lines = run_sbatch(tmp_path, "n1 n2", peers="2,1", extra_env={"DILOCOX_SWARM_RESUME": "1"})
    assert p.returncode == 0, p.stderr
    peers = [ln for ln in lines if "dilocox.swarm.peer" in ln]
    assert len(peers) == 3 and all(f"--out {tmp_path / 'run'} --resume" in ln for ln in peers), peers
    (tmp_path / "bad").mkdir()
    p, lines = run_sbatch(tmp_path / "bad", "n1", extra_env={"DILOCOX_SWARM_RESUME": "yes"})
    assert p.returncode == 2 and "DILOCOX_SWARM_RESUME=yes must be 1" in p.stderr and not lines


def _free_ports(n: int) -> list[int]:
    """n distinct free ports from this xdist worker's own slice (``tests/spawn.free_port``: taken in turn, so distinct;
    a port the kernel hands out and we release can be another worker's before the job binds it)."""
    ports = [free_port() for _ in range(n)]
    assert len(set(ports)) == n, ports
    return ports


@pytest.mark.slow
def test_swarm_sbatch_runs_a_real_job_on_localhost(tmp_path):
    """The script end to end with real processes (srun runs each step here): store, a lighthouse, 2+1 peers."""
    store, lighthouse = _free_ports(2)  # (stage 0's lighthouse only: stage 1 has one peer)
    ports = {"DILOCOX_STORE_PORT": str(store), "DILOCOX_LIGHTHOUSE_PORT": str(lighthouse)}
    ports["DILOCOX_WAIT_S"] = "60"
    p, _ = run_sbatch(
        tmp_path, "127.0.0.1", peers="2,1", python=sys.executable, extra_env=ports,
        args=[*TINY, "--train.steps=2"], timeout=280,
    )  # fmt: skip
    run = tmp_path / "run"
    logs = {n: (run / f"{n}.out").read_text()[-2000:] for n in ("s0p0", "s0p1", "s1p0") if (run / f"{n}.out").exists()}
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}\n{logs}"
    for name in ("s0p0", "s0p1", "s1p0"):
        recs = [json.loads(line) for line in (run / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs] == [0, 1], name
        assert (run / f"{name}.pt").exists()
    s1 = [json.loads(line) for line in (run / "s1p0.jsonl").read_text().splitlines()]
    assert [r["microbatches"] for r in s1] == [4, 4]  # 2 stage-0 peers x 2 microbatches, all served
    assert not _peer_processes(str(run))


def test_swarm_layout_checks_do_not_touch_other_runs():
    """The swarm section's checks against the model apply to SWARM runs only: a plain run with a tied embedding
    still loads (every tied-embedding run failed to load before this was split)."""
    from dilocox.config import ConfigError, load_config, validate_swarm_layout

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--model.tie_embeddings=true"])
    with pytest.raises(ConfigError, match="model.tie_embeddings"):
        validate_swarm_layout(cfg)
