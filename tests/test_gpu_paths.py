"""Paths that only a GPU run takes, checked on the CPU where an emulation allows (issue: GPU-only crashes).

On a GPU the tensors of a step live on the device while some helpers still make theirs on the host; on a CPU run
both are the host and nothing shows. The emulations put the "device" side on torch's ``meta`` device: an op that
mixes a meta and a CPU tensor fails as one that mixes a CUDA and a CPU tensor does. The tests marked ``cuda`` run the
real thing (``make test-gpu``; skipped without a CUDA device).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from dilocox.elastic.group import ElasticResult
from dilocox.elastic.quorum import QuorumGroup

no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on a GPU machine)")


class _FakeElastic:
    """What ``QuorumGroup`` needs of an ``ElasticOuterGroup``: one member contributing alone. ``flat_sum`` records the
    buffer it was handed and answers with host tensors of the reduced values (a meta buffer holds none)."""

    def __init__(self, max_replicas: int = 4, replica_rank: int = 1) -> None:
        self.cfg = SimpleNamespace(max_replicas=max_replicas, replica_rank=replica_rank)
        self.group = SimpleNamespace(size=lambda: 1)
        self.group_rank, self.on_quorum, self.seen = 0, None, []

    def flat_sum(self, buf: torch.Tensor, contribute: bool):
        self.seen.append(buf)
        onehot = torch.zeros(self.cfg.max_replicas)
        onehot[self.cfg.replica_rank] = float(contribute)
        total = torch.arange(buf.numel(), dtype=torch.float32) if buf.device.type == "meta" else buf.clone()
        return total, onehot

    def run_step(self, body, contribute: bool = True) -> ElasticResult:
        total, onehot = body(contribute)
        who = [int(i) for i in torch.nonzero(onehot).flatten().tolist()]
        return ElasticResult(total, who, 0, 1, 1, 0.0, 0.0, world=1)


def test_elastic_plain_mean_of_device_tensors_keeps_its_slots_on_their_device():
    """Bug: ``QuorumGroup``'s plain (lossless) outer all-reduce built its one buffer as ``torch.cat([flat, side])``,
    the pseudo-gradients (on the GPU) with the proposal slots made on the host: "Expected all tensors to be on the same
    device" at the first outer step of every elastic run on a GPU with the default ``compress.quant=none``. Emulated
    with meta tensors: the buffer must be made on the tensors' device."""
    el = _FakeElastic()
    tensors = [torch.zeros(3, 2, device="meta"), torch.zeros(5, device="meta")]
    out = QuorumGroup(el).allreduce_mean(tensors, step=1)
    (buf,) = el.seen
    assert buf.device.type == "meta" and buf.numel() == 11 + el.cfg.max_replicas
    assert [tuple(o.shape) for o in out] == [(3, 2), (5,)]


def test_elastic_plain_mean_on_the_host_is_unchanged():
    """The host path of the same call (what the CPU suite runs): the mean of one contributor is its input."""
    el = _FakeElastic()
    tensors = [torch.arange(6.0).view(3, 2), torch.ones(5)]
    out = QuorumGroup(el).allreduce_mean(tensors, step=1)
    assert all(torch.equal(o, t) for o, t in zip(out, tensors))


def _hf_dir(tmp_path, vocab: int = 256):
    from dilocox import hf
    from dilocox.config import ModelConfig
    from dilocox.model.transformer import build_model

    small = ModelConfig(n_layers=1, d_model=32, n_heads=4, vocab_size=vocab, max_seq_len=32)
    d = str(tmp_path / "hf")
    hf.save_hf_dir(d, small, build_model(small).gather_full_state_dict())
    return d, small


def test_init_from_with_a_larger_vocab_pads_on_the_hf_tensors_device(tmp_path, monkeypatch):
    """Bug: ``load_hf_full_state_dict`` (``model.init_from`` with ``model.vocab_size`` above the HF vocabulary, e.g.
    GPT-2's 50257 padded to 50304) concatenated the HF rows (read on the host) with the padding rows of the model's own
    init (``gather_full_state_dict``: on the GPU in a GPU run): "Expected all tensors to be on the same device" before
    the first step. Emulated with the roles swapped (HF tensors on meta, the init on the host): the padding rows must
    be moved to the HF tensors' device."""
    from dilocox import hf
    from dilocox.model.transformer import build_model

    d, small = _hf_dir(tmp_path)
    big = dataclasses.replace(small, vocab_size=320)
    read = hf.load_hf_tensors
    monkeypatch.setattr(hf, "load_hf_tensors", lambda p: {k: v.to("meta") for k, v in read(p).items()})
    full = hf.load_hf_full_state_dict(d, big, lambda: build_model(big).gather_full_state_dict())
    for k in ("embed.weight", "head.weight"):
        assert full[k].device.type == "meta" and tuple(full[k].shape) == (320, 32)


