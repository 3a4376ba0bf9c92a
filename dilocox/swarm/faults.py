"""Injected slowness and failure of a SWARM peer: one object handed to the peer (issue 25 item 5), so the
production classes hold no test switch. ``Faults()``, the default, injects nothing.

- ``delay_s`` (``--delay-s``): every microbatch waits this long before its forward. Without ``delay_serial`` the
  waits of concurrent microbatches overlap (a slow link); with it (``--delay-serial``) the wait holds the compute
  lock, like slower compute, and lowers the peer's throughput.
- ``pace_s`` (``--pace-s``): each microbatch occupies the peer (compute lock held) for max(pace, its compute)
  seconds, so a peer paced at 2T is exactly 2x slower than one paced at T whatever the host's load
  (heterogeneous-peer benchmarks).
- ``die_mid_step`` (``--die-mid-step``, tests): kill -9 of the peer's own process in the first step >= this one in
  which a sender that holds microbatches it completed pings it at the end of the step (``StepEnd._die``): a
  deterministic point mid-step, after serving.

The peer's command line builds it (``swarm/peer.py``); ``dilocox swarm --delay/--pace`` and the tests pass the flags.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

log = logging.getLogger("dilocox.swarm")


@dataclass(frozen=True)
class Faults:
    delay_s: float = 0.0
    delay_serial: bool = False
    pace_s: float = 0.0
    die_mid_step: int | None = None

    def before_compute(self) -> None:
        """A microbatch's delay outside the compute lock (concurrent ones overlap)."""
        if self.delay_s and not self.delay_serial:
            time.sleep(self.delay_s)

    def in_compute(self) -> None:
        """A microbatch's delay inside the compute lock (``delay_serial``: it occupies the peer)."""
        if self.delay_s and self.delay_serial:
            time.sleep(self.delay_s)

    def pace(self, spent: float) -> None:
        """Sleep the rest of the microbatch's pace (called with the compute lock held); ``spent``: its compute so
        far (forward + backward, lock held)."""
        if self.pace_s > spent:
            time.sleep(self.pace_s - spent)

    def dies_at(self, step: int, held: int) -> bool:
        """Whether a ping from a sender that holds ``held`` microbatches completed here in ``step`` is the trigger."""
        return self.die_mid_step is not None and held > 0 and step >= self.die_mid_step

    def die(self, message: str) -> None:
        """kill -9 of this process, after logging ``message`` (every log handler flushed first)."""
        log.warning("%s", message)
        for h in logging.getLogger().handlers:
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)
