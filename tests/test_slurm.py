"""SLURM side: script syntax, the commands the sbatch script builds, rank derivation, tc_cap.sh."""

import os
import subprocess
import sys
import textwrap

import pytest

from dilocox.distributed.topology import env_rank_world, slurm_master_addr
from dilocox.launch.emulate import Cluster, netns_available
from tests.fake_slurm import run_fake_sbatch
from tests.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = os.path.join(ROOT, "launcher", "slurm")
SBATCH, TC_CAP = os.path.join(SLURM, "dilocox.sbatch"), os.path.join(SLURM, "tc_cap.sh")
OK, WHY = netns_available()


@pytest.mark.parametrize("script", [SBATCH, TC_CAP, os.path.join(ROOT, "launcher", "run_local.sh")])
def test_scripts_parse(script):
    p = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


# --------------------------------------------------------------------------- env derivation


def test_env_rank_world_from_plain_slurm(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "13")
    monkeypatch.setenv("SLURM_NTASKS", "24")
    monkeypatch.setenv("SLURM_LOCALID", "5")
    assert env_rank_world() == (13, 24, 5)
    monkeypatch.setenv("RANK", "2")  # torchrun's variables win over SLURM's
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert env_rank_world() == (2, 16, 2)


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("gpu[03-04,07]", "gpu03"),
        ("gpu03", "gpu03"),
        ("gpu[07,03-04]", "gpu07"),
        ("cpu3,gpu[01-02]", "cpu3"),
        ("gpu[03-04,07],cpu[1-2]", "gpu03"),
        ("node-a[001-016]", "node-a001"),
    ],
)
def test_slurm_master_addr(nodelist, first):
    assert slurm_master_addr(nodelist) == first


@pytest.mark.parametrize("nodelist,first", [("rack[1-2]-node[01-02]", "rack1-node01"), ("n[1-2]x", "n1x")])
def test_slurm_master_addr_with_suffix(nodelist, first):
    assert slurm_master_addr(nodelist) == first


RANK_MAIN = textwrap.dedent("""
    import sys; sys.path.insert(0, sys.argv[1])
    import torch, torch.distributed as dist
    from dilocox.distributed.topology import init_distributed
    rank, world, local = init_distributed(backend="gloo")
    x = torch.tensor([float(rank + 1)]); dist.all_reduce(x)
    import os; print(rank, world, local, os.environ["MASTER_ADDR"], int(x.item()), flush=True)
    dist.destroy_process_group()
""")


def test_init_distributed_from_slurm_env():
    """Two processes that only have srun's variables form one gloo group (MASTER_ADDR from the nodelist)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(SLURM_NTASKS="2", SLURM_NODELIST="localhost", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_MAIN, ROOT],
            env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [["0", "2", "0", "localhost", "3"], ["1", "2", "1", "localhost", "3"]]


# --------------------------------------------------------------------------- the sbatch script, dry


STUBS = {
    "scontrol": 'for h in $FAKE_HOSTS; do echo "$h"; done',
    # srun: drop its options, run the task once per node with that node's SLURM_NODEID
    "srun": "while [[ $1 == --* ]]; do shift; done\n"
    'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done',
    "fakepython": 'echo "node$SLURM_NODEID python $*" >> "$LOG"',  # torchrun: python -m dilocox.launch.local_run
    "getent": 'n=${2//[!0-9]/}; echo "10.0.0.$((10#$n)) STREAM $2"',
    "fake_tc_cap.sh": 'echo "node$SLURM_NODEID tc_cap $*" >> "$LOG"',
}


def run_sbatch(tmp_path, **extra) -> list[str]:
    env = dict(
        FAKE_HOSTS="gpu03 gpu04 gpu07 gpu08",
        SLURM_JOB_NODELIST="gpu[03-04,07-08]",
        SLURM_NNODES="4",
        DILOCOX_TC_CAP_SCRIPT=str(tmp_path / "bin" / "fake_tc_cap.sh"),
        PYTHON="fakepython",
        **extra,
    )
    p, lines = run_fake_sbatch(tmp_path, SBATCH, STUBS, ["configs/x.yaml", "--train.steps=3"], env)
    assert p.returncode == 0, p.stderr
    return lines


def test_sbatch_builds_c10d_torchrun(tmp_path):
    lines = run_sbatch(tmp_path)
    want = (
        "python -m dilocox.launch.local_run --multi-host --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d "
        "--rdzv_endpoint gpu03:29500 --rdzv_id 42 "
        "-m dilocox.cli train configs/x.yaml --train.steps=3"
    )
    assert lines == [f"node{i} {want}" for i in range(4)]


def test_sbatch_caps_only_other_replicas_and_goes_static(tmp_path):
    lines = run_sbatch(tmp_path, DILOCOX_TC_IFACE="eth9", DILOCOX_TC_RATE="1gbit", DILOCOX_NODES_PER_REPLICA="2")
    caps = [
        f"node{i} tc_cap eth9 1gbit {d}"
        for i, d in enumerate(["10.0.0.7/32 10.0.0.8/32"] * 2 + ["10.0.0.3/32 10.0.0.4/32"] * 2)
    ]
    runs = [
        f"node{i} python -m dilocox.launch.local_run --multi-host --nnodes 4 --node_rank {i} --nproc_per_node 8 "
        f"--master_addr gpu03 --master_port 29500 "
        f"-m dilocox.cli train configs/x.yaml --train.steps=3"
        for i in range(4)
    ]
    removes = [f"node{i} tc_cap eth9 --remove" for i in range(4)]
    assert lines == caps + runs + removes


# --------------------------------------------------------------------------- tc_cap.sh, for real


def tc_show(c: Cluster, r: int) -> str:
    return subprocess.run(
        ["tc", "-n", c.ns(r), "qdisc", "show", "dev", c.ifname(r)], capture_output=True, text=True
    ).stdout


@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_tc_cap_script_in_a_namespace():
    from test_emulate import transfer

    def cap(c: Cluster, r: int, *args: str) -> None:
        p = subprocess.run(
            ["ip", "netns", "exec", c.ns(r), "bash", TC_CAP, c.ifname(r), *args], capture_output=True, text=True
        )
        assert p.returncode == 0, p.stderr

    with Cluster(3) as c:  # uncapped links; the script adds the cap
        cap(c, 0, "50Mbit/s")
        assert "tbf" in tc_show(c, 0) and "rate 50Mbit" in tc_show(c, 0)
        cap(c, 0, "--remove")
        assert "tbf" not in tc_show(c, 0)
        cap(c, 0, "20mbit", f"{c.addr(1)}/32")  # only traffic to replica 1 is capped
        capped, n1, _, _ = transfer(c, 0, 1, 2_500_000)
        free, n2, _, _ = transfer(c, 0, 2, 2_500_000)
    assert n1 == n2 == 2_500_000
    print(f"tc_cap.sh 20mbit to one peer: {capped:.1f} Mbit/s there, {free:.0f} Mbit/s to the other")
    assert abs(capped - 20) / 20 < 0.15
    assert free > 5 * 20


def test_tc_cap_rejects_bad_input():
    p = subprocess.run(["bash", TC_CAP, "lo", "fast"], capture_output=True, text=True)
    assert p.returncode != 0 and "fast" in p.stderr
    p = subprocess.run(["bash", TC_CAP, "no-such-if0", "1gbit"], capture_output=True, text=True)
    assert p.returncode != 0 and "no-such-if0" in p.stderr
