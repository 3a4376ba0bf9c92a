"""compress.sparse (dilocox/compress/sparse.py): the vectorised encoder/decoder against the plain-loop reference
beside it, the byte format, error feedback, and the config's refusals. The outer-level oracle test is
tests/test_outer.py::test_sparse_topk_matches_reference_and_counts_its_bytes."""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.compress import kernels
from dilocox.compress.sparse import (
    SparseCompressor,
    decode_accumulate,
    encode,
    layout,
    tensor_payload_bytes,
)
from dilocox.compress.sparse_ref import reference_decode, reference_encode
from dilocox.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs():
    g = torch.Generator().manual_seed(3)
    yield "randn", torch.randn(1000, generator=g), 64, 0.05, 2
    yield "short tensor", torch.randn(37, generator=g), 64, 0.1, 4
    yield "partial last chunk", torch.randn(4096 * 2 + 5, generator=g), 4096, 1 / 64, 2
    yield "ties", torch.randn(300, generator=g).round(), 7, 0.3, 4
    yield "all kept", torch.randn(200, generator=g), 16, 1.0, 8
    yield "zeros", torch.zeros(130), 64, 0.1, 2  # every scale 0: decodes to zeros
    yield "one element", torch.tensor([-3.25]), 4096, 0.01, 2
    yield "matrix", torch.randn(24, 40, generator=g) * 1e-3, 128, 0.02, 2


@pytest.mark.parametrize("indices", ["rice", "fixed"])
@pytest.mark.parametrize("case", list(_inputs()), ids=lambda c: c[0])
def test_encode_and_decode_equal_the_reference(case, indices):
    _, e, chunk, density, bits = case
    got = encode(e, chunk, density, bits, indices=indices)
    assert torch.equal(got, reference_encode(e, chunk, density, bits, indices))
    assert torch.equal(encode(e, chunk, density, bits, False, indices), got)  # torch ops == kernel (if built)
    assert got.numel() == tensor_payload_bytes(e.numel(), chunk, density, bits, indices)
    out = torch.zeros(e.numel())
    decode_accumulate(got, out, chunk, density, bits, indices)
    assert torch.equal(out, reference_decode(got, e.numel(), chunk, density, bits, indices))
    c, k, n_c = layout(e.numel(), chunk, density)
    assert int((out != 0).sum()) <= k * n_c
    if e.abs().sum() == 0:
        assert not out.any()


