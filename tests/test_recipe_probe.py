"""Issue 42 item 1: a stranger on another host reaches nothing of the documented elastic and SWARM recipes that
answers without the run secret.

The recipe (docs/ELASTIC.md: a guarded ``dilocox lighthouse``, replicas with the defaults, ``security.authenticate``
on) as ``dilocox launch --elastic 2`` starts it, in network namespaces: the lighthouse in the switch namespace, each
replica in its own, and one more namespace on the same bridge that runs nothing of the run: the stranger (no
secret). The launch runs in a subprocess under a time bound (the victims); while both replicas train, the test lists
every TCP socket listening on a non-loopback address in the run's namespaces (``ss -ltn``) and, from the stranger's
namespace, checks that each one is reached and opens with dilocox's challenge, then sends each one nothing, an
HTTP/1.1 status request, the lighthouse dashboard's kill request, an HTTP/2 (gRPC) preface and zeros. The only bytes
allowed back are dilocox's authentication challenge (or its BUSY): a plain gRPC, HTTP, TCPStore or gloo server would
answer otherwise. A ``torch.distributed.TCPStore`` client must get nothing from any of them either. The replicas
must still train after the probe (else a closed port would pass for a guarded one).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from dilocox.launch.netns import enter_netns, netns_available
from dilocox.net.secure import BUSY, MAGIC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STRANGER = r"""
import json, sys

class WithStranger(Cluster):  # one namespace more than the run uses: the stranger's host
    def __init__(self, n, *a, rates_mbit=None, **kw):
        super().__init__(n + 1, *a, rates_mbit=None if rates_mbit is None else [*rates_mbit, None], **kw)

    def start(self):
        super().start()
        info = {"run": [self.ns(r) for r in range(self.n - 1)] + [self.switch], "stranger": self.ns(self.n - 1),
                "addrs": {self.ns(r): self.addr(r) for r in range(self.n - 1)}}
        print("NAMESPACES " + json.dumps(info), flush=True)
"""

WRAPPER = (
    r"""
import dilocox.elastic.launch as L
from dilocox.launch.netns import Cluster
"""
    + STRANGER
    + r"""
L.Cluster = WithStranger
cfg, run_dir = sys.argv[1], sys.argv[2]
sys.exit(L.launch_elastic(cfg, 2, ["--train.steps=100000", "--checkpoint.every=0", "--log.progress=false",
                                   "--log.every=1", "--log.tensorboard=false", "--train.eval_every=0",
                                   f"--log.run_dir={run_dir}"],
                          min_replicas=1, netns=True, timeout_s=240))
"""
)

PAYLOADS = {
    "nothing": b"",
    "http status": b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n",
    "dashboard kill": b"POST /replica/replica0/kill HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    "grpc preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00",
    "zeros": bytes(64),
}


def _listeners(ns: str, own_addr: str | None) -> list[tuple[str, int]]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltn"], capture_output=True, text=True, timeout=10)
    found = []
    for line in out.stdout.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        host = host.strip("[]")
        if host.startswith("127.") or host == "::1" or host.startswith("::ffff:127."):
            continue  # (loopback: no other host reaches it)
        if host in ("0.0.0.0", "*", "::"):
            host = own_addr or "198.18.0.254"
        found.append((host, int(port)))
    return sorted(set(found))


def _answer(host: str, port: int, payload: bytes) -> bytes:
    """What the server sends back to ``payload`` within 0.5 s of silence (at most 4 KiB)."""
    got = b""
    try:
        with socket.create_connection((host, port), timeout=3) as s:
            if payload:
                s.sendall(payload)
            s.settimeout(0.5)
            while len(got) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
    except (TimeoutError, socket.timeout, ConnectionError):
        pass
    except OSError as e:
        return f"<connect failed: {e}>".encode()
    return got


def _store_answers(host: str, port: int) -> str | None:
    """None when a TCPStore client gets nothing from ``host:port``; else what it got."""
    import torch.distributed as dist

    try:
        st = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False)
        return f"get -> {st.get('replica0')!r}"
    except Exception:  # noqa: BLE001 - any failure is "nothing answered"
        return None


def _probe(stranger: str, target: tuple[str, int]) -> list[str]:
    enter_netns(stranger)  # (this thread only: setns(2) is per thread)
    bad = []
    for name, payload in PAYLOADS.items():
        got = _answer(*target, payload)
        if name == "nothing" and not (got.startswith(MAGIC) or got.startswith(BUSY)):  # (reached, and a guard)
            bad.append(f"{target[0]}:{target[1]} is not dilocox's guard (its first bytes: {got[:40]!r})")
        elif got and not (got.startswith(MAGIC) or got.startswith(BUSY)):
            bad.append(f"{target[0]}:{target[1]} answered {name!r} with {got[:40]!r}")
    store = _store_answers(*target)
    if store is not None:
        bad.append(f"{target[0]}:{target[1]} answered a TCPStore client: {store}")
    return bad


def _steps(run_dir: str) -> dict[int, tuple[int, float]]:
    """replica -> (its last logged step, when this test saw it)."""
    out = {}
    for r in (0, 1):
        try:
            with open(os.path.join(run_dir, f"replica{r}", "metrics.jsonl")) as f:
                steps = [json.loads(x)["step"] for x in f if '"step"' in x and '"loss"' in x]
            if steps:
                out[r] = (steps[-1], time.monotonic())
        except (OSError, ValueError, KeyError):
            pass
    return out


def _training(run_dir: str) -> bool:
    got = _steps(run_dir)
    return len(got) == 2 and min(s for s, _ in got.values()) >= 8


@pytest.mark.slow
def test_a_stranger_reaches_nothing_of_the_elastic_recipe_that_answers_without_the_secret(tmp_path):
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    cfg = tmp_path / "run.yaml"
    inc = f"{ROOT}/configs/tiny.yaml, {ROOT}/configs/methods/dilocox.yaml"
    cfg.write_text(f"include: [{inc}]\nparallel: {{replicas: 1}}\n")
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(cfg), run_dir], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not _training(run_dir):
            assert proc.poll() is None, "the launch ended early:\n" + "".join(lines[-30:])
            time.sleep(0.5)
        assert len(_steps(run_dir)) == 2, "the replicas did not train within 150 s:\n" + "".join(lines[-30:])
        info = json.loads(next(x for x in lines if x.startswith("NAMESPACES "))[len("NAMESPACES ") :])
        targets = [t for ns in info["run"] for t in _listeners(ns, info["addrs"].get(ns))]
        assert len(targets) >= 5, targets  # the lighthouse's guard, and each replica's store, manager, mesh guards
        before = _steps(run_dir)
        with ThreadPoolExecutor(8) as ex:
            bad = [b for found in ex.map(lambda t: _probe(info["stranger"], t), targets) for b in found]
        assert not bad, "\n".join(bad)
        moved = lambda: all(_steps(run_dir).get(r, (-1, 0))[0] > before[r][0] + 2 for r in (0, 1))  # noqa: E731
        t = time.monotonic()
        while not moved() and time.monotonic() - t < 60:
            time.sleep(0.5)
        assert moved(), f"a replica stopped training after the probe: {before} -> {_steps(run_dir)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


SWARM_WRAPPER = (
    r"""
