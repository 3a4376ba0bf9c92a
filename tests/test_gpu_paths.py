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
