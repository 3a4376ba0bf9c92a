"""Asynchronous outer communication: one background thread per rank that runs collectives.

The outer all-reduce of DiLoCo (ALGORITHMS §2–§4) must run *while* the next inner phase
trains. ``AsyncComm`` owns one worker thread; the caller submits a callable (typically the
compressor's blocking ``allreduce_mean`` on the dedicated ``outer`` process group) and gets a
``CommHandle`` back. ``handle.wait()`` returns the callable's result (or re-raises its
exception) and records how long the *caller* was blocked, which is the number the overlap
modes are judged by.

Tasks run one at a time, in submission order (FIFO), so a compressor's error-feedback state
is updated in the same order on every rank. The outer process group must be used only by
this thread while tasks are pending (topology.py creates a fresh communicator for it).

Link emulation (for tests and single-host benchmarks without ``tc``/netns):

- ``delay_s``: a sleep on the comm thread after every task (a slow or distant link);
- ``bandwidth``: a token-bucket cap in bytes/s. After a task that sent ``b`` bytes (read from
  the ``sent_bytes`` counter given at construction), the thread sleeps until the link would
  have been free: ``free_at = max(free_at, start) + b / bandwidth``. Cumulative bytes sent
  over elapsed link time therefore never exceed the cap. Less faithful than ``tc tbf``
  (the transfer itself is not slowed, only its completion), but enough to reproduce the
  timing of an outer step.

Bounded waits: ``configure(timeout_s=..., warn_after_s=..., peers=...)`` (the trainer passes
``outer.timeout_s``/``outer.warn_after_s``) makes ``handle.wait()`` log "waiting N s for the
outer all-reduce (<task>) with replica(s) 1 ..." while it lasts and raise
:class:`~dilocox.distributed.signals.CommTimeoutError` naming the task and the peers when the
timeout passes or the collective failed on the comm thread (e.g. gloo's own group timeout).
The thread is a daemon: a collective stuck forever cannot keep the process alive.

A CUDA stream of its own (``outer.comm_stream``, :class:`SideStream`): by default the comm thread's kernels (the
codec's, the copies to and from the host) go to the device's current stream, the one the training queues its kernels
on, so each host wait of the thread (a ``.cpu()``, a ``tolist()``) waits for every training kernel queued by then, and
the codec's kernels run between the training's. With a side stream the task runs on a stream of its own that waits,
on the GPU, for an event recorded on the caller's stream at ``submit`` (what the task reads is written by then); its
host waits wait for that work only. The thread synchronizes its stream before it hands the result over, and the
caller marks the result's CUDA tensors as used on its own stream (``record_stream``), so the caching allocator does not
give their memory to the side stream's next task while the training's kernels may still read them; in the same way the
thread marks the task's arguments and its codec's state as used on the side stream before the task runs. torchft's
Streaming DiLoCo also runs its fragments' all-reduces on a stream of their own (``torchft/local_sgd.py``,
``_StreamingDiLoCoFragment._stream``: ordered after the training's stream with ``wait_stream``, waited for with an
event). The side stream's memory is cached apart from the training's: the codec's working set stays reserved beside it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Iterator

import torch

from dilocox.distributed.signals import CommTimeoutError, bounded_wait

# The token bucket's cap, set by ``dilocox launch`` (and ``dilocox launch --elastic``) for every rank when it cannot
# use network namespaces + tc: bits per second of the replica's outer link, shared by its ranks
BANDWIDTH_ENV = "DILOCOX_EMULATED_BANDWIDTH_BPS"


def emulated_bandwidth_bytes() -> float | None:
    """The token-bucket cap in bytes/s from ``BANDWIDTH_ENV`` (None: no cap)."""
    bps = os.environ.get(BANDWIDTH_ENV)
    return float(bps) / 8.0 if bps else None


def _tensors(obj: Any, objects: int = 0, _seen: set | None = None) -> Iterator[torch.Tensor]:
    """The tensors in ``obj``: itself, or in its lists, tuples and dicts, nested; with ``objects`` > 0 also in the
    attributes of dilocox's own objects (a codec's state: its error buffers, its low-rank Q), that many objects deep."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, objects, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, objects, seen)
    elif objects > 0 and type(obj).__module__.startswith("dilocox.") and hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _tensors(x, objects - 1, seen)


