"""Rice-coded indices of the sparse codec (``compress/rice.py``, ``compress.sparse.indices``): the vectorised codes
against plain loops, the fixed-size bound whatever the indices, never larger than the fixed width, and lossless (the
compressor's results bit-identical to the fixed-width format's, with fewer bytes)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from dilocox.compress import kernels, rice
from dilocox.compress.sparse import SparseCompressor, decode_accumulate, encode, tensor_payload_bytes
from dilocox.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(c: int, k: int, rng: random.Random) -> list[list[int]]:
    """Index sets of one chunk: random, packed at either end (the largest first gap: the bound's worst case),
    every other entry, and one gap as large as it can be."""
    out = [sorted(rng.sample(range(c), k)) for _ in range(3)]
    out += [list(range(k)), list(range(c - k, c)), list(range(0, c, c // k))[:k], list(range(k - 1)) + [c - 1]]
    return out


@pytest.mark.parametrize("c", [2, 3, 10, 64, 100, 1000, 4096])
def test_pack_and_unpack_equal_the_loops_and_round_trip(c):
    rng = random.Random(c)
    for k in sorted({1, 2, max(1, c // 128), max(1, c // 64), max(1, c // 8), c // 2 or 1, c - 1 or 1, c}):
        rows = _rows(c, k, rng)
        got = rice.pack(torch.tensor(rows), c)  # (the compiled kernel where built)
        assert got.shape == (len(rows), -(-rice.rice_row_bits(c, k) // 8))
        assert got.tolist() == [rice.reference_pack(r, c) for r in rows], (c, k)  # (the loops assert the bound)
        assert torch.equal(rice.pack_torch(torch.tensor(rows), c), got), (c, k)
        assert rice.unpack(got, k, c).tolist() == rows, (c, k)
        assert rice.unpack_torch(got, k, c).tolist() == rows, (c, k)
        assert [rice.reference_unpack(x, k, c) for x in got.tolist()] == rows, (c, k)


def test_the_bound_is_tight_and_rice_is_never_larger_than_fixed():
    """The worst case (all k at the chunk's end: one gap of C - k) fills the bound to the bit; ``rice`` falls back
    to the fixed width wherever the bound is not smaller, so it never costs a byte more."""
    for c in (64, 100, 4096):
        for k in (1, 3, c // 64 or 1, c // 2):
            b = rice.param(c, k)
            used = ((c - k) >> b) + k * (b + 1)  # the first code carries every quotient, the others none
            assert used == rice.rice_row_bits(c, k)
    for c in range(2, 260):
        for k in range(1, c + 1):
            assert rice.row_bytes(c, k, "rice") <= rice.row_bytes(c, k, "fixed"), (c, k)
    assert rice.row_bytes(4096, 32, "rice") == 36 and rice.row_bytes(4096, 32, "fixed") == 48  # the preset's 1/128


def test_a_damaged_row_never_reads_outside_it():
    """Bytes from the network are not trusted: any row decodes without an out-of-range read (the indices it yields
    may lie outside the chunk, which the decoder's scatter refuses)."""
    g = torch.Generator().manual_seed(0)
    for c, k in ((4096, 32), (64, 8), (1000, 3)):
        raw = torch.randint(0, 256, (50, rice.row_bytes(c, k, "rice")), dtype=torch.uint8, generator=g)
        raw[0] = 255  # all ones: no terminating zero anywhere
        assert rice.unpack(raw, k, c).shape == (50, k)
    with pytest.raises(RuntimeError):
        decode_accumulate(torch.full((tensor_payload_bytes(4096, 4096, 1 / 128, 2),), 255, dtype=torch.uint8),
                          torch.zeros(4096), 4096, 1 / 128, 2)  # fmt: skip


def test_the_compressor_is_lossless_with_fewer_bytes():
    """Rice and fixed-width indices give the same mean and error buffers, sync after sync, bit for bit (the kernel
    path and the torch path); the payload shrinks by the index bytes saved: 46 against 58 bytes per 4,096-chunk at
    the `dilocox` preset's top 1/128 with 2-bit values."""
    shapes = [torch.Size(s) for s in [(4096 * 3 + 17,), (64, 96), (5,), (0,)]]
    g = torch.Generator().manual_seed(1)
    deltas = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    runs = {}
    for indices in ("rice", "fixed"):
        for use_kernel in (True, False):
            comp = SparseCompressor(shapes, 4096, 1 / 128, 2, 0.95, indices=indices)
            comp.use_kernel = use_kernel
            outs = [comp.allreduce_mean(d, None, i) for i, d in enumerate(deltas)]
            runs[(indices, use_kernel)] = (outs, [e.clone() for e in comp.errors], comp.payload_bytes())
    ref_out, ref_err, _ = runs[("fixed", False)]
    for key, (outs, errs, _) in runs.items():
        assert all(torch.equal(a, b) for o, r in zip(outs, ref_out) for a, b in zip(o, r)), key
        assert all(torch.equal(a, b) for a, b in zip(errs, ref_err)), key
    fixed_b, rice_b = runs[("fixed", False)][2], runs[("rice", False)][2]
    assert fixed_b - rice_b == 6 * (48 - 36)  # 4 + 2 chunks of 4,096 save 12 bytes each; the 5-element one none
    assert rice_b == sum(encode(torch.randn(s), 4096, 1 / 128, 2).numel() for s in shapes)


def test_the_preset_runs_rice_and_a_wrong_value_names_the_field():
    cfg = load_config(os.path.join(ROOT, "configs", "methods", "dilocox.yaml"))
    assert cfg.compress.sparse.indices == "rice"
    with pytest.raises(ConfigError, match="compress.sparse.indices"):
        load_config(os.path.join(ROOT, "configs", "methods", "dilocox.yaml"), ["--compress.sparse.indices=zip"])
    with pytest.raises(ValueError, match="compress.sparse.indices"):
        SparseCompressor([torch.Size([8])], 4, 0.5, 2, 0.9, indices="zip")


def test_a_damaged_row_decodes_as_the_loops_do_ascending():
    """Past a damaged row's end the vectorised decoder reads zeros as the loops do: the same indices, strictly
    ascending and never negative (no repeated index for a scatter to race on), only possibly past the chunk."""
    rng = random.Random(2)
    for c, k in ((2, 2), (5, 1), (64, 8), (100, 3), (4096, 32), (4096, 4096)):
        nb = rice.row_bytes(c, k, "rice")
        rows = [[rng.randrange(256) for _ in range(nb)] for _ in range(30)] + [[255] * nb]
        got = rice.unpack(torch.tensor(rows, dtype=torch.uint8), k, c).tolist()
        assert got == [rice.reference_unpack(r, k, c) for r in rows], (c, k)
        assert rice.unpack_torch(torch.tensor(rows, dtype=torch.uint8), k, c).tolist() == got, (c, k)
        assert all(r[0] >= 0 and all(a < b for a, b in zip(r, r[1:])) for r in got), (c, k)
        assert rice.unpack(torch.zeros(0, nb, dtype=torch.uint8), k, c).shape == (0, k)
        assert rice.pack(torch.zeros(0, k, dtype=torch.int64), c).shape == (0, nb)


@pytest.mark.skipif(not kernels.have_extension("cpu"), reason="the compiled extension is not built (CI builds it)")
def test_the_kernel_is_used_and_refuses_what_is_not_an_index_set():
    """On CPU the codes come from csrc/rice_cpu.cpp; indices that do not ascend or leave the chunk are refused
    there (the top-k never makes them; nothing is written past a row)."""
    assert rice._kernel_here(torch.zeros(1))
    with pytest.raises(RuntimeError, match="ascending"):
        rice.pack(torch.tensor([[5, 3]]), 64)
    with pytest.raises(RuntimeError, match="ascending"):
        rice.pack(torch.tensor([[1, 64]]), 64)


@pytest.mark.parametrize("indices", ["rice", "fixed"])
def test_the_loops_refuse_an_index_outside_its_chunk(indices):
    """A damaged first index of chunk 0 (C = 1000: 1023, or a Rice row of ones) must not land in chunk 1:
    ``decode_accumulate`` and the loops both refuse it."""
    from dilocox.compress.sparse_ref import reference_decode

    assert rice.use_rice(1000, 8, "rice")
    payload = encode(torch.zeros(3000), 1000, 0.008, 8, indices=indices).clone()
    payload[:9] = torch.tensor([255] * 9 if indices == "rice" else [255, 3] + [0] * 7, dtype=torch.uint8)
    with pytest.raises(RuntimeError):
        decode_accumulate(payload, torch.zeros(3000), 1000, 0.008, 8, indices)
    with pytest.raises(ValueError, match="outside the chunk"):
        reference_decode(payload, 3000, 1000, 0.008, 8, indices)


def test_the_torch_decoder_takes_as_many_kernels_at_any_k():
    """The torch decoder (the GPU's) finds where a row's codes start by pointer doubling, not code by code: the ops
    it dispatches stay about the same from k = 4 to k = 1,024 (a walk code by code took ~9 per code: ~9,000 at
    1,024, each a kernel launch on a GPU), and it decodes every row."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    g, c, ops = torch.Generator().manual_seed(3), 4096, {}
    for k in (4, 32, 256, 1024):
        idx = torch.stack([torch.randperm(c, generator=g)[:k].sort().values for _ in range(5)])
        raw = rice.pack(idx, c)
        Count.n = 0
        with Count():
            got = rice.unpack_torch(raw, k, c)
        assert torch.equal(got, idx), k
        ops[k] = Count.n
    assert max(ops.values()) < 150 and ops[1024] <= ops[4] + 10, ops
