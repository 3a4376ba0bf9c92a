"""Membership / transport engines for SWARM, measured on loopback (issue 11 item 6; docs/SWARM.md).

Candidates: torchft 0.2.0 (lighthouse quorum + reconfigurable gloo group, used through
``dilocox.elastic.ElasticOuterGroup``) with a plain TCP tensor RPC for the pipeline traffic, and
hivemind 1.1.12 (SWARM's own engine: libp2p daemon, DHT, ``DecentralizedAverager``). hivemind is
NOT a dependency of dilocox: its processes run under another interpreter (``--hivemind-python``,
e.g. a venv made with ``--system-site-packages`` so it sees the same torch), and nothing here
imports it in the main interpreter.

    python -m tools.swarm_engines rtt --transport tcp|rpc|gloo|hivemind-unary|hivemind-stream [--iters 200]
    python -m tools.swarm_engines average --engine torchft|hivemind --peers 2 [--rounds 8]
    python -m tools.swarm_engines recovery --engine torchft|hivemind [--restart] [--joiner-initial heal]
    python -m tools.swarm_engines footprint [--hivemind-python PY]
    python -m tools.swarm_engines all --repeats 3 --hivemind-python /work/hmvenv/bin/python --out r.json
    python -m tools.swarm_engines table r.json      # the markdown rows of docs/SWARM.md

What each measures (every process is its own OS process, started in its own session and killed in
``finally``; every wait is bounded):

- ``rtt``: one microbatch round trip, an fp32 activation of ``--shape`` (8,128,64 = 256 KiB) sent to
  a server that answers with a same-size "gradient" (``0.5 * x``, checked). ``tcp``: one persistent
  socket, length-prefixed raw bytes (the floor of the TCP path); ``rpc``: ``dilocox.net.rpc``
  (``call`` opens a connection per request, JSON header + raw tensor bytes); ``gloo``:
  ``torch.distributed`` send/recv between 2 ranks; ``hivemind-unary`` / ``hivemind-stream``: hivemind
  ``P2P`` protobuf handlers (unary call, and the streaming RPC hivemind's MoE client uses).
- ``average``: ``--peers`` processes average a ``--size`` fp32 vector (1 M = 4 MB) ``--rounds`` times;
  each round starts at the same wall-clock time on every peer; time = round start -> mean in hand.
  torchft: ``ElasticOuterGroup.allreduce_mean`` (quorum + one gloo all-reduce); hivemind:
  ``DecentralizedAverager.step`` (matchmaking + butterfly all-reduce, ``target_group_size = peers``).
- ``recovery``: 3 peers; peer 2 is SIGKILLed mid-phase; time from the kill to the survivors' next
  completed averaging (and that round's own duration); with ``--restart`` the same command is
  started again and the tool records whether the survivors average with it again.
  torchft's joiner: ``same`` (the command as first started), ``heal`` (every peer registers
  ``ElasticOuterGroup.set_state_fns``: torchft's live join), ``none``/``step`` (no initial wait / start
  at the restart round's step).
- ``footprint``: packages each engine pulls (``pip install --dry-run`` is not run here: the numbers
  come from the installed distributions' metadata), all and beyond dilocox's other requirements.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import torch

from dilocox.distributed.procs import kill_group, spawn
from tools import ROOT, child_env

SHAPE = (8, 128, 64)
_LEN = struct.Struct("!Q")


class EngineUnavailable(RuntimeError):
    """The interpreter asked to run an engine cannot import it."""


# ----------------------------------------------------------------------------------------------- helpers


def _env() -> dict:
    """The children's environment: the repository root on PYTHONPATH (``-m tools.swarm_engines`` and this checkout's
    dilocox resolve under any interpreter and directory), one OpenMP thread."""
    return child_env(OMP_NUM_THREADS="1")


def _cmd(python: str, *args: str) -> list[str]:
    return [python, "-m", "tools.swarm_engines", *args]


def _popen(cmd: list[str], stdout=subprocess.PIPE, log: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session; its stderr goes to ``log`` (a temp file by default: a pipe nobody
    drains could fill up and block a chatty process). ``_tail(p)`` reads it back."""
    if log is None:
        fd, log = tempfile.mkstemp(prefix="swarm_engines_", suffix=".log")
        os.close(fd)
    with open(log, "a") as err:
        p = spawn(cmd, cwd=ROOT, env=_env(), stdout=stdout, stderr=err, text=True)
    p.log_path = log  # type: ignore[attr-defined]
    return p


def _tail(p: subprocess.Popen, n: int = 2000) -> str:
    try:
        with open(p.log_path) as f:  # type: ignore[attr-defined]
            return f.read()[-n:]
    except (OSError, AttributeError):
        return ""


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            kill_group(p)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        log = getattr(p, "log_path", "")
        if os.path.basename(log).startswith("swarm_engines_"):  # our temp file (peer logs live in their run dir)
            try:
                os.unlink(log)
            except OSError:
                pass