class SideStream:
    """The comm thread's CUDA stream (module docstring). The three points where the threads meet:

    - ``ready()`` (caller thread, at ``submit``): an event on the caller's current stream;
    - ``begin(ready, uses)`` / ``end()`` (comm thread, around the task): the task's kernels on the side stream, after
      the event; the CUDA tensors of ``uses`` (the task's arguments, and the state of the codec among them) marked as
      used on the side stream, so that one the task frees or replaces (a codec's Q or error buffer made on the
      caller's stream) is not given to the caller's stream while the side stream's kernels may still read it; ``end``
      waits on the host for the side stream only;
    - ``hand_over(result)`` (caller thread, in ``wait``): the result's CUDA tensors marked as used on the caller's
      stream.

    The CPU tests replace it with a recording double; the CUDA tests run it (both in tests/test_gpu_paths.py)."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.stream: torch.cuda.Stream | None = None  # made on the comm thread's first task (its device selected)
        self._ctx = None

    def ready(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def begin(self, ready: Any, uses: Any = ()) -> None:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        ctx = torch.cuda.stream(self.stream)
        ctx.__enter__()
        self._ctx = ctx  # (entered: end() leaves it, whatever fails from here)
        self.stream.wait_event(ready)
        for t in _tensors(uses, objects=2):
            if t.is_cuda:  # (a tensor made on the side stream: a no-op for the allocator)
                t.record_stream(self.stream)

    def end(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if self.stream is not None:
            self.stream.synchronize()

    def hand_over(self, result: Any) -> None:
        cur = torch.cuda.current_stream(self.device)
        for t in _tensors(result):
            if t.is_cuda:
                t.record_stream(cur)


class CommHandle:
    """The future of one submitted task. ``wait()`` may be called more than once."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.comm_s = 0.0  # seconds the task occupied the comm thread (incl. emulated delay/cap)
        self.blocked_s = 0.0  # seconds the caller spent inside wait()
        self.policy: WaitPolicy | None = None  # set by AsyncComm.submit when configured
        self.side: SideStream | None = None  # set by AsyncComm.submit when the task ran on a side stream

    def _finish(self, result: Any = None, error: BaseException | None = None, comm_s: float = 0.0) -> None:
        self._result, self._error, self.comm_s = result, error, comm_s
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the task finished; return its result or re-raise its exception."""
        t0 = time.perf_counter()
        pol = self.policy
        if timeout is None and pol is not None and pol.bounded:
            what = f"{pol.what} ({self.name}) with {pol.peers}"
            try:
                bounded_wait(self._event, what, pol.timeout_s, pol.warn_after_s, pol.log)
            except CommTimeoutError as e:
                raise CommTimeoutError(
                    f"{e} ({pol.timeout_key}={pol.limit}); the last complete checkpoint is still valid"
                ) from None
        elif not self._event.wait(timeout):
            raise TimeoutError(f"communication task {self.name!r} did not finish within {timeout} s")
        self.blocked_s += time.perf_counter() - t0
        if self._error is not None:
            if getattr(self._error, "raise_as_is", False):  # its message already names the setting and the fix
                raise self._error
            if pol is not None and isinstance(self._error, RuntimeError):  # gloo/NCCL errors, their timeouts too
                raise CommTimeoutError(
                    f"{pol.what} ({self.name}) with {pol.peers} failed after "
                    f"{self.comm_s:.0f} s on the comm thread ({pol.timeout_key}="
                    f"{pol.limit}): {self._error}"
                ) from self._error
            raise RuntimeError(f"communication task {self.name!r} failed on the comm thread") from self._error
        if self.side is not None:  # (once: the caller's stream is the one it waits on)
            side, self.side = self.side, None
            side.hand_over(self._result)
        return self._result


class WaitPolicy:
    """How long ``CommHandle.wait()`` may block, when to warn, and what to call the operation."""

    def __init__(
        self,
        timeout_s: float | None = None,
        warn_after_s: float | None = None,
        what: str = "the outer all-reduce",
        peers: str = "the other replicas",
        timeout_key: str = "outer.timeout_s",
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout_s, self.warn_after_s, self.what, self.peers = timeout_s, warn_after_s, what, peers
        self.timeout_key = timeout_key
        self.limit = "none" if timeout_s is None else f"{timeout_s:g}"  # for messages
        self.log = log or (lambda m: print(m, flush=True))

    @property
    def bounded(self) -> bool:
        return self.timeout_s is not None or self.warn_after_s is not None


class DoneHandle(CommHandle):
    """A handle whose result is already known (an in-flight all-reduce restored from a checkpoint)."""

    def __init__(self, result: Any, comm_s: float = 0.0, name: str = "restored") -> None:
        super().__init__(name)
        self._finish(result, comm_s=comm_s)


class AsyncComm:
    """A FIFO worker thread for blocking collectives, with optional delay and bandwidth cap.

    Args:
        delay_s: seconds slept on the comm thread after each task (emulated latency).
        bandwidth: cap in bytes/s (None = uncapped); needs ``sent_bytes``.
        sent_bytes: zero-argument callable returning the cumulative bytes sent so far
            (e.g. ``lambda: stats.bytes_sent``); read before and after each task.
        name: thread name (shows up in stack dumps).
        device: the CUDA device of the tensors it moves (None or a CPU device: nothing to set). The current CUDA device
            is per thread and a new thread starts on cuda:0: the thread selects ``device`` first, so what it runs that
            reads the current device (torchft's quorum and streams, ``torch.cuda`` calls) uses this rank's GPU.
        side_stream: run every task on this :class:`SideStream` (``outer.comm_stream``; a CUDA ``device`` only), not on
            the caller's stream (module docstring).

    The thread starts on the first ``submit`` and stops in ``shutdown()`` (after draining
    the queue); a later ``submit`` starts it again.
    """

    def __init__(
        self,
        delay_s: float = 0.0,
        bandwidth: float | None = None,
        sent_bytes: Callable[[], int] | None = None,
        name: str = "outer-comm",
        device=None,
        side_stream: SideStream | None = None,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"AsyncComm delay_s={delay_s} must be >= 0")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"AsyncComm bandwidth={bandwidth} must be > 0 bytes/s (or None for no cap)")
        if bandwidth is not None and sent_bytes is None:
            raise ValueError("AsyncComm bandwidth cap needs sent_bytes=<callable returning cumulative bytes sent>")
        self.delay_s = delay_s
        self.bandwidth = bandwidth
        self._sent_bytes = sent_bytes
        self.name = name
        if getattr(device, "type", None) == "cuda" and device.index is None:  # (set_device needs the index)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.side_stream = side_stream
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._link_free_at = 0.0
        self.busy_s = 0.0  # cumulative seconds the thread spent on tasks
        self.policy: WaitPolicy | None = None
        self._last: CommHandle | None = None

    def configure(self, timeout_s: float | None = None, warn_after_s: float | None = None, **kw: Any) -> None:
        """Bound every later ``handle.wait()`` (see :class:`WaitPolicy` for ``what``/``peers``/``log``)."""
        self.policy = WaitPolicy(timeout_s, warn_after_s, **kw)

    # ------------------------------------------------------------------ public API
    def submit(self, fn: Callable[..., Any], *args: Any, name: str = "", **kwargs: Any) -> CommHandle:
        """Queue ``fn(*args, **kwargs)`` on the comm thread; return its handle at once."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        handle = CommHandle(name or getattr(fn, "__name__", "task"))
        handle.policy = self.policy
        ready = None
        if self.side_stream is not None:  # (on this thread: the event follows what the caller queued so far)
            ready = self.side_stream.ready()
            handle.side = self.side_stream
        self._last = handle
        self._queue.put((handle, fn, args, kwargs, ready))
        return handle

    @property
    def running(self) -> bool:
        """The thread is up (from the first ``submit`` until ``shutdown``)."""
        return self._thread is not None and self._thread.is_alive()

    def drain(self) -> None:
        """Block until every submitted task has finished (results stay in their handles).

        Bounded by the configured policy (FIFO: the last task done means all are done)."""
        last, pol = self._last, self.policy
        if last is None or pol is None or not pol.bounded:
            self._queue.join()
            return
        what = f"{pol.what} ({last.name}) with {pol.peers} ({pol.timeout_key}={pol.limit})"
        bounded_wait(last._event, what, pol.timeout_s, pol.warn_after_s, pol.log)

    def shutdown(self, timeout: float | None = None) -> bool:
        """Finish the queued tasks, then stop the thread. Safe to call twice.

        ``timeout`` bounds the wait (the error path of the training loop: a collective whose
        peer died may never finish); returns False if the thread is still busy after it."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
        self._thread = None
        return True

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        cuda = getattr(self.device, "type", None) == "cuda"
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            handle, fn, args, kwargs, ready = item
            t0 = time.perf_counter()
            before = self._sent_bytes() if self._sent_bytes is not None else 0
            result, error = None, None
            try:
                if cuda:  # (in the try: a failure is the task's, handed to its waiter, not a dead thread)
                    torch.cuda.set_device(self.device)
                if ready is None:
                    result = fn(*args, **kwargs)
                else:
                    try:
                        self.side_stream.begin(ready, (args, kwargs))
                        result = fn(*args, **kwargs)
                    finally:  # (before the args are let go: the side stream's kernels may still read them)
                        self.side_stream.end()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                error = e
            if error is None:
                self._emulate_link(t0, before)
            dt = time.perf_counter() - t0
            self.busy_s += dt
            handle._finish(result, error, dt)
            self._queue.task_done()

    def _emulate_link(self, t0: float, bytes_before: int) -> None:
        if self.bandwidth is not None and self._sent_bytes is not None:
            sent = self._sent_bytes() - bytes_before
            self._link_free_at = max(self._link_free_at, t0) + sent / self.bandwidth
            wait = self._link_free_at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        if self.delay_s > 0:
            time.sleep(self.delay_s)