def test_bench_checkpoint_ranks_each_take_their_own_gpu(monkeypatch):
    """Bug: ``dilocox bench checkpoint``'s workers set RANK and WORLD_SIZE but not LOCAL_RANK, so ``pick_device`` put
    every rank of a tp2/pp2 layout on cuda:0 and NCCL refused the group ("Duplicate GPU detected"). The worker must
    set LOCAL_RANK to its rank (one host)."""
    import dilocox.train
    from dilocox.bench import checkpoint as bench_ckpt

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS"):
        monkeypatch.setenv(k, "0")  # (restored after the test: the worker writes the process's environment)

    class Stop(Exception):
        pass

    def trainer(cfg):
        raise Stop

    monkeypatch.setattr(dilocox.train, "Trainer", trainer)
    monkeypatch.setattr(bench_ckpt, "_cfg", lambda *a, **k: None)
    with pytest.raises(Stop):
        bench_ckpt._worker(1, 1, "unused", "unused", "unused", [], 1, None)
    assert os.environ["LOCAL_RANK"] == "1"


def test_outer_comm_thread_selects_the_ranks_gpu(monkeypatch):
    """Bug: the current CUDA device is per thread and a new thread starts on cuda:0. The outer comm thread never
    selected this rank's GPU, so what it runs that reads the current device did it on cuda:0 on every rank of a node:
    torchft's quorum (``start_quorum`` passes ``torch.accelerator.current_device_index()`` to its quorum thread, which
    selects that device and calls ``torch.accelerator.synchronize()``; ``_ManagedWork`` takes the current stream),
    opening a CUDA context on GPU 0 from every rank and synchronizing the wrong GPU. Emulated by recording
    ``torch.cuda.set_device``: each task must run with the params' device selected on the comm thread."""
    import threading

    from dilocox.distributed.comm import AsyncComm

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.get_ident(), d)))
    comm = AsyncComm(device=torch.device("cuda", 3))
    try:
        worker = comm.submit(threading.get_ident).wait(timeout=30)
    finally:
        comm.shutdown(timeout=30)
    assert calls and all(tid == worker and d == torch.device("cuda", 3) for tid, d in calls)
    cpu = AsyncComm(device=torch.device("cpu"))
    try:
        cpu.submit(lambda: None).wait(timeout=30)
    finally:
        cpu.shutdown(timeout=30)
    assert len(calls) == 1  # a CPU device: nothing selected


class _RecordingSideStream:
    """``SideStream``'s three meeting points (distributed/comm.py), recorded with the thread each ran on."""

    def __init__(self) -> None:
        import threading

        self.log: list[tuple] = []
        self._tid = threading.get_ident
        self.in_task = False
        self.uses: list = []

    def ready(self):
        ev = object()
        self.log.append(("ready", self._tid(), ev))
        return ev

    def begin(self, ready, uses=()) -> None:
        self.log.append(("begin", self._tid(), ready))
        self.uses.append(uses)
        self.in_task = True

    def end(self) -> None:
        self.in_task = False
        self.log.append(("end", self._tid(), None))

    def hand_over(self, result) -> None:
        self.log.append(("hand_over", self._tid(), result))


