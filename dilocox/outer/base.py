"""What both outer objects share: the comm thread, its counters and logs, the common checkpoint fields.

``GradientSync`` (per-step methods, ``gradsync.py``) and ``DiLoCoOuter`` (the DiLoCo family,
``diloco.py``) both run their collectives on one ``AsyncComm`` thread over the ``outer``
process group and report the same stats. The training loop calls, per inner step
(0-based ``step``)::

    loss.backward(); outer.on_gradients(step)              # per-step methods: mean of the grads
    clip; inner_opt.step(); outer.after_inner_step(step)   # DiLoCo family: phase ends
    ...; outer.finish()                                     # end of training (outer.close() on errors)

Each class implements the hooks it needs; the other one is a no-op here.
"""

from __future__ import annotations

from torch import nn

from dilocox.compress.codec import rank_of
from dilocox.compress.collectives import CommStats
from dilocox.config import CompressConfig, OuterConfig
from dilocox.distributed.comm import AsyncComm, CommHandle, SideStream
from dilocox.outer.group import FixedGroup, OuterGroup


def side_stream_for(ocfg: OuterConfig, device) -> SideStream | None:
    """The comm thread's CUDA stream of its own (``outer.comm_stream``): on a CUDA device only (a CPU run refuses the
    key at load; ``train.device=auto`` on a host without a GPU runs as without it)."""
    return SideStream(device) if ocfg.comm_stream and getattr(device, "type", None) == "cuda" else None