def _readline(p: subprocess.Popen, timeout: float, what: str) -> dict:
    """First JSON line of ``p``'s stdout within ``timeout`` seconds."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = p.stdout.readline()
            if not line:
                break
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        elif p.poll() is not None:
            break
    err = _tail(p) if p.poll() is not None else "(still running)"
    raise RuntimeError(f"{what}: no JSON line within {timeout:.0f}s; exit={p.poll()}; stderr tail: {err[-2000:]}")


def _wait_json(p: subprocess.Popen, timeout: float, what: str) -> dict:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill([p])
        raise RuntimeError(f"{what}: did not finish within {timeout:.0f}s") from None
    lines = [x for x in out.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{what}: exit code {p.returncode}; stderr tail: {_tail(p)}")
    return json.loads(lines[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_hivemind(python: str) -> str:
    """The hivemind version importable by ``python``, or EngineUnavailable naming the fix."""
    try:
        r = subprocess.run(
            [python, "-c", "import hivemind; print(hivemind.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            env=_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineUnavailable(f"--hivemind-python={python!r} cannot be run ({e}); give a python with hivemind") from e
    if r.returncode != 0:
        raise EngineUnavailable(
            f"--hivemind-python={python!r} cannot import hivemind; make a separate venv that sees the system torch: "
            "python3 -m venv --system-site-packages /work/hmvenv && /work/hmvenv/bin/pip install hivemind==1.1.12, "
            "then pass --hivemind-python /work/hmvenv/bin/python"
        )
    return r.stdout.strip()


def summarize(xs: list[float]) -> dict:
    """Median and spread (min, p10, p90, max) of ``xs``."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(f: float) -> float:
        return s[min(len(s) - 1, int(round(f * (len(s) - 1))))]

    return {"n": len(s), "median": statistics.median(s), "min": s[0], "p10": q(0.1), "p90": q(0.9), "max": s[-1]}


