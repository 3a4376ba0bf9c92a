"""dilocox.launch.local_run: a one-host run's stores and gloo pairs listen on loopback only (issue 21).

Each rank of a 2-rank run lists the listening TCP sockets of its own process and of its torchrun agent (the parent:
it hosts the stores) from /proc, after a gloo all-reduce; rank 0 writes them out. Under plain ``torchrun
--standalone`` the same probe finds sockets listening on every interface (the check can fail); under the dilocox
launcher every one is on 127.0.0.1, and the run still computes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dilocox.launch.local_run import local_run_argv, loopback_env, loopback_ifname

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or loopback_ifname() is None, reason="reads /proc; needs a loopback interface"
)

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    def inodes(pid):
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
        return out

    def listening(pids):
        mine = set().union(*(inodes(p) for p in pids))
        found = []
        for path in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(path) as f:
                for row in f.read().splitlines()[1:]:
                    cols = row.split()
                    if cols[3] == "0A" and cols[9] in mine:  # 0A = LISTEN
                        found.append(cols[1].rpartition(":")[0])
        return found

    dist.init_process_group("gloo")
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    got = listening([os.getpid(), os.getppid()])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, got)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"sum": t.tolist(), "listening": sorted(set(sum(every, [])))}, f)
    dist.barrier()
    dist.destroy_process_group()
    """
)

LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net/tcp{,6} write them


def _run(tmp_path, argv, env):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out.json"
    if out.exists():
        out.unlink()
    env = dict(env, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([*argv, str(probe), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_plain_torchrun_listens_beyond_loopback_and_local_run_does_not(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    plain = _run(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], env)
    assert set(plain["listening"]) - LOOPBACK, plain  # the reason for the launcher (the check can fail)

    ours = _run(tmp_path, local_run_argv(2, []), loopback_env(env))
    assert ours["sum"] == [3.0, 3.0, 3.0]
    assert ours["listening"] and set(ours["listening"]) <= LOOPBACK, ours


def test_loopback_env_keeps_the_users_choice():
    env = loopback_env({"GLOO_SOCKET_IFNAME": "eth7"})
    assert env["GLOO_SOCKET_IFNAME"] == "eth7" and env["NCCL_SOCKET_IFNAME"] == loopback_ifname()


def test_train_nproc_keeps_torchrun_for_an_elastic_replica_and_loopback_otherwise(monkeypatch):
    """An elastic replica's ranks learn the address the other replicas dial from torchrun's MASTER_ADDR: it must not
    become 127.0.0.1 (so plain torchrun, no loopback interface); any other run gets the loopback launcher."""
    import dilocox.distributed.signals as signals
    from dilocox import cli

    seen = []
    monkeypatch.setattr(signals, "supervise", lambda argv, env, timeout_s, **kw: seen.append((argv, env)) or 0)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    elastic = ["--parallel.replicas=1", "--outer.elastic.enabled=true", "--outer.elastic.lighthouse=http://10.0.0.1:1"]
    assert cli._launch_local(2, ["train", "configs/tiny-dilocox.yaml", *elastic]) == 0
    assert cli._launch_local(2, ["train", "configs/tiny.yaml"]) == 0
    (argv_e, env_e), (argv_l, env_l) = seen
    assert "--multi-host" in argv_e and not any(a.startswith("--local-addr") for a in argv_e)  # torchrun's stores
    assert "GLOO_SOCKET_IFNAME" not in env_e
    assert "dilocox.launch.local_run" in argv_l and "--local-addr=127.0.0.1" in argv_l
    assert env_l["GLOO_SOCKET_IFNAME"] == loopback_ifname()