def test_outer_comm_stream_orders_each_task_after_the_callers_event_and_hands_the_result_over():
    """``outer.comm_stream``'s protocol (the GPU test below runs it on CUDA): the event is recorded on the submitting
    thread at ``submit`` (after what the caller queued), the task runs between ``begin`` (which waits for that
    event) and ``end`` (which waits for the side stream) on the comm thread, the handle completes after ``end``, and
    the caller hands the result over on its own thread once, however often it waits; a task that raises still ends
    its stream before its error reaches the caller. No side stream: none of it."""
    import threading

    from dilocox.distributed.comm import AsyncComm

    side = _RecordingSideStream()
    comm = AsyncComm(side_stream=side)
    me = threading.get_ident()
    seen = []
    try:
        arg = [torch.zeros(3)]
        h = comm.submit(lambda a, k=None: seen.append(side.in_task) or [torch.ones(2)], arg, k=arg[0], name="a")
        assert side.log[0][:2] == ("ready", me)  # at submit, on the caller's thread
        out = h.wait(timeout=30)
        h.wait(timeout=30)

        def boom():
            raise ValueError("codec failed")

        h2 = comm.submit(boom, name="b")
        with pytest.raises(RuntimeError) as e:
            h2.wait(timeout=30)
        assert isinstance(e.value.__cause__, ValueError)
    finally:
        comm.shutdown(timeout=30)
    assert seen == [True]  # the task ran inside begin/end
    kinds = [k for k, _, _ in side.log]
    assert kinds == ["ready", "begin", "end", "hand_over", "ready", "begin", "end"], kinds  # once; none for an error
    (_, _, ev1), (_, worker, got1), (_, w2, _), (_, t_hand, res) = side.log[:4]
    assert got1 is ev1 and side.log[5][2] is side.log[4][2]  # each task waits for its own submit's event
    assert worker != me and w2 == worker and t_hand == me
    assert res is out and torch.equal(out[0], torch.ones(2))
    (args, kwargs) = side.uses[0]
    assert args == (arg,) and kwargs == {"k": arg[0]}  # what the side stream marks as used: the task's arguments
    plain = AsyncComm()
    try:
        h = plain.submit(lambda: 3)
        assert h.side is None and h.wait(timeout=30) == 3
    finally:
        plain.shutdown(timeout=30)


def test_outer_comm_stream_marks_the_arguments_and_the_codecs_state_as_used_on_the_side_stream():
    """What ``SideStream.begin`` marks (``record_stream``) before a task runs: every tensor of its arguments and of the
    codec's state among them (the sparse codec's error buffer, the low-rank codec's Q: a codec that replaces one made
    on the training's stream frees it while the side stream may still read it), each once; objects that are not
    dilocox's are not walked."""
    from dilocox.compress.compressor import build_compressor
    from dilocox.config import CompressConfig
    from dilocox.config.sections import LowRankConfig, SparseConfig
    from dilocox.distributed.comm import _tensors

    shapes = [torch.Size([64, 32]), torch.Size([32])]
    delta = [torch.randn(s) for s in shapes]
    sparse = build_compressor(CompressConfig(sparse=SparseConfig(enabled=True, chunk=64)), shapes, 0)
    sparse.allreduce_mean([d.clone() for d in delta], None, 1)  # (one sync on one process: the error buffer exists)
    lowrank = build_compressor(CompressConfig(lowrank=LowRankConfig(enabled=True, rank=4)), shapes, 0)
    found = list(_tensors(((delta, 7, sparse), {}), objects=2))
    ids = [id(t) for t in found]
    assert len(ids) == len(set(ids))
    assert all(any(t is d for t in found) for d in delta)
    assert all(any(t is e for t in found) for e in sparse._err) and sparse._err
    qs = list(lowrank.lowrank.q.values())
    found = list(_tensors(((delta, lowrank), {}), objects=2))
    assert qs and all(any(t is q for t in found) for q in qs)

    class Foreign:  # (not dilocox's: not walked)
        def __init__(self):
            self.t = torch.ones(1)

    assert list(_tensors(([Foreign()], {}), objects=2)) == []


def test_outer_comm_stream_is_taken_on_a_cuda_device_only(monkeypatch):
    """The outer loop builds a side stream for ``outer.comm_stream=true`` on a CUDA device only (a CPU run: refused at
    load, tests/test_config_noops.py; ``train.device=auto`` on a host without a GPU: none, as without the key), and
    hands it to its comm thread."""
    from dilocox.config import CompressConfig, OuterConfig
    from dilocox.outer import base
    from dilocox.outer.diloco import DiLoCoOuter

    made = []
    monkeypatch.setattr(base, "SideStream", lambda device: made.append(device) or _RecordingSideStream())
    on, off = OuterConfig(method="diloco", comm_stream=True), OuterConfig(method="diloco")
    for ocfg, dev in ((on, torch.device("cpu")), (on, torch.device("meta")), (on, None), (off, torch.device("cuda"))):
        assert base.side_stream_for(ocfg, dev) is None
    assert made == []
    assert isinstance(base.side_stream_for(on, torch.device("cuda", 1)), _RecordingSideStream)
    assert made == [torch.device("cuda", 1)]
    made.clear()
    seen = []
    monkeypatch.setattr(base, "side_stream_for", lambda ocfg, device: seen.append((ocfg.comm_stream, device)) or None)
    outer = DiLoCoOuter([("w", torch.nn.Parameter(torch.randn(8, 4)))], None, on, CompressConfig(), seed=0)
    outer.close(timeout=10)
    assert seen == [(True, torch.device("cpu"))]  # the params' device and the key reach it