def _activation(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------- round trip


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("connection closed")
        got += k
    return buf


def _send_tensor(sock: socket.socket, t: torch.Tensor) -> None:
    raw = memoryview(t.contiguous().reshape(-1).numpy()).cast("B")
    sock.sendall(_LEN.pack(len(raw)))
    sock.sendall(raw)


def _recv_tensor(sock: socket.socket) -> torch.Tensor:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return torch.frombuffer(_recv_exact(sock, n), dtype=torch.float32).reshape(SHAPE)


def _rtt_server(a: argparse.Namespace) -> int:
    """Serve round trips until killed or ``--lifetime`` seconds; prints its address as one JSON line."""
    torch.set_num_threads(1)
    stop_at = time.monotonic() + a.lifetime
    if a.transport == "tcp":
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(a.lifetime)
        print(json.dumps({"addr": f"127.0.0.1:{srv.getsockname()[1]}"}), flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(max(1.0, stop_at - time.monotonic()))
        try:
            while True:
                x = _recv_tensor(conn)
                _send_tensor(conn, x * 0.5)
        except (ConnectionError, OSError):
            return 0
    if a.transport == "rpc":
        from dilocox.net.rpc import RpcServer

        def handler(method: str, meta: dict, tensors: dict) -> tuple[dict, dict]:
            return {"mb": meta.get("mb")}, {"grad": tensors["act"] * 0.5}

        srv = RpcServer(handler, name="rtt")
        print(json.dumps({"addr": srv.addr}), flush=True)
        while time.monotonic() < stop_at:
            time.sleep(0.2)
        srv.close()
        return 0
    if a.transport == "gloo":
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=0, world_size=2, timeout=timedelta(seconds=60)
        )
        print(json.dumps({"addr": f"gloo:{a.port}"}), flush=True)
        x = torch.empty(SHAPE)
        for _ in range(a.iters + a.warmup):
            dist.recv(x, src=1)
            dist.send(x * 0.5, dst=1)
        dist.destroy_process_group()
        return 0
    if a.transport.startswith("hivemind"):
        return asyncio.run(_hm_server(a))
    raise ValueError(f"--transport={a.transport!r}: use tcp, rpc, gloo, hivemind-unary or hivemind-stream")


async def _hm_server(a: argparse.Namespace) -> int:
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
    from hivemind.proto import runtime_pb2
    from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def unary(req, ctx):
        x = deserialize_torch_tensor(req.tensors[0])
        return runtime_pb2.ExpertResponse(tensors=[serialize_torch_tensor(x * 0.5)])

    async def stream(reqs, ctx):
        parts = [t async for r in reqs for t in r.tensors]
        x = deserialize_torch_tensor(combine_from_streaming(parts))
        for part in split_for_streaming(serialize_torch_tensor(x * 0.5), DEFAULT_MAX_MSG_SIZE):
            yield runtime_pb2.ExpertResponse(tensors=[part])

    await p2p.add_protobuf_handler("rtt_unary", unary, runtime_pb2.ExpertRequest)
    await p2p.add_protobuf_handler(
        "rtt_stream", stream, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
    )
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    print(json.dumps({"addr": maddrs, "peer_id": p2p.peer_id.to_base58()}), flush=True)
    await asyncio.sleep(a.lifetime)
    await p2p.shutdown()
    return 0


async def _hm_client(a: argparse.Namespace, info: dict, x: torch.Tensor) -> list[float]:
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
    from hivemind.proto import runtime_pb2
    from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

    p2p = await P2P.create(initial_peers=info["addr"], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer = PeerID.from_base58(info["peer_id"])

    async def one() -> torch.Tensor:
        ser = serialize_torch_tensor(x)
        if a.transport == "hivemind-unary":
            req = runtime_pb2.ExpertRequest(uid="rtt", tensors=[ser])
            resp = await asyncio.wait_for(
                p2p.call_protobuf_handler(peer, "rtt_unary", req, runtime_pb2.ExpertResponse), a.timeout
            )
            return deserialize_torch_tensor(resp.tensors[0])

        async def parts():
            for part in split_for_streaming(ser, DEFAULT_MAX_MSG_SIZE):
                yield runtime_pb2.ExpertRequest(uid="rtt", tensors=[part])

        async def run() -> torch.Tensor:
            it = await p2p.iterate_protobuf_handler(peer, "rtt_stream", parts(), runtime_pb2.ExpertResponse)
            got = [t async for r in it for t in r.tensors]
            return deserialize_torch_tensor(combine_from_streaming(got))

        return await asyncio.wait_for(run(), a.timeout)

    times = []
    for i in range(a.iters + a.warmup):
        t0 = time.perf_counter()
        y = await one()
        dt = time.perf_counter() - t0
        if i == 0 and not torch.equal(y, x * 0.5):
            raise RuntimeError("hivemind round trip returned a wrong gradient")
        if i >= a.warmup:
            times.append(dt)
    await p2p.shutdown()
    return times


def _rtt_client(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    info = json.loads(a.info)
    x = _activation()
    want = x * 0.5
    times: list[float] = []
    t_setup = time.perf_counter()
    if a.transport == "tcp":
        host, port = info["addr"].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=a.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(a.iters + a.warmup):
            t0 = time.perf_counter()
            _send_tensor(sock, x)
            y = _recv_tensor(sock)
            dt = time.perf_counter() - t0
            if i == 0 and not torch.equal(y, want):
                raise RuntimeError("tcp round trip returned a wrong gradient")
            if i >= a.warmup:
                times.append(dt)
        sock.close()
    elif a.transport == "rpc":
        from dilocox.net.client import call

        for i in range(a.iters + a.warmup):
            t0 = time.perf_counter()
            meta, ts = call(info["addr"], "forward", {"mb": i}, {"act": x}, timeout_s=a.timeout)
            dt = time.perf_counter() - t0
            if i == 0 and not (meta.get("mb") == 0 and torch.equal(ts["grad"], want)):
                raise RuntimeError("rpc round trip returned a wrong gradient")
            if i >= a.warmup:
                times.append(dt)
    elif a.transport == "gloo":
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=1, world_size=2, timeout=timedelta(seconds=60)
        )
        y = torch.empty(SHAPE)
        for i in range(a.iters + a.warmup):
            t0 = time.perf_counter()
            dist.send(x, dst=0)
            dist.recv(y, src=0)
            dt = time.perf_counter() - t0
            if i == 0 and not torch.equal(y, want):
                raise RuntimeError("gloo round trip returned a wrong gradient")
            if i >= a.warmup:
                times.append(dt)
        dist.destroy_process_group()
    else:
        times = asyncio.run(_hm_client(a, info, x))
    setup_s = time.perf_counter() - t_setup - sum(times)
    print(json.dumps({"transport": a.transport, "times_s": times, "setup_and_warmup_s": setup_s}), flush=True)
    return 0


def measure_rtt(transport: str, iters: int = 200, warmup: int = 20, python: str | None = None) -> dict:
    """Round trips of one [8,128,64] fp32 activation -> same-size gradient between two processes."""
    py = python or sys.executable
    port = free_port() if transport == "gloo" else 0
    common = ["--transport", transport, "--iters", str(iters), "--warmup", str(warmup), "--port", str(port)]
    procs: list[subprocess.Popen] = []
    try:
        srv = _popen(_cmd(py, "_rtt-server", *common, "--lifetime", "300"))
        procs.append(srv)
        if transport == "gloo":
            cli = _popen(_cmd(py, "_rtt-client", *common, "--info", "{}"))
            procs.append(cli)
            _readline(srv, 120, "gloo rank 0")
        else:
            info = _readline(srv, 120, f"{transport} server")
            cli = _popen(_cmd(py, "_rtt-client", *common, "--info", json.dumps(info)))
            procs.append(cli)
        res = _wait_json(cli, 300, f"{transport} client")
    finally:
        _kill(procs)
    times_ms = [t * 1e3 for t in res["times_s"]]
    return {"transport": transport, "bytes_each_way": 4 * SHAPE[0] * SHAPE[1] * SHAPE[2], "ms": summarize(times_ms)}


# ----------------------------------------------------------------------------------------------- averaging


def contribution(rank: int, rnd: int, size: int) -> torch.Tensor:
    """What peer ``rank`` averages in round ``rnd``: a constant, so the mean is known exactly."""
    return torch.full((size,), float(rank + 1) + 0.25 * rnd, dtype=torch.float32)


def _sleep_until(t_wall: float) -> None:
    left = t_wall - time.time()
    if left > 0:
        time.sleep(left)


def _wait_t0(path: str, timeout: float) -> float:
    """Round 0's wall-clock time, once the driver has written it (every peer is up); bounded wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                return float(f.read())
        time.sleep(0.02)
    raise TimeoutError(f"no start time in {path} within {timeout:.0f}s (the driver died?)")


def _avg_peer(a: argparse.Namespace) -> int:
    """One averaging peer: ``--rounds`` rounds starting at wall time ``--t0 + k * --period``; JSON lines to --out."""
    torch.set_num_threads(1)
    out = open(a.out, "a", buffering=1)

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")
        out.flush()

    t_import0 = time.perf_counter()
    if a.engine == "torchft":
        from dilocox.elastic import ElasticConfig, ElasticError, ElasticOuterGroup

        import_s = time.perf_counter() - t_import0
        t1 = time.perf_counter()
        cfg = ElasticConfig(
            lighthouse_addr=a.lighthouse,
            replica_rank=a.rank,
            min_replicas=a.min_peers,
            # the first step waits (bounded) for every peer; a restarted peer given --joiner-initial none|step does not
            initial_replicas=None if (a.first_round > 0 and a.joiner_initial in ("none", "step")) else a.peers,
            max_replicas=8,
            timeout_s=a.timeout,
            quorum_timeout_s=a.quorum_timeout,
        )
        group = ElasticOuterGroup(cfg)
        if a.joiner_initial == "heal":  # every peer: torchft's live join sends a live peer's state to a joiner
            state = {"rounds_done": torch.zeros(1)}
            group.set_state_fns(lambda: {"rounds_done": state["rounds_done"].clone()}, lambda sd: None)
        if a.first_round > 0 and a.joiner_initial == "step":
            # what a state download from a live peer would also carry: the stage's committed step count (the
            # survivors committed rounds 0 .. first_round-1), so torchft does not see this peer as behind.
            # ElasticOuterGroup has no API for it yet: set torchft's Manager step directly (measurement only).
            group._manager.load_state_dict({"step": a.first_round, "batches_committed": 0})
        start_s = time.perf_counter() - t1
        emit({"event": "started", "t": time.time(), "import_s": import_s, "start_s": start_s})
        try:
            t0 = _wait_t0(a.t0_file, 600)
            for rnd in range(a.first_round, a.rounds):
                t_round = t0 + rnd * a.period
                _sleep_until(t_round)
                t_call = time.time()
                try:
                    res = group.allreduce_mean(contribution(a.rank, rnd, a.size))
                except ElasticError as e:
                    emit({"event": "error", "round": rnd, "t": time.time(), "type": type(e).__name__, "msg": str(e)})
                    break
                t_done = time.time()
                want = sum(float(r + 1) + 0.25 * rnd for r in res.contributors) / len(res.contributors)
                emit(
                    {
                        "event": "round",
                        "round": rnd,
                        "t_round": t_round,
                        "t_call": t_call,
                        "t": t_done,
                        "s": t_done - max(t_round, t_call),
                        "group": sorted(res.contributors),
                        "err": float((res.mean - want).abs().max()),
                        "quorum_s": res.quorum_s,
                        "allreduce_s": res.allreduce_s,
                        "attempts": res.attempts,
                        "healed": bool(getattr(res, "healed", False)),
                    }
                )
        finally:
            group.close()
            out.close()
        os._exit(0)  # torchft's background threads must not keep the process alive
    return _hm_avg_peer(a, emit, t_import0, out)


def _hm_avg_peer(a: argparse.Namespace, emit, t_import0: float, out) -> int:
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.utils import get_dht_time

    import_s = time.perf_counter() - t_import0
    t1 = time.perf_counter()
    initial = json.loads(a.initial_peers) if a.initial_peers else []
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    dht_s = time.perf_counter() - t1
    avg = DecentralizedAverager(
        [torch.zeros(a.size)],
        dht,
        prefix="dilocox_bench",
        target_group_size=a.peers,
        min_group_size=a.min_peers,
        min_matchmaking_time=a.min_matchmaking_time,
        request_timeout=a.request_timeout,
        start=True,
    )
    start_s = time.perf_counter() - t1
    emit(
        {
            "event": "started",
            "t": time.time(),
            "import_s": import_s,
            "dht_s": dht_s,
            "start_s": start_s,
            "maddrs": [str(m) for m in dht.get_visible_maddrs()],
        }
    )
    try:
        t0 = _wait_t0(a.t0_file, 600)
        for rnd in range(a.first_round, a.rounds):
            t_round = t0 + rnd * a.period
            _sleep_until(t_round)
            with avg.get_tensors() as ts:
                ts[0].copy_(contribution(a.rank, rnd, a.size))
            t_call = time.time()
            try:
                got = avg.step(gather=a.rank, timeout=a.timeout, allow_retries=True)
            except Exception as e:  # noqa: BLE001 - recorded, the next round goes on
                got, err = None, f"{type(e).__name__}: {e}"
            else:
                err = None if got is not None else "step returned None (no group / all-reduce failed)"
            t_done = time.time()
            if got is None:
                emit({"event": "fail", "round": rnd, "t": t_done, "s": t_done - t_call, "msg": err})
                continue
            group = sorted(int(v) for v in got.values())
            want = sum(float(r + 1) + 0.25 * rnd for r in group) / len(group)
            with avg.get_tensors() as ts:
                e = float((ts[0] - want).abs().max())
            emit(
                {
                    "event": "round",
                    "round": rnd,
                    "t_round": t_round,
                    "t_call": t_call,
                    "t": t_done,
                    "s": t_done - max(t_round, t_call),
                    "group": group,
                    "err": e,
                    "dht_time_skew_s": get_dht_time() - time.time(),
                }
            )
    finally:
        out.close()
        try:
            avg.shutdown()
            dht.shutdown()
        finally:
            os._exit(0)


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def _wait_started(path: str, p: subprocess.Popen, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = [x for x in _read(path) if x["event"] == "started"]
        if recs:
            return recs[-1]
        if p.poll() is not None:
            raise RuntimeError(f"{what} exited with {p.returncode}: {_tail(p)}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within {timeout:.0f}s")


class _Swarm:
    """Peers of one averaging experiment (and the torchft lighthouse, in this process)."""

    def __init__(self, a: argparse.Namespace, tmp: str) -> None:
        self.a, self.tmp = a, tmp
        self.procs: dict[int, subprocess.Popen] = {}
        self.restarted: list[subprocess.Popen] = []
        self.lh = None
        self.lh_start_s = None
        self.initial_peers: list[str] = []
        self.started: dict[int, dict] = {}
        self.t0_file = os.path.join(tmp, "t0")

    def __enter__(self) -> "_Swarm":
        a = self.a
        if a.engine == "torchft":
            from dilocox.elastic import start_lighthouse

            t0 = time.perf_counter()
            self.lh = start_lighthouse(a.min_peers, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
            self.lh_start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        _kill(list(self.procs.values()) + self.restarted)
        if self.lh is not None:
            self.lh.shutdown()

    def peer_cmd(self, rank: int, first_round: int = 0) -> list[str]:
        a = self.a
        py = a.hivemind_python if a.engine == "hivemind" else sys.executable
        cmd = _cmd(
            py,
            "_avg-peer",
            "--engine",
            a.engine,
            "--rank",
            str(rank),
            "--peers",
            str(a.peers),
            "--min-peers",
            str(a.min_peers),
            "--size",
            str(a.size),
            "--rounds",
            str(a.rounds),
            "--first-round",
            str(first_round),
            "--period",
            str(a.period),
            "--t0-file",
            self.t0_file,
            "--timeout",
            str(a.timeout),
            "--quorum-timeout",
            str(a.quorum_timeout),
            "--min-matchmaking-time",
            str(a.min_matchmaking_time),
            "--request-timeout",
            str(a.request_timeout),
            "--joiner-initial",
            a.joiner_initial,
            "--out",
            os.path.join(self.tmp, f"p{rank}.jsonl"),
        )
        if self.lh is not None:
            cmd += ["--lighthouse", self.lh.address()]
        if self.initial_peers:
            cmd += ["--initial-peers", json.dumps(self.initial_peers)]
        return cmd

    def start(self, t0_offset: float) -> float:
        """Start every peer, wait (bounded) until all are up, then publish t0 = now + ``t0_offset``."""
        a = self.a
        for rank in range(a.peers):
            p = _popen(self.peer_cmd(rank), stdout=subprocess.DEVNULL, log=os.path.join(self.tmp, f"p{rank}.log"))
            self.procs[rank] = p
            if a.engine == "hivemind" and rank == 0:  # the others bootstrap their DHT from peer 0
                self.started[0] = _wait_started(os.path.join(self.tmp, "p0.jsonl"), p, 180, "peer 0")
                self.initial_peers = self.started[0]["maddrs"]
        for rank, p in self.procs.items():
            self.started[rank] = _wait_started(os.path.join(self.tmp, f"p{rank}.jsonl"), p, 180, f"peer {rank}")
        t0 = time.time() + t0_offset
        with open(self.t0_file + ".tmp", "w") as f:
            f.write(repr(t0))
        os.replace(self.t0_file + ".tmp", self.t0_file)
        return t0

    def wait(self, timeout: float) -> bool:
        """Wait (bounded) for every peer to finish its rounds; False when some had to be killed."""
        deadline = time.monotonic() + timeout
        for p in list(self.procs.values()) + self.restarted:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False  # __exit__ kills them; the rounds recorded so far are still reported
        return True

    def records(self, rank: int) -> list[dict]:
        return _read(os.path.join(self.tmp, f"p{rank}.jsonl"))


@contextlib.contextmanager
def _workdir(a: argparse.Namespace, prefix: str):
    """A temp dir for the peers' records and logs, removed at the end unless ``--log-dir`` keeps them."""
    if getattr(a, "log_dir", None):
        os.makedirs(a.log_dir, exist_ok=True)
        yield tempfile.mkdtemp(prefix=prefix, dir=a.log_dir)
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield tmp


def measure_average(a: argparse.Namespace) -> dict:
    """``a.peers`` peers average a ``a.size`` fp32 vector ``a.rounds`` times (see the module docstring)."""
    with _workdir(a, "swarm_avg_") as tmp, _Swarm(a, tmp) as sw:
        sw.start(a.t0_offset)
        finished = sw.wait(a.rounds * (a.period + a.timeout) + a.t0_offset + 60)
        recs = {r: sw.records(r) for r in range(a.peers)}
    rounds = [x for r in recs.values() for x in r if x["event"] == "round"]
    fails = [x for r in recs.values() for x in r if x["event"] in ("fail", "error")]
    # round 0 includes the first matchmaking/quorum on a fresh group: reported apart
    steady = [x["s"] * 1e3 for x in rounds if x["round"] > 0]
    first = [x["s"] * 1e3 for x in rounds if x["round"] == 0]
    return {
        "engine": a.engine,
        "peers": a.peers,
        "MB": a.size * 4 / 1e6,
        "ms": summarize(steady),
        "first_round_ms": summarize(first),
        "groups": sorted({tuple(x["group"]) for x in rounds}),
        "max_abs_err": max((x["err"] for x in rounds), default=None),
        "finished": finished,
        "failed_rounds": len(fails),
        "fail_msgs": sorted({str(x.get("msg", ""))[:200] for x in fails})[:3],
        "startup": {
            "lighthouse_s": sw.lh_start_s,
            "import_s": summarize([s["import_s"] for s in sw.started.values()]),
            "start_s": summarize([s["start_s"] for s in sw.started.values()]),
        },
    }


def measure_recovery(a: argparse.Namespace) -> dict:
    """3 peers; peer 2 SIGKILLed mid-phase before round ``a.kill_round``; optionally restarted."""
    a.peers = 3
    victim = 2
    with _workdir(a, "swarm_rec_") as tmp, _Swarm(a, tmp) as sw:
        t0 = sw.start(a.t0_offset)
        t_kill = t0 + (a.kill_round - 0.5) * a.period
        _sleep_until(t_kill)
        t_kill = time.time()
        kill_group(sw.procs[victim])
        sw.procs[victim].wait(timeout=10)
        t_restart = None
        if a.restart:
            _sleep_until(t_kill + a.restart_after)
            t_restart = time.time()
            first = int((t_restart - t0) // a.period) + 1
            os.replace(os.path.join(tmp, f"p{victim}.jsonl"), os.path.join(tmp, "p2_dead.jsonl"))
            p = _popen(
                sw.peer_cmd(victim, first_round=first),
                stdout=subprocess.DEVNULL,
                log=os.path.join(tmp, "p2_restart.log"),
            )
            sw.restarted.append(p)
        finished = sw.wait(a.rounds * (a.period + a.timeout) + a.t0_offset + a.quorum_timeout + 60)
        recs = {r: sw.records(r) for r in range(3)}
    surv = [x for r in (0, 1) for x in recs[r] if x["event"] == "round" and x["t"] > t_kill]
    by_peer = {
        r: min((x for x in recs[r] if x["event"] == "round" and x["t"] > t_kill), key=lambda x: x["t"], default=None)
        for r in (0, 1)
    }
    res: dict = {
        "engine": a.engine,
        "period_s": a.period,
        "finished": finished,
        "kill_to_next_avg_done_s": max((x["t"] - t_kill) for x in by_peer.values()) if all(by_peer.values()) else None,
        "that_round_s": max(x["s"] for x in by_peer.values()) if all(by_peer.values()) else None,
        "groups_after_kill": sorted({(x["round"], tuple(x["group"])) for x in surv}),
        "failed_after_kill": [
            (x["round"], round(x["t"] - t_kill, 2), str(x.get("msg", ""))[:160])
            for r in (0, 1)
            for x in recs[r]
            if x["event"] in ("fail", "error") and x["t"] > t_kill
        ],
    }
    if a.restart:
        back = [x for x in surv if victim in x["group"]]
        res["restarted_peer_records"] = [
            dict(
                {k: v for k, v in x.items() if k in ("event", "round", "group", "type", "msg", "start_s")},
                t_after_restart=round(x["t"] - t_restart, 2),
            )
            for x in recs[2]
        ][:4]
        res["restart_to_averaged_again_s"] = (min(x["t"] for x in back) - t_restart) if back else None
    return res


# ----------------------------------------------------------------------------------------------- footprint


def _closure(dists: list[str]) -> dict[str, int]:
    """Installed distributions reachable from ``dists`` through their requirements -> size on disk (bytes)."""
    import importlib.metadata as md
    import re

    seen: dict[str, int] = {}
    todo = list(dists)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop().strip(), maxsplit=1)[0].lower().replace("_", "-")
        if not name or name in seen:
            continue
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        size = 0
        for f in d.files or []:
            try:
                size += os.path.getsize(d.locate_file(f))
            except OSError:
                pass
        seen[name] = size
        todo += [r for r in d.requires or [] if "extra ==" not in r]
    return seen


def base_requirements() -> list[str]:
    """dilocox's own requirements (requirements.txt) minus the engines."""
    path = os.path.join(ROOT, "requirements.txt")
    if not os.path.exists(path):
        return ["torch"]
    with open(path) as f:
        reqs = [x.split("#")[0].strip() for x in f]
    return [r for r in reqs if r and not r.lower().startswith(("torchft", "hivemind"))]


def footprint(dists: list[str]) -> dict:
    """What ``dists`` pull (installed metadata, transitively): all of it, and what dilocox's other
    requirements do not already bring (``new``), with sizes on disk."""
    allp = _closure(dists)
    base = _closure(base_requirements())
    new = {k: v for k, v in allp.items() if k not in base}
    return {
        "packages": sorted(allp),
        "n": len(allp),
        "new": sorted(new),
        "n_new": len(new),
        "MB_new": round(sum(new.values()) / 1e6, 1),
    }


def footprint_all(hivemind_python: str | None) -> dict:
    res = {"torchft": footprint(["torchft"])}
    if hivemind_python:
        code = "import json; from tools.swarm_engines import footprint; print(json.dumps(footprint(['hivemind'])))"
        r = subprocess.run([hivemind_python, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
        res["hivemind"] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}
    return res


# ----------------------------------------------------------------------------------------------- driver


def _avg_args(a: argparse.Namespace, engine: str, peers: int, **kw) -> argparse.Namespace:
    d = dict(vars(a))
    d.update(engine=engine, peers=peers, min_peers=kw.pop("min_peers", peers), **kw)
    return argparse.Namespace(**d)


def run_all(a: argparse.Namespace) -> dict:
    """Every measurement ``a.repeats`` times; the JSON is rewritten (atomically) to ``a.out`` after each one, and a
    measurement that fails is recorded with its error instead of ending the run."""
    hm = check_hivemind(a.hivemind_python) if a.hivemind_python else None
    res: dict = {"load_avg_start": os.getloadavg(), "torch": torch.__version__, "hivemind": hm, "repeats": a.repeats}
    only = set(a.only.split(",")) if a.only else {"rtt", "average", "recovery", "footprint"}

    def save() -> None:
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(res, f, indent=1)
            os.replace(a.out + ".tmp", a.out)

    def runs_of(what: str, fn, *args) -> list:
        out = []
        for _ in range(a.repeats):
            try:
                out.append(fn(*args))
            except Exception as e:  # noqa: BLE001 - recorded; the other measurements go on
                out.append({"error": f"{type(e).__name__}: {str(e)[:500]}"})
            print(f"{what}: {json.dumps(out[-1])[:300]}", file=sys.stderr, flush=True)
        return out

    def med(runs: list, key: str) -> float | None:
        xs = [r[key]["median"] for r in runs if "error" not in r and r[key].get("n")]
        return statistics.median(xs) if xs else None

    if "rtt" in only:
        res["rtt"] = {}
        for t in ["tcp", "rpc", "gloo"] + (["hivemind-unary", "hivemind-stream"] if hm else []):
            py = a.hivemind_python if t.startswith("hivemind") else None
            runs = runs_of(f"rtt {t}", measure_rtt, t, a.iters, 20, py)
            res["rtt"][t] = {"median_of_medians_ms": med(runs, "ms"), "runs": runs}
            save()
    engines = ["torchft"] + (["hivemind"] if hm else [])
    if "average" in only:
        res["average"] = {}
        for e in engines:
            for n in (2, 4):
                runs = runs_of(f"average {e} {n}", measure_average, _avg_args(a, e, n))
                res["average"][f"{e}/{n}"] = {"median_of_medians_ms": med(runs, "ms"), "runs": runs}
                save()
    if "recovery" in only:
        res["recovery"] = {}
        variants = [
            ("torchft", {}),
            ("torchft/joiner-initial=none", {"joiner_initial": "none"}),
            ("torchft/joiner-initial=step", {"joiner_initial": "step"}),
        ]
        if hm:
            variants += [
                ("hivemind", {"period": max(a.period, 2.0)}),
                (
                    "hivemind/mm=1,rt=1",
                    {"period": max(a.period, 2.0), "min_matchmaking_time": 1.0, "request_timeout": 1.0},
                ),
            ]
        if a.recovery_variants:
            variants = [v for v in variants if v[0] in a.recovery_variants.split(",")]
        for name, kw in variants:
            e = name.split("/")[0]
            kw = dict(min_peers=2, restart=True, rounds=a.recovery_rounds, **kw)
            res["recovery"][name] = runs_of(f"recovery {name}", measure_recovery, _avg_args(a, e, 3, **kw))
            save()
    if "footprint" in only:
        res["footprint"] = footprint_all(a.hivemind_python if hm else None)
    res["load_avg_end"] = os.getloadavg()
    save()
    return res


def markdown_table(res: dict) -> str:
    """The results of ``all`` as the markdown rows of docs/SWARM.md (median of the runs' medians, [range of the
    medians], p10 over all runs)."""

    def row(name: str, runs: list, key: str, unit: str, scale: float = 1.0) -> str:
        ok = [r for r in runs if "error" not in r and r.get(key, {}).get("n")]
        if not ok:
            return f"| {name} | failed: {[r.get('error', '')[:80] for r in runs]} | | |"
        meds = sorted(r[key]["median"] * scale for r in ok)
        p10 = min(r[key]["p10"] * scale for r in ok)
        return (
            f"| {name} | {statistics.median(meds):.3g} {unit} | {meds[0]:.3g}–{meds[-1]:.3g} | {p10:.3g} | "
            f"{len(ok)}/{len(runs)} |"
        )

    lines = ["| quantity | median | range of run medians | p10 | runs ok |", "|---|---|---|---|---|"]
    for t, v in res.get("rtt", {}).items():
        lines.append(row(f"round trip, {t}", v["runs"], "ms", "ms"))
    for k, v in res.get("average", {}).items():
        e, n = k.split("/")
        lines.append(row(f"average 4 MB, {e}, {n} peers", v["runs"], "ms", "ms"))
        extra = [r for r in v["runs"] if "error" not in r]
        fails = sum(r.get("failed_rounds", 0) for r in extra)
        if fails:
            msgs = sorted({m[:90] for r in extra for m in r.get("fail_msgs", [])})
            lines.append(f"| ↳ failed rounds ({e}, {n} peers) | {fails} | {msgs} | | |")
    for name, runs in res.get("recovery", {}).items():
        ok = [r for r in runs if "error" not in r]
        k2a = [round(r["kill_to_next_avg_done_s"], 2) for r in ok if r.get("kill_to_next_avg_done_s") is not None]
        back = [r.get("restart_to_averaged_again_s") for r in ok]
        back = [round(b, 1) if b is not None else None for b in back]
        fails = [len(r.get("failed_after_kill", [])) for r in ok]
        lines.append(
            f"| recovery, {name} | kill→survivors' next avg done: {k2a} s | restarted peer averaged again after: "
            f"{back} s | survivors' failed rounds: {fails} | {len(ok)}/{len(runs)} |"
        )
    return "\n".join(lines)


def _add_avg_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=1 << 20, help="fp32 elements averaged (1M = 4 MB)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--period", type=float, default=1.5, help="seconds between round starts")
    p.add_argument("--t0-offset", type=float, default=1.0, help="round 0 starts this long after every peer is up")
    p.add_argument("--timeout", type=float, default=15.0, help="bound on one averaging (torchft) / matchmaking")
    p.add_argument("--quorum-timeout", type=float, default=20.0, help="torchft quorum bound")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="torchft lighthouse heartbeat timeout")
    p.add_argument("--min-matchmaking-time", type=float, default=5.0, help="hivemind matchmaking window (default 5)")
    p.add_argument("--request-timeout", type=float, default=3.0, help="hivemind request timeout (default 3)")
    p.add_argument("--log-dir", default=None, help="keep the peers' records and stderr logs under this directory")
    p.add_argument(
        "--joiner-initial",
        choices=("same", "none", "step", "heal"),
        default="same",
        help="torchft: the restarted peer waits for initial_replicas like the others (same), or not (none), or "
        "not and starts at the survivors' committed step (step: as if its state download carried the step), or "
        "every peer sets ElasticOuterGroup.set_state_fns so torchft heals the joiner (heal: the live join)",
    )
    p.add_argument(
        "--hivemind-python",
        default=os.environ.get("DILOCOX_HIVEMIND_PYTHON"),
        help="interpreter that can import hivemind (a separate venv; env DILOCOX_HIVEMIND_PYTHON)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.swarm_engines", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rtt", help="microbatch round trip")
    r.add_argument("--transport", required=True, choices=("tcp", "rpc", "gloo", "hivemind-unary", "hivemind-stream"))
    r.add_argument("--iters", type=int, default=200)
    r.add_argument("--warmup", type=int, default=20)
    r.add_argument("--hivemind-python", default=os.environ.get("DILOCOX_HIVEMIND_PYTHON"))
    for name in ("_rtt-server", "_rtt-client"):
        s = sub.add_parser(name)
        s.add_argument("--transport", required=True)
        s.add_argument("--iters", type=int, default=200)
        s.add_argument("--warmup", type=int, default=20)
        s.add_argument("--port", type=int, default=0)
        s.add_argument("--lifetime", type=float, default=300.0)
        s.add_argument("--timeout", type=float, default=30.0)
        s.add_argument("--info", default="{}")
    av = sub.add_parser("average", help="averaging time of a vector among --peers peers")
    av.add_argument("--engine", required=True, choices=("torchft", "hivemind"))
    av.add_argument("--peers", type=int, default=2)
    _add_avg_opts(av)
    rc = sub.add_parser("recovery", help="kill -9 one of 3 peers; time to the survivors' next averaging")
    rc.add_argument("--engine", required=True, choices=("torchft", "hivemind"))
    rc.add_argument("--kill-round", type=int, default=3)
    rc.add_argument("--restart", action="store_true", help="start the killed peer again (same command)")
    rc.add_argument("--restart-after", type=float, default=3.0)
    _add_avg_opts(rc)
    rc.set_defaults(rounds=12)
    pe = sub.add_parser("_avg-peer")
    pe.add_argument("--engine", required=True)
    pe.add_argument("--rank", type=int, required=True)
    pe.add_argument("--peers", type=int, required=True)
    pe.add_argument("--min-peers", type=int, required=True)
    pe.add_argument("--first-round", type=int, default=0)
    pe.add_argument("--t0-file", required=True, help="file where the driver writes round 0's wall-clock time")
    pe.add_argument("--out", required=True)
    pe.add_argument("--lighthouse", default=None)
    pe.add_argument("--initial-peers", default=None)
    _add_avg_opts(pe)
    tb = sub.add_parser("table", help="markdown rows of an `all` result file")
    tb.add_argument("file")
    fp = sub.add_parser("footprint", help="installed packages pulled by each engine")
    fp.add_argument("--hivemind-python", default=os.environ.get("DILOCOX_HIVEMIND_PYTHON"))
    al = sub.add_parser("all", help="every measurement, --repeats times; JSON to --out")
    al.add_argument("--repeats", type=int, default=3)
    al.add_argument("--iters", type=int, default=200)
    al.add_argument("--out", default=None)
    al.add_argument("--kill-round", type=int, default=3)
    al.add_argument("--restart-after", type=float, default=3.0)
    al.add_argument("--recovery-rounds", type=int, default=12)
    al.add_argument("--only", default=None, help="comma-separated subset of rtt,average,recovery,footprint")
    al.add_argument("--recovery-variants", default=None, help="comma-separated subset, e.g. torchft,hivemind")
    _add_avg_opts(al)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "rtt":
            py = a.hivemind_python if a.transport.startswith("hivemind") else None
            if py is None and a.transport.startswith("hivemind"):
                raise EngineUnavailable("--transport hivemind-*: give --hivemind-python (a venv with hivemind)")
            if py:
                check_hivemind(py)
            print(json.dumps(measure_rtt(a.transport, a.iters, a.warmup, py), indent=1))
        elif a.cmd == "_rtt-server":
            return _rtt_server(a)
        elif a.cmd == "_rtt-client":
            return _rtt_client(a)
        elif a.cmd in ("average", "recovery"):
            if a.engine == "hivemind":
                if not a.hivemind_python:
                    raise EngineUnavailable("--engine hivemind: give --hivemind-python (a venv with hivemind)")
                check_hivemind(a.hivemind_python)
            if a.cmd == "average":
                a.min_peers = a.peers
                print(json.dumps(measure_average(a), indent=1))
            else:
                a.min_peers = 2
                print(json.dumps(measure_recovery(a), indent=1))
        elif a.cmd == "_avg-peer":
            return _avg_peer(a)
        elif a.cmd == "footprint":
            print(json.dumps(footprint_all(a.hivemind_python), indent=1))
        elif a.cmd == "table":
            with open(a.file) as f:
                print(markdown_table(json.load(f)))
        elif a.cmd == "all":
            print(json.dumps(run_all(a), indent=1))
    except EngineUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