import dilocox.swarm.netns as N
from dilocox.config import load_config
from dilocox.swarm.runtime import launch
Cluster = N.Cluster
"""
    + STRANGER
    + r"""
N.Cluster = WithStranger
cfg = load_config(sys.argv[1], sys.argv[3:])
res = launch(cfg, sys.argv[2], steps=100000, timeout_s=240, launcher=N.netns_launcher())
sys.exit(0)
"""
)


def _swarm_steps(out: str, names: list[str]) -> dict[str, int]:
    """peer -> its last recorded step (``OUT/s{j}p{i}.jsonl``)."""
    got = {}
    for n in names:
        try:
            with open(os.path.join(out, f"{n}.jsonl")) as f:
                steps = [json.loads(x)["step"] for x in f if '"step"' in x]
            if steps:
                got[n] = steps[-1]
        except (OSError, ValueError, KeyError):
            pass
    return got


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["swarm", "diloco"])
def test_a_stranger_reaches_nothing_of_the_swarm_recipe_that_answers_without_the_secret(tmp_path, sync):
    """The SWARM recipe as ``dilocox swarm --netns`` runs it (docs/SWARM.md; ``security.authenticate`` on by default):
    [2, 2] peers, each in its own namespace, the address store and the two stages' lighthouses in the switch
    namespace, a stranger's namespace on the same bridge. Every listener of the run on a non-loopback address (the
    peers' RPC servers, the stage groups' stores, managers and mesh, the hub's store and lighthouse guards) is
    probed as in the elastic test; the peers must go on training after the probe."""
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    from tests.test_swarm_runtime import TINY

    over = [*TINY, "--swarm.peers_per_stage=[2,2]", f"--swarm.sync={sync}", "--outer.sync_every=4"]
    out = str(tmp_path / "job")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    argv = [sys.executable, "-c", SWARM_WRAPPER, os.path.join(ROOT, "configs", "tiny.yaml"), out, *over]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    names = ["s0p0", "s0p1", "s1p0", "s1p1"]
    try:
        deadline = time.monotonic() + 150
        trained = lambda: len(got := _swarm_steps(out, names)) == 4 and min(got.values()) >= 4  # noqa: E731
        while time.monotonic() < deadline and not trained():
            assert proc.poll() is None, "the job ended early:\n" + "".join(lines[-30:])
            time.sleep(0.5)
        assert len(_swarm_steps(out, names)) == 4, "the peers did not train within 150 s:\n" + "".join(lines[-30:])
        info = json.loads(next(x for x in lines if x.startswith("NAMESPACES "))[len("NAMESPACES ") :])
        per_ns = {ns: _listeners(ns, info["addrs"].get(ns)) for ns in info["run"]}
        # each peer's RPC server (and its stage group's services), the hub's store and two lighthouses
        assert all(len(per_ns[ns]) >= 1 for ns in info["addrs"]) and len(per_ns[info["run"][-1]]) >= 3, per_ns
        targets = [t for found in per_ns.values() for t in found]
        before = _swarm_steps(out, names)
        with ThreadPoolExecutor(8) as ex:
            bad = [b for found in ex.map(lambda t: _probe(info["stranger"], t), targets) for b in found]
        assert not bad, "\n".join(bad)
        moved = lambda: all(_swarm_steps(out, names).get(n, -1) > before[n] + 2 for n in names)  # noqa: E731
        t = time.monotonic()
        while not moved() and time.monotonic() - t < 60:
            time.sleep(0.5)
        assert moved(), f"a peer stopped training after the probe: {before} -> {_swarm_steps(out, names)}"
    finally:
        os.killpg(proc.pid, 15)  # (the launcher's handlers tear the namespaces down)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)