class OuterBase:
    """Comm thread, counters and the checkpoint fields every outer method has.

    Args:
        named_params: this rank's ``(name, parameter)`` list (its stage and TP slice).
        topo: the Topology (None: a single process).
        ocfg, ccfg: ``outer`` and ``compress`` config sections.
        seed: shared by all replicas (compressor random projections/masks).
        comm_delay_s, comm_bandwidth: link emulation on the comm thread (seconds per
            all-reduce; bytes/s token bucket), see distributed/comm.py.
        group: the replicas to average over (``OuterGroup``, group.py); default: the fixed process group
            ``topo.group("outer")`` (``FixedGroup``).
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        topo,
        ocfg: OuterConfig,
        ccfg: CompressConfig,
        seed: int,
        comm_delay_s: float = 0.0,
        comm_bandwidth: float | None = None,
        group: OuterGroup | None = None,
    ) -> None:
        self.ocfg, self.ccfg, self.method, self.seed = ocfg, ccfg, ocfg.method, seed
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.topo = topo
        self.group: OuterGroup = group if group is not None else FixedGroup.of(topo, ocfg.norm_check)
        self.R = len(topo.ranks["outer"]) if topo is not None else 1
        self.H = ocfg.sync_every
        self.outer_step = 0
        # did the last step's outer work use the links between replicas (an all-reduce launched or applied)? The
        # per-step methods: always; the DiLoCo family sets it in after_inner_step. The trainer's stop-signal
        # exchange between replicas rides on these steps only (distributed/signals.StopFlag)
        self.crossed_replicas = True
        self.compressors: list = []
        self._counters = {"blocked_s": 0.0, "blocked_total_s": 0.0, "comm_s": 0.0, "n_syncs": 0}
        self._comm_total_before = 0.0  # comm-thread seconds of earlier runs (restored on resume)
        self._blocked_now = self._save_wait_s = 0.0  # (_save_wait_s: a state_dict's wait since the step: diloco.py)
        self.comm_stats = CommStats()
        self.group.stats = self.comm_stats  # (the group counts every call's bytes there)
        # (sent, received) as they stood when the last collective waited for ended: what ``stats`` reports, so a
        # step's record counts the bytes of the all-reduces it took, whatever the comm thread's timing (``_start``)
        self._settled = (0, 0)
        # the thread starts on the first submit, so a constructor that raises later leaves none behind
        device = self.params[0].device if self.params else None
        self.comm = AsyncComm(
            delay_s=comm_delay_s,
            bandwidth=comm_bandwidth,
            sent_bytes=lambda: self.comm_stats.bytes_sent,
            name=f"outer-comm-{topo.rank if topo else 0}",
            device=device,  # (the thread selects this rank's GPU)
            side_stream=side_stream_for(ocfg, device),
        )

    # ------------------------------------------------------------------ hooks (no-ops unless overridden)
    def on_gradients(self, step: int) -> None:
        """After backward, before clipping and the inner step (per-step methods)."""

    def after_inner_step(self, step: int) -> None:
        """After the inner optimizer step (the DiLoCo family's phase ends)."""

    # finish() sets the params to the outer params θ (the DiLoCo family): a finished run resumed with more steps goes on
    # from θ, not from where an uninterrupted longer run would have been (the trainer says so at the resume)
    params_to_theta_at_finish = False

    def finish(self) -> None:
        """End of training: apply what is in flight and stop the comm thread."""
        self.comm.shutdown()

    def bound_waits(self, timeout_s: float | None, warn_after_s: float | None, **kw) -> None:
        """Bound every later wait on this loop's outer collectives (``outer.timeout_s``) and log the
        ones that last longer than ``warn_after_s`` (see :meth:`AsyncComm.configure`)."""
        self.comm.configure(timeout_s, warn_after_s, **kw)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the comm thread without applying anything (the error path); bounded by ``timeout``:
        a collective whose peer died may never finish. False if the thread is still busy after it."""
        return self.comm.shutdown(timeout=timeout)

    # ------------------------------------------------------------------ communication
    def _start(self, fn, *args) -> CommHandle:
        """Queue ``fn(*args)`` on the comm thread. The handle keeps the byte counters as they stood when ``fn``
        ended; ``_wait`` settles them. Read live, the counters of a step with an all-reduce in flight (delayed
        overlap, streaming) held whatever part of it the thread had sent by then: the same run logged different
        per-step bytes from one try to the next (the totals were exact)."""
        stats, ended = self.comm_stats, []

        def task(*a):
            try:
                return fn(*a)
            finally:  # (FIFO: a later task's counters include every earlier task's bytes)
                ended.append((stats.bytes_sent, stats.bytes_received))

        h = self.comm.submit(task, *args, name=getattr(fn, "__name__", "task"))
        h.counters_at_end = ended
        return h

    def _submit(self, fn, *args) -> CommHandle:
        self._counters["n_syncs"] += 1
        h = self._start(fn, *args)
        if self.ocfg.blocking:
            self._wait(h)  # on the critical path; a later wait() returns at once
        return h

    def _wait(self, h: CommHandle):
        before = h.blocked_s
        out = h.wait()
        for sent, received in getattr(h, "counters_at_end", ()):  # (a DoneHandle: counted when it ran)
            self._settled = (max(self._settled[0], sent), max(self._settled[1], received))
        blocked = h.blocked_s - before
        self._blocked_now += blocked
        self._counters["blocked_total_s"] += blocked
        self._counters["comm_s"] = h.comm_s
        return out

    # ------------------------------------------------------------------ logs and checkpoints
    @property
    def stats(self) -> dict:
        rank = rank_of(self.compressors[0]) if self.compressors else 0  # 0: no low-rank compression
        # the bytes of the collectives waited for; all of them once the comm thread has stopped (the run's end)
        sent, received = (
            self._settled if self.comm.running else (self.comm_stats.bytes_sent, self.comm_stats.bytes_received)
        )
        out = {
            "outer_step": self.outer_step,
            "H": self.H,
            "rank": int(rank),
            "bytes_sent": int(sent),
            "bytes_received": int(received),
        }
        out.update(self._counters)
        out["comm_total_s"] = self._comm_total_before + self.comm.busy_s
        return out

    def _method_state_dict(self) -> dict:
        """The subclass's own fields (in-flight work waited for first)."""
        return {}

    def _check_compatible(self, sd: dict) -> None:
        """Raise ValueError if ``sd`` was written with settings that change the state's shapes."""

    def _load_method_state(self, sd: dict) -> None:
        """Load the subclass's own fields."""

    def state_dict(self) -> dict:
        sd: dict = {"version": 1, "method": self.method, "H": self.H, "outer_step": self.outer_step}
        sd.update(self._method_state_dict())
        sd["compressors"] = [c.state_dict() for c in self.compressors]
        sd["counters"] = dict(self._counters, comm_total_s=self.stats["comm_total_s"])  # after the waits above
        sd["comm_stats"] = self.comm_stats.as_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("method") != self.method:
            raise ValueError(
                f"outer state in the checkpoint is for outer.method={sd.get('method')!r}, this run has {self.method!r}"
            )
        self._check_compatible(sd)  # before loading any of it
        if len(sd["compressors"]) != len(self.compressors):
            raise ValueError(f"checkpoint has {len(sd['compressors'])} compressors, this run {len(self.compressors)}")
        self.H, self.outer_step = int(sd["H"]), int(sd["outer_step"])
        counters = dict(sd["counters"])
        self._comm_total_before = float(counters.pop("comm_total_s", 0.0)) - self.comm.busy_s
        self._counters.update(counters)
        for k, v in sd["comm_stats"].items():
            setattr(self.comm_stats, k, v)
        # (a checkpoint waits for what is in flight first: every byte it counted was settled)
        self._settled = (self.comm_stats.bytes_sent, self.comm_stats.bytes_received)
        for c, csd in zip(self.compressors, sd["compressors"]):
            c.load_state_dict(csd)
        self._load_method_state(sd)
