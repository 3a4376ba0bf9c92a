"""One host's ranks with every socket of the run on loopback (issue 21, docs/SECURITY.md).

``dilocox train --nproc N`` and the token-bucket fallback of ``dilocox launch`` start their ranks with torch's own
launcher (torchrun, ``torch.distributed.run --standalone``). Left alone, that opens ports a stranger can reach:
torchrun hosts two ``TCPStore`` masters (the c10d rendezvous's, and the one its ranks share for
``init_process_group``), and torch's store master listens on every interface whatever host it is given; the ranks'
gloo pairs listen at the address the host name resolves to. torch.distributed authenticates nothing, so whoever
reaches those ports can read and write the stores or speak to the pairs. Nothing of a one-host run needs to leave the
host, so ``python -m dilocox.launch.local_run`` is torchrun with:

- both store masters listening on 127.0.0.1 only: their listening sockets are bound here and handed to torch
  (``master_listen_fd``, as ``dilocox.net.store.loopback_store`` does), by patching the two places torchrun
  creates them (``c10d_rendezvous_backend.TCPStore`` and ``DynamicRendezvousHandler._create_tcp_store_server``);
- ``--local-addr 127.0.0.1``, so the ranks are told to meet at the shared store there;
- ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set to the loopback interface (unless the user set them), so the
  pairs listen on loopback too.

Every torchrun option still works (``local_run_argv`` adds ``--standalone``); several hosts keep torchrun's own
stores (their ranks must reach each other: put them on a private network or a tunnel): ``--multi-host`` as the first
argument (``launcher/slurm/*.sbatch``, an elastic replica) is torchrun itself with only the exit below.

A stop signal (SIGTERM from SLURM's ``--signal`` or ``scancel``, SIGINT): torchrun forwards it to the ranks, which
save and exit 128 + signal, waits for them, then raised ``SignalException`` out of its main and exited 1 with a
traceback. Here it exits 128 + signal with one line when every rank stopped that way, or with the code of a rank that
did not (an error while saving, killed after torchrun's 30 s); a rank still running then (torchrun forwards a second
signal and waits again, a third one cuts its clean-up short) is SIGKILLed rather than left behind.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Sequence

LOOPBACK = "127.0.0.1"
MULTI_HOST = "--multi-host"  # (first argument only) torchrun's own stores: the ranks of several hosts meet there


def loopback_ifname() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS/BSD), None where neither exists."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def loopback_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the collectives' socket interface on loopback, where the user did not choose one, and torchrun's
    shared store kept (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0's ``init_process_group`` would host a
    store master of its own, on every interface)."""
    out = dict(env)
    out.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    ifname = loopback_ifname()
    if ifname:
        out.setdefault("GLOO_SOCKET_IFNAME", ifname)
        out.setdefault("NCCL_SOCKET_IFNAME", ifname)
    return out


def local_run_argv(nproc: int, entry: Sequence[str], loopback: bool = True) -> list[str]:
    """The command that runs ``entry`` (``-m module args`` or ``script args``) on ``nproc`` ranks of this host.
    ``loopback=False``: torchrun's own stores and pairs, for an elastic replica (its ranks learn the replica's address
    from torchrun's ``MASTER_ADDR``, which the other replicas must be able to reach: ``train.build_elastic_group``)."""
    if not loopback:  # (torchrun's own stores, dilocox's exit: MULTI_HOST)
        return [
            sys.executable,
            "-m",
            "dilocox.launch.local_run",
            MULTI_HOST,
            "--standalone",
            f"--nproc_per_node={nproc}",
            *entry,
        ]
    return [
        sys.executable,
        "-m",
        "dilocox.launch.local_run",
        "--standalone",
        f"--local-addr={LOOPBACK}",
        f"--nproc_per_node={nproc}",
        *entry,
    ]


def patch_torchrun_stores() -> None:
    """Make torchrun's two store masters listen on loopback only (module docstring); clients are untouched."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    from dilocox.net.store import loopback_store

    def rendezvous_store(host, port, *args, is_master=False, **kwargs):
        if not is_master:
            return TCPStore(host, port, *args, is_master=False, **kwargs)
        kwargs.pop("master_listen_fd", None)
        return loopback_store(port=port, **kwargs)

    def shared_store(self, master_addr, master_port):
        return loopback_store(port=master_port, multi_tenant=True)

    c10d.TCPStore = rendezvous_store
    dyn.DynamicRendezvousHandler._create_tcp_store_server = shared_store


def failed_exit_code(first: int, codes: Sequence[int]) -> int:
    """The launch's exit code when ranks failed: the first failed rank's own code (2: a config or run-dir error
    that every rank agreed on, 1: an error, 143: stopped by a SIGTERM of its own, ...), else another rank's; 1 when
    every failed rank was killed by a signal (the ranks torchrun stopped itself after the first failure die of its
    SIGTERM: theirs is not what happened)."""
    return next((c for c in (first, *codes) if c > 0), 1)


def said_by_ranks(first: int, codes: Sequence[int]) -> bool:
    """Whether the ranks already said why they failed in one line each: the first failed rank exited 2 (a config,
    data or run-dir error every rank agreed on) and the others 2 too or killed by torchrun after it."""
    return first == 2 and all(c == 2 or c < 0 for c in codes)


def _quiet_config_failures() -> None:
    """Drop torchrun's own ERROR line about a rank that exited 2 (the rank printed the one line that matters)."""
    import logging

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            msg, args = record.msg, record.args
            return not (isinstance(msg, str) and msg.startswith("failed (exitcode: %s)") and args and args[0] == 2)

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_Drop())