# ------------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.cuda
@no_cuda
def test_cuda_elastic_plain_mean_of_cuda_tensors():
    """The first bug above on a GPU: the plain elastic mean of CUDA tensors (one contributor) is its input, on the
    GPU."""
    el = _FakeElastic()
    tensors = [torch.arange(6.0, device="cuda").view(3, 2), torch.ones(5, device="cuda")]
    out = QuorumGroup(el).allreduce_mean(tensors, step=1, propose=7)
    assert el.seen[0].is_cuda and all(o.is_cuda and torch.equal(o, t) for o, t in zip(out, tensors))


@pytest.mark.cuda
@no_cuda
def test_cuda_init_from_pads_a_cuda_model(tmp_path):
    """The second bug above on a GPU: ``init_from`` with a larger vocabulary and the model's init on the GPU."""
    from dilocox import hf
    from dilocox.model.transformer import build_model

    d, small = _hf_dir(tmp_path)
    big = dataclasses.replace(small, vocab_size=320)
    model = build_model(big, device="cuda")
    full = hf.load_hf_full_state_dict(d, big, model.gather_full_state_dict)
    model.load_full_state_dict(full)
    assert tuple(full["embed.weight"].shape) == (320, 32)


class _FakeHealingGroup:
    """A group that heals (``outer.elastic``) whose join records the device of the joiner's zeros."""

    heals, contributors, agreed, stats = True, [0], None, None

    def __init__(self) -> None:
        self.devices: list[torch.device] = []

    def set_state_fns(self, state_fn, load_fn, max_state_bytes=None) -> None:
        pass

    def join(self, step, layout):
        tensors, _ = layout()
        self.devices += [t.device for t in tensors]
        return tensors


@pytest.mark.cuda
@no_cuda
def test_cuda_elastic_joiner_runs_its_codec_on_the_params_device():
    """Bug: an elastic joiner's round ran the codec on zeros made on ``outer.state_device`` (the host by default) while
    the live replicas' pseudo-gradients are on the GPU: its decode (PowerSGD's QR and products) on the CPU, theirs on
    the GPU, so "the same bits on every member" did not hold for the θ it joined with. The zeros must be on the
    params' device."""
    from dilocox.config import CompressConfig, OuterConfig
    from dilocox.outer.diloco import DiLoCoOuter

    params = [("w", torch.nn.Parameter(torch.randn(8, 4, device="cuda")))]
    g = _FakeHealingGroup()
    outer = DiLoCoOuter(params, None, OuterConfig(method="diloco"), CompressConfig(), seed=0, group=g)
    try:
        assert outer.join() is None
    finally:
        outer.close(timeout=10)
    assert g.devices and all(d.type == "cuda" for d in g.devices)


def _spin_cycles(seconds: float) -> int:
    """``torch.cuda._sleep`` cycles of about ``seconds`` on this GPU (timed after a warm-up)."""
    import time

    torch.cuda._sleep(1000)  # (the kernel loaded before it is timed)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return int(100_000_000 * seconds / (time.perf_counter() - t0))


