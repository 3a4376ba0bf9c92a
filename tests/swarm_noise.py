"""A SWARM job of one peer per stage with background traffic started once its peers are up (the noise and flood
tests of tests/test_security.py and tests/test_accept_gate.py)."""

from __future__ import annotations

import threading


def launch_beside(cfg, out: str, steps: int, target, stop: threading.Event):
    """``dilocox.swarm.runtime.launch`` of ``cfg`` into ``out`` with ``target(launcher)`` running in a daemon thread
    from the moment the peers are started; ``stop`` is set when the job ends (the target must watch it), and the
    thread is joined (10 s at most)."""
    from dilocox.swarm.runtime import launch

    threads = []

    def start(la):
        t = threading.Thread(target=target, args=(la,), daemon=True)
        t.start()
        threads.append(t)

    try:
        return launch(cfg, out, peers_per_stage=[1, 1], steps=steps, timeout_s=240, on_started=start)
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def assert_exited_zero(*results) -> None:
    for res in results:
        for name, rc in res.returncodes.items():
            assert rc == 0, f"{name} exited {rc}:\n{res.log_tail(name)}"