def _quiet_stop_lines() -> None:
    """Drop torchrun's own WARNING lines of a stop ("Received 15 death signal, shutting down workers", "Sending
    process N closing signal SIGTERM", one each per node and rank): ``main`` says it in one line per node, and each
    rank says where it saved. Its line about a rank that would not stop ("Unable to shutdown process") stays."""
    import logging

    said = {
        "torch.distributed.elastic.agent.server.api": "Received %s death signal",
        "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal",
    }
    for name, start in said.items():

        class _Drop(logging.Filter):
            def filter(self, record: logging.LogRecord, start: str = start) -> bool:
                return not (isinstance(record.msg, str) and record.msg.startswith(start))

        logging.getLogger(name).addFilter(_Drop())


def launch_exit_code(codes: Sequence[int]) -> int:
    """A launcher's exit code from its jobs' (``Popen.returncode``: -N when killed by signal N): 0 when every job
    exited 0; else the first job's own error code (> 0: what failed; a job the launcher killed after it is -N);
    else 128 + N of the first killed one, as a shell says it (``sys.exit(-9)`` would exit 247)."""
    failed = [c for c in codes if c]
    if not failed:
        return 0
    return next((c for c in failed if c > 0), 128 - failed[0])


def stopped_exit_code(signum: int, codes: dict[int, int | None]) -> tuple[int, str]:
    """After a stop signal: the exit code and its one line, from each local rank's exit code (None: still running).
    A rank that exited 0, 128 + signal (it saved and stopped) or died of that very signal (before its handler was
    set: nothing to save) stopped as asked; any other outcome is the launch's code."""
    name = signal.Signals(signum).name
    odd = {r: c for r, c in sorted(codes.items()) if c not in (0, 128 + signum, -signum)}
    if not codes:
        return 128 + signum, f"torchrun: stopped by {name} before its ranks started"
    if not odd:
        return 128 + signum, f"torchrun: stopped by {name}: every local rank ({len(codes)}) stopped"
    said = ", ".join(
        f"local rank {r} " + ("still running: killed" if c is None else f"exited {c}") for r, c in odd.items()
    )
    positive = [c for c in odd.values() if c is not None and c > 0]  # a rank's own error code
    killed = [-c if c is not None else signal.SIGKILL for c in odd.values()]  # else a rank killed (or killed here)
    return positive[0] if positive else 128 + int(killed[0]), f"torchrun: stopped by {name}; {said}"


def _watch_workers() -> dict:
    """The handlers of torchrun's worker processes (``local rank -> handler``), kept from its last shutdown."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    seen: dict = {}
    shutdown = getattr(LocalElasticAgent, "_shutdown", None)
    if shutdown is None:  # (a torch without it: the exit code still comes from the signal, no rank is watched)
        return seen

    def keeping(self, *args, **kwargs):
        seen.clear()
        seen.update(getattr(self._pcontext, "subprocess_handlers", None) or {})
        return shutdown(self, *args, **kwargs)

    LocalElasticAgent._shutdown = keeping
    return seen


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from dilocox.distributed.procs import kill_group

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [MULTI_HOST]:
        argv = argv[1:]
    else:
        patch_torchrun_stores()
    workers = _watch_workers()
    _quiet_config_failures()
    _quiet_stop_lines()
    try:
        run.main(argv)
    except ChildFailedError as e:  # which rank failed and why, without torchrun's Python traceback around it
        first, codes = e.get_first_failure()[1].exitcode, [f.exitcode for f in e.failures.values()]
        if not said_by_ranks(first, codes):  # (a config error: each rank's one line is all there is to say)
            print(e, file=sys.stderr)
        return failed_exit_code(first, codes)
    except SignalException as e:  # torchrun forwarded it to the ranks and waited for them (module docstring)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (torch's handler would raise in here)
            signal.signal(sig, signal.SIG_IGN)
        codes = {r: h.proc.poll() for r, h in workers.items()}
        for r, c in codes.items():
            if c is None:  # a third signal cut torchrun's clean-up short: nothing of the run outlives it
                kill_group(workers[r].proc.pid)
        code, line = stopped_exit_code(int(e.sigval), codes)
        print(line, file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