@pytest.mark.cuda
@no_cuda
def test_cuda_comm_stream_reads_what_the_caller_queued_and_waits_for_its_own_work_only():
    """``outer.comm_stream`` on a GPU. The caller's stream is held by a spin kernel, then writes x; a task submitted
    after the write reads x on the side stream: it must see the write (the event). A spin of ~2 s queued on the
    caller's stream after the submit, with an event behind it, must still be running when the task's host wait
    (``.cpu()``) has returned; without a side stream (the control) the task's kernels queue behind the spin and the
    event has passed by then. A bare ``cuda`` device (no index) is taken as the current one."""
    import threading

    from dilocox.distributed.comm import AsyncComm, SideStream

    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)
    cycles = _spin_cycles(2.0)
    go = threading.Event()

    def task():
        go.wait(30)  # (after the caller queued the spin: on the shared stream the task's kernels queue behind it)
        side = torch.cuda.current_stream() != torch.cuda.default_stream()
        return side, x.sum().cpu(), x * 2

    for use_side in (True, False):
        comm = AsyncComm(device=dev, side_stream=SideStream(dev) if use_side else None)
        try:
            go.set()
            comm.submit(task).wait(timeout=60)  # warm-up: the task's kernels loaded, the side stream's pool made
            go.clear()
            x.zero_()
            torch.cuda._sleep(cycles // 8)  # the caller's stream busy, then the write the task must see
            x.fill_(1.0)
            h = comm.submit(task)
            torch.cuda._sleep(cycles)  # queued after the submit: not the task's business
            spun = torch.cuda.Event()
            spun.record()
            go.set()
            on_side, total, doubled = h.wait(timeout=60)
            passed = spun.query()
        finally:
            comm.shutdown(timeout=60)
        torch.cuda.synchronize()
        assert on_side == use_side
        assert total.item() == x.numel(), (use_side, total.item())
        assert torch.equal(doubled, torch.full_like(x, 2.0))
        assert passed == (not use_side), (use_side, passed)  # side: done before the spin; shared: after it


@pytest.mark.cuda
@no_cuda
def test_cuda_comm_stream_keeps_a_result_the_training_still_reads_from_the_next_task():
    """``hand_over``'s ``record_stream``: a result made on the side stream, read by a kernel queued on the caller's
    stream behind a ~2 s spin and then dropped, is not handed to the next task's allocation on the side stream while
    that read may still be pending (without the mark the side stream's pool gives the same block back)."""
    from dilocox.distributed.comm import AsyncComm, SideStream

    dev = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 22
    cycles = _spin_cycles(2.0)
    comm = AsyncComm(device=dev, side_stream=SideStream(dev))
    try:
        (r,) = comm.submit(lambda: [torch.ones(n, device=dev)]).wait(timeout=60)
        torch.cuda._sleep(cycles)
        y = r * 3  # queued behind the spin: reads r later
        ptr = r.data_ptr()
        del r
        ptr2 = comm.submit(lambda: torch.empty(n, device=dev).fill_(7.0).data_ptr()).wait(timeout=60)
    finally:
        comm.shutdown(timeout=60)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((n,), 3.0, device=dev))
    assert ptr2 != ptr


@pytest.mark.cuda
@no_cuda
def test_cuda_preset_trains_the_same_with_the_comm_stream(tmp_path):
    """The `dilocox` preset (a sparse fragment every 2 steps, tau = 1) on one GPU: the comm thread's work on a stream
    of its own trains the losses of the training's stream, as close as two runs without it are to each other."""
    from dilocox.bench.runner import CONFIGS

    config = tmp_path / "preset.yaml"
    tiny, preset = os.path.join(CONFIGS, "tiny.yaml"), os.path.join(CONFIGS, "methods", "dilocox.yaml")
    config.write_text(f"include: [{tiny}, {preset}]\n")
    args = ["--parallel.replicas=1", "--parallel.pipeline=1", "--parallel.microbatches=1", "--train.dtype=fp32"]
    off = _gpu_losses(tmp_path, "off", str(config), *args)
    off2 = _gpu_losses(tmp_path, "off2", str(config), *args)
    on = _gpu_losses(tmp_path, "on", str(config), *args, "--outer.comm_stream=true")
    rel = lambda a, b: max(abs(x - y) / abs(x) for x, y in zip(a, b))  # noqa: E731
    assert rel(off, on) <= max(1e-6, 2 * rel(off, off2)), (rel(off, off2), list(zip(off, on)))


def _gpu_losses(tmp_path, name: str, config: str, *overrides: str, steps: int = 20) -> list[float]:
    from dilocox.bench.runner import run_train

    res = run_train(
        config,
        1,
        str(tmp_path / name),
        ["--train.device=cuda", f"--train.steps={steps}", "--train.eval_every=0", *overrides],
        timeout=600,
    )
    losses = [r["loss"] for r in res["steps"] if "loss" in r]
    assert len(losses) == steps, f"{name}: {len(losses)} loss records for {steps} steps"
    return losses