def _hard_inputs(n, g):
    """Chunks the kernel's candidate floor must not get wrong: Gaussian, ties, a heavy tail (one value 1e30 times
    the rest per 4096, so the floor's ladder walks down many rungs), mostly zeros (fewer non-zeros than k in some
    chunks), subnormals beside normals, and one constant."""
    yield torch.randn(n, generator=g)
    yield (torch.randn(n, generator=g) * 3).round()
    heavy = torch.randn(n, generator=g) * 1e-20
    heavy[::4096] = 1e10
    yield heavy
    sparse = torch.zeros(n)
    sparse[torch.randint(0, n, (n // 500,), generator=g)] = torch.randn(n // 500, generator=g)
    yield sparse
    tiny = torch.randn(n, generator=g) * 1e-39  # subnormal
    yield torch.where(torch.rand(n, generator=g) < 0.5, tiny, torch.randn(n, generator=g))
    yield torch.full((n,), -0.75)


@pytest.mark.skipif(not kernels.have_extension("cpu"), reason="the compiled extension is not built (CI builds it)")
@pytest.mark.parametrize("isa", kernels.cpu_isas() or [None], ids=lambda i: f"isa{i}")
def test_the_compiled_kernel_equals_the_torch_ops_on_large_random_tensors(isa):
    """csrc/sparse_cpu.cpp against the vectorised torch encoder (itself equal to the loops above), on sizes
    where every chunk runs in parallel, on the hard inputs above and every bit width, on each CPU code path."""
    g = torch.Generator().manual_seed(9)
    with kernels.forced_cpu_isa(-1 if isa is None else isa):
        for n, chunk, density, bits in [(300_001, 4096, 1 / 64, 2), (100_000, 1000, 0.05, 4), (50_000, 333, 0.2, 8)]:
            for i, e in enumerate(_hard_inputs(n, g)):
                for ix in ("rice", "fixed"):  # (the kernel writes the Rice codes itself, rice_b)
                    a = encode(e, chunk, density, bits, indices=ix)
                    b = encode(e, chunk, density, bits, use_kernel=False, indices=ix)
                    assert torch.equal(a, b), (n, chunk, bits, i, ix, int((a != b).sum()))


def test_the_kept_entries_are_the_largest_and_the_levels_are_nearest():
    e = torch.tensor([0.1, -4.0, 0.2, 3.0, -0.05, 1.0, 0.0, -2.0])  # one chunk of 8, keep 4, 2 bits
    out = torch.zeros(8)
    decode_accumulate(encode(e, 8, 0.5, 2), out, 8, 0.5, 2)
    assert out.nonzero().flatten().tolist() == [1, 3, 5, 7]  # |-4|, |3|, |-2|, |1|
    s = float(torch.tensor(4.0 / 1.5).to(torch.bfloat16).float())  # levels ±0.5s, ±1.5s
    assert out[[1, 3, 5, 7]].tolist() == pytest.approx([-1.5 * s, 1.5 * s, 0.5 * s, -0.5 * s])


def test_error_feedback_keeps_what_was_not_sent():
    """One rank: after each sync e = β e + Δ − sent, so with β = 1 the sum of what was sent plus e is the sum
    of the Δs exactly (nothing is lost, only delayed); with β < 1 old residue decays."""
    shapes = [torch.Size([16, 16]), torch.Size([16])]
    comp = SparseCompressor(shapes, chunk=64, density=0.1, bits=2, ef_decay=1.0)
    g = torch.Generator().manual_seed(0)
    total = [torch.zeros(s) for s in shapes]
    sent = [torch.zeros(s) for s in shapes]
    for step in range(5):
        ds = [torch.randn(s, generator=g) for s in shapes]
        out = comp.allreduce_mean(ds, None, step)
        for t, x, d, o in zip(total, sent, ds, out):
            t += d
            x += o
    for t, x, e in zip(total, sent, comp.errors):
        torch.testing.assert_close(x + e, t, rtol=0, atol=1e-5)
    sd = comp.state_dict()
    again = SparseCompressor(shapes, chunk=64, density=0.1, bits=2, ef_decay=1.0)
    again.load_state_dict(sd)
    d = [torch.randn(s, generator=g) for s in shapes]
    a, b = comp.allreduce_mean(d, None, 9), again.allreduce_mean(d, None, 9)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # exact resume of the error buffers
    with pytest.raises(ValueError, match="NaN/inf"):
        comp.allreduce_mean([torch.full((16, 16), float("nan")), torch.zeros(16)], None, 10)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpu-kernel", "batched-torch"])
def test_the_batched_compressor_equals_the_rule_tensor_by_tensor(use_kernel):
    """The compressor encodes and decodes the chunks of all its tensors together (group matrices by chunk size,
    row blocks; the GPU path), which must give the bits of the rule applied tensor by tensor with ``encode`` and
    ``decode_accumulate``: the mean, the error buffers and the payload, over several syncs, for tensors with and
    without a padded last chunk (65 elements: the padding is kept and decodes to s/2, which must not leak into
    e), shorter than a chunk (two of the same length: one group), empty, and blocks that split the groups."""
    shapes = [torch.Size(s) for s in [(100, 70), (65,), (30,), (0,), (5, 64), (30,), (3, 11)]]
    chunk, density, bits, beta = 64, 0.1, 2, 0.9
    comp = SparseCompressor(shapes, chunk, density, bits, ef_decay=beta)
    comp.use_kernel, comp.block_elems = use_kernel, 3 * chunk
    errors = [torch.zeros(s) for s in shapes]
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        ds = [torch.randn(s, generator=g) * (1e-3 if i % 2 else 1.0) for i, s in enumerate(shapes)]
        if step == 2:
            ds[1][:-1] = 0  # a chunk with fewer nonzeros than k
        want = []
        for e, d in zip(errors, ds):
            e.mul_(beta).add_(d)
            p = encode(e, chunk, density, bits, use_kernel=False)
            out, sent = torch.zeros(e.numel()), torch.zeros(e.numel())
            decode_accumulate(p, out, chunk, density, bits)
            decode_accumulate(p, sent, chunk, density, bits)
            e.sub_(sent.view(e.shape))
            want.append(out.view(e.shape))
        got = comp.allreduce_mean(ds, None, step)
        for i, (w, x, e, ce) in enumerate(zip(want, got, errors, comp.errors)):
            assert torch.equal(w.view(torch.int32), x.view(torch.int32)), (step, i)
            assert torch.equal(e.view(torch.int32), ce.view(torch.int32)), (step, i)
        assert all(bool((pad == 0).all()) for pad in comp._groups.pads(comp._err))
    one_by_one = torch.cat([encode(e, chunk, density, bits) for e in errors])
    assert torch.equal(comp._groups.encode(comp._err, 100), one_by_one)


@pytest.mark.parametrize("indices", ["rice", "fixed"])
def test_the_torch_encoder_has_no_data_dependent_shape(indices):
    """The GPU path of the codec (the torch encoder and decoder of rows) must not wait for the device: every output
    shape follows from the input's, which the meta device checks (it has no data, so an op whose output size
    depends on the values, like ``nonzero``, cannot run there). ``nonzero`` in the top-k selection was such a host
    sync once per row block on a GPU; ``nonzero_static`` (k per row is known) gives the same indices."""
    from dilocox.compress.sparse import _decode_rows, _encode_rows, _topk_indices

    rows, c, k = 16, 256, 4
    ib, cb, sb = _encode_rows(torch.empty(rows, c, device="meta"), k, 2, indices)
    idx, vals = _decode_rows(ib, cb, sb.contiguous(), k, c, 2, indices)
    assert idx.shape == vals.shape == (rows, k) and ib.shape[0] == cb.shape[0] == sb.shape[0] == rows
    mag = torch.rand(rows, c, generator=torch.Generator().manual_seed(0))
    mag[3, :] = 0.5  # a row of ties: the lowest indices
    mag[5, 10:20] = 2.0  # ties above the rest: the k lowest of them
    want = [sorted(sorted(range(c), key=lambda j: (-float(row[j]), j))[:k]) for row in mag]
    assert _topk_indices(mag, k).tolist() == want
    mag[7, [2, 9]] = float("nan")  # counted as +inf: chosen first, and still k in-row indices per row
    mag[8, 100] = float("inf")
    want[7] = sorted(
        [2, 9] + sorted((j for j in range(c) if j not in (2, 9)), key=lambda j: (-float(mag[7, j]), j))[:2]
    )
    want[8] = sorted([100] + sorted((j for j in range(c) if j != 100), key=lambda j: (-float(mag[8, j]), j))[:3])
    assert _topk_indices(mag, k).tolist() == want


def test_one_host_sync_per_all_reduce():
    """``allreduce_mean`` reads both of its checks (the pseudo-gradient finite, the error buffer finite) with one
    host sync (the torch path, as on a GPU; each sync there waits for the training's queued kernels), and a NaN is
    still refused before anything is sent."""
    from dilocox.bench.reference_loop import SyncCounter

    shapes = [torch.Size(s) for s in [(100, 70), (65,), (0,), (30,)]]
    comp = SparseCompressor(shapes, chunk=64, density=0.1, bits=2, ef_decay=0.9)
    comp.use_kernel = False
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        with SyncCounter() as counter:
            comp.allreduce_mean([torch.randn(s, generator=g) for s in shapes], None, step)
        assert counter.count == 1, counter.calls
    bad = [torch.randn(s, generator=g) for s in shapes]
    bad[1][7] = float("inf")
    with pytest.raises(ValueError, match="NaN/inf entries: the inner steps diverged"):
        comp.allreduce_mean(bad, None, 2)
    comp.errors = [torch.full(s, 3e38) for s in shapes]  # (entries finite, their L1 norm past the fp32 limit)
    with pytest.raises(ValueError, match="error-feedback buffer overflowed"):
        comp.allreduce_mean([torch.randn(s, generator=g) for s in shapes], None, 3)


def test_payload_is_far_below_fp32_at_the_preset():
    n = 4096 * 256
    assert tensor_payload_bytes(n, 4096, 1 / 64, 2, "fixed") == 256 * (96 + 16 + 2)  # 12-bit indices, 2-bit codes
    assert tensor_payload_bytes(n, 4096, 1 / 64, 2) == 256 * (64 + 16 + 2)  # Rice: 64 codes of b = 5 in <= 510 bits
    assert 4 * n / tensor_payload_bytes(n, 4096, 1 / 64, 2) > 199


@pytest.mark.parametrize(
    "overrides,msg",
    [
        (["--compress.sparse.enabled=true", "--compress.sparse.bits=3"], "compress.sparse.bits"),
        (["--compress.sparse.enabled=true", "--compress.sparse.density=0"], "compress.sparse.density"),
        (["--compress.sparse.enabled=true", "--compress.quant=int4"], "set compress.quant=none"),
        (["--compress.sparse.enabled=true", "--compress.sparse.ef_decay=1.5"], "compress.sparse.ef_decay"),
        (["--compress.sparse.enabled=true", "--compress.error_feedback=false"], "compress.error_feedback"),
        (["--compress.sign.enabled=true", "--compress.collective=reduce_scatter"], "compress.collective"),
        (["--compress.sparse.enabled=true", "--outer.method=cocktailsgd"], "not outer.method='cocktailsgd'"),
    ],
)
def test_config_refusals_name_the_field(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--outer.method=diloco", *overrides])


def test_the_preset_loads():
    cfg = load_config(os.path.join(ROOT, "configs", "methods", "sparseloco.yaml"))
    assert cfg.compress.sparse.enabled and cfg.outer.method == "diloco" and cfg.outer.momentum == 0.0


@pytest.mark.skipif(not kernels.have_extension("cpu"), reason="the compiled extension is not built (CI builds it)")
def test_the_compiled_kernel_ends_on_an_inf():
    """The callers refuse NaN/inf before encoding; the kernel must still end (its candidate floor once looped
    forever on an inf with fewer than k ties) and write a payload of the right size."""
    e = torch.randn(8192)
    e[5] = float("inf")
    out = encode(e, 4096, 1 / 64, 2)
    assert out.numel() == tensor_payload_bytes(8192, 4096, 1 / 64, 2)
