"""Compression kernels (csrc/, dilocox.compress.kernels/quant): compiled ops == pure-torch
reference bit for bit, format details, error bounds, error-feedback telescoping.

Reference tests always run; tests of the compiled CPU ops skip when dilocox._C is not
built; CUDA tests skip without a GPU / dilocox._C_cuda (they compare CUDA to the CPU
reference)."""

import itertools
import logging

import pytest
import torch

from dilocox.compress import kernels
from dilocox.compress.quant import Packed, dequantize, dequantize_accumulate, payload_nbytes, quantize

HAVE_CPU_EXT = kernels.have_extension("cpu")
HAVE_CUDA_EXT = torch.cuda.is_available() and kernels.have_extension("cuda")
needs_ext = pytest.mark.skipif(not HAVE_CPU_EXT, reason="dilocox._C not built (pip install --no-build-isolation -e .)")
needs_cuda = pytest.mark.skipif(
    not HAVE_CUDA_EXT, reason="needs a CUDA GPU and the dilocox._C_cuda extension (make test-gpu)"
)

LENGTHS = [1, 2, 3, 127, 128, 129, 255, 1000, 4097]
GROUPS = [6, 32, 64, 128, 130]  # 6, 130: groups with a partial 64-element chunk
KINDS = ["int4", "int8"]
ISAS = kernels.cpu_isas() or [None]  # the CPU kernels' code paths this machine runs (0 baseline, 1 AVX2, 2 AVX-512)


@pytest.fixture(params=ISAS, ids=lambda i: f"isa{i}")
def isa(request):
    """Each test that takes it runs once per CPU code path (the AVX-512 one has its own hand-written int4/int8 body)."""
    if request.param is None:
        yield None
        return
    with kernels.forced_cpu_isa(request.param) as got:
        assert got == request.param
        yield got


def bits_of(t):
    return t.contiguous().view(torch.int32)


def make(n, seed=0, device="cpu", zero_group=True, scale=1e-3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    e = torch.randn(n, generator=g) * scale * 0.1
    if zero_group and n >= 256:  # an all-zero group (x + e == 0) and an outlier
        x[128:192] = 0.0
        e[128:192] = 0.0
        x[200] = 7.5
    return x.to(device), e.to(device)


def run_pair(x, e, kind, G, sr, device_a="cpu", kernel_a=True):
    """(payload, residual) from the dispatched op on device_a and from the CPU reference."""
    ea = None if e is None else e.clone().to(device_a)
    pa = quantize(x.to(device_a), kind, G, error=ea, stochastic=sr, seed=123, step=7, use_kernel=kernel_a)
    eb = None if e is None else e.clone()
    pb = quantize(x.cpu(), kind, G, error=eb, stochastic=sr, seed=123, step=7, use_kernel=False)
    return pa, ea, pb, eb


# ---------------------------------------------------------------- compiled == reference
@needs_ext
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sr", [False, True])
def test_cpu_kernel_bit_exact(kind, sr, isa):
    for n, G, ef in itertools.product(LENGTHS, GROUPS, [False, True]):
        x, e = make(n, seed=n + G)
        pa, ea, pb, eb = run_pair(x, e if ef else None, kind, G, sr)
        assert torch.equal(pa.data, pb.data), (kind, n, G, ef, sr)
        if ef:
            assert torch.equal(bits_of(ea), bits_of(eb)), (kind, n, G, sr)
        for acc in (False, True):
            base = torch.linspace(-1, 1, n)
            da = dequantize_accumulate(pa, base.clone()) if acc else dequantize(pa)
            db = dequantize_accumulate(pb, base.clone(), use_kernel=False) if acc else dequantize(pb, use_kernel=False)
            assert torch.equal(bits_of(da), bits_of(db)), (kind, n, G, ef, sr, acc)


@needs_ext
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_threads_and_large(threads, isa):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, e = make((1 << 17) + 3, seed=3)
        for kind, sr in itertools.product(KINDS, [False, True]):
            pa, ea, pb, eb = run_pair(x, e, kind, 128, sr)
            assert torch.equal(pa.data, pb.data) and torch.equal(bits_of(ea), bits_of(eb)), (kind, sr)
    finally:
        torch.set_num_threads(old)


@needs_ext
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_kernel_bit_exact_at_rounding_ties(kind, isa):
    """Quotients v / s on and up to 3 ulp around every half-integer (scales of 1, 2, 4 and 8 significant bits, one
    near the smallest normal): the codes must round as the reference's rint(fl(v / s)) does (half to even), in full
    128-element groups and in groups with a partial 64-element chunk (130), the last one cut short."""
    L, per = (7 if kind == "int4" else 127), 8
    for G in (128, 130):
        _check_ties(kind, L, G, per)


def _check_ties(kind, L, G, per):
    g = torch.Generator().manual_seed(5)
    scales = torch.tensor([0.0078125, 0.01171875, 0.0859375, 1.3671875, 3.0e-38]).to(torch.bfloat16).float()
    s = scales.repeat_interleave(G).repeat(per)  # each group's scale
    k = torch.randint(-L, L, (s.numel(),), generator=g).float()
    x = (k + 0.5) * s  # exact ties
    steps = torch.randint(-3, 4, (s.numel(),), generator=g)
    for _ in range(3):  # walk each value up to 3 ulp off its tie
        x = torch.where(steps > 0, torch.nextafter(x, torch.tensor(1e30)), x)
        x = torch.where(steps < 0, torch.nextafter(x, torch.tensor(-1e30)), x)
        steps = steps - steps.sign()
    x[::G] = L * s[::G]  # each group's absmax: its scale is s
    x = x[: x.numel() - 37]  # the last group cut short
    for ef in (False, True):
        e = torch.zeros_like(x) if ef else None
        pa, ea, pb, eb = run_pair(x, e, kind, G, False)
        assert torch.equal(pa.data, pb.data), (kind, ef)
        if ef:
            assert torch.equal(bits_of(ea), bits_of(eb)), kind


@needs_ext
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_kernel_at_the_absmax_of_a_rounded_down_scale(kind, isa):
    """Scales that bf16 rounds down by almost half an ulp, so the absmax quotient v / s lands above L (7.027 for
    int4), in every binade from 2^-133 (absmax / L subnormal) to 2^100, and subnormal scales rounded down by a third
    (quotients near 1.49 L): the AVX-512 path skips the clamp where the scale is normal and must still give the
    reference's codes (+-L) and residuals, bit for bit."""
    L = 7 if kind == "int4" else 127
    g = torch.Generator().manual_seed(11)
    groups = []
    near_half = [(1.0 + 2.0**-8 - 2.0**-23, e2) for e2 in list(range(-133, -120)) + [-60, -1, 0, 1, 30, 100]]
    for m, e2 in near_half + [(1.49, -133), (1.49, -132), (1.3, -131)]:
        t = m * 2.0**e2  # m just below the bf16 midpoint: rounds down
        grp = (torch.rand(128, generator=g) * 2 - 1) * (L * t)
        grp[int(torch.randint(0, 128, (1,), generator=g))] = L * t * (1 if e2 % 2 else -1)
        groups.append(grp)
    x = torch.cat(groups).float()
    for ef in (False, True):
        e = torch.zeros_like(x) if ef else None
        pa, ea, pb, eb = run_pair(x, e, kind, 128, False)
        assert torch.equal(pa.data, pb.data), (kind, ef)
        if ef:
            assert torch.equal(bits_of(ea), bits_of(eb)), kind


@needs_ext
def test_cpu_kernel_misaligned_views(isa):
    buf_x, buf_e = make(2003, seed=9)
    x, e = buf_x[1:1001], buf_e.clone()[3:1003]  # odd element offsets
    out = torch.zeros(1 + payload_nbytes("int4", 1000, 64), dtype=torch.uint8)[1:]
    e_ref = e.clone()
    p = quantize(x, "int4", 64, error=e, out=out)
    r = quantize(x, "int4", 64, error=e_ref, use_kernel=False)
    assert torch.equal(p.data, r.data) and torch.equal(bits_of(e), bits_of(e_ref))
    assert p.data.data_ptr() == out.data_ptr()


def test_no_ext_env_forces_reference(monkeypatch):
    monkeypatch.setenv("DILOCOX_NO_EXT", "1")
    assert not kernels.have_extension("cpu")
    x, e = make(300)
    p = quantize(x, "int4", 64, error=e)
    assert p.data.numel() == payload_nbytes("int4", 300, 64)


def test_missing_extension_logs_once(monkeypatch, caplog):
    monkeypatch.delenv("DILOCOX_NO_EXT", raising=False)
    monkeypatch.setattr(kernels, "_EXT_LOADED", {"cpu": False, "cuda": False})
    monkeypatch.setattr(kernels, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="dilocox"):
        for _ in range(3):
            quantize(torch.ones(10), "int4", 8)
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------- format (reference + kernel)
@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_ext)])
def test_nibble_layout_hand_example(use_kernel):
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0])  # absmax 7 -> s = 1 exactly, q = x
    p = quantize(x, "int4", 128, use_kernel=use_kernel)
    # byte0: 7 low, -7 (0x9) high; byte1: 1 low, -1 (0xF) high; byte2: 0, odd tail; bf16(1.0) = 0x3F80 LE
    assert p.data.tolist() == [0x97, 0xF1, 0x00, 0x80, 0x3F]
    assert dequantize(p, use_kernel=use_kernel).tolist() == x.tolist()
    p8 = quantize(torch.tensor([127.0, -1.0, 0.5, -0.5, 2.5]), "int8", 4, use_kernel=use_kernel)
    # G=4: group 0 s=1 -> [127,-1,0,0] (half to even), group 1 = [2.5] s=bf16(2.5/127) -> q=127
    assert p8.data[:5].view(torch.int8).tolist() == [127, -1, 0, 0, 127]


@pytest.mark.parametrize("kind", ["int4", "int8", "fp16", "none"])
def test_payload_nbytes_matches(kind):
    for n, G in itertools.product([0, 1, 5, 128, 129, 1001], [32, 128]):
        p = quantize(torch.randn(n), kind, G)
        assert p.data.numel() == payload_nbytes(kind, n, G)
    assert payload_nbytes("int4", 1024, 128) * 8 / 1024 == 4 + 16 / 128


def test_zero_groups_and_scales():
    x = torch.zeros(300)
    x[130] = 7.0  # s = bf16(7/7) = 1 exactly -> lossless
    e = torch.zeros(300)
    p = quantize(x, "int4", 128, error=e, use_kernel=False)
    scales = p.data[150:].view(torch.int16)
    assert scales[0].item() == 0 and scales[2].item() == 0
    assert torch.equal(dequantize(p), x) and torch.equal(e, torch.zeros(300))


def test_bf16_round_matches_torch_and_hash_matches_python():
    f = torch.rand(10000) * torch.logspace(-30, 30, 10000)
    assert torch.equal(kernels.bf16_round(f), f.to(torch.bfloat16).to(torch.float32))
    # the vectorized int64 splitmix64 == the same hash on python ints
    seed, step = 2**63 + 12345, 99
    base = kernels._mix64_int(kernels._mix64_int(seed) + step)
    u = kernels.sr_uniform(seed, step, 50)
    for i in (0, 1, 17, 49):
        z = kernels._mix64_int((base + (i + 1) * kernels._GOLDEN) & kernels._M64)
        assert u[i].item() == (z >> 40) / 2.0**24


# ---------------------------------------------------------------- numerics
@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_ext)])
@pytest.mark.parametrize("kind", KINDS)
def test_error_bound(kind, use_kernel):
    L = 7 if kind == "int4" else 127
    for G in GROUPS:
        x = torch.randn(4097) * torch.rand(4097) ** 4  # varied magnitudes per group
        d = dequantize(quantize(x, kind, G, use_kernel=use_kernel))
        n = x.numel()
        pad = -n % G
        xg = torch.nn.functional.pad(x, (0, pad)).view(-1, G)
        err = torch.nn.functional.pad((x - d).abs(), (0, pad)).view(-1, G)
        bound = xg.abs().amax(dim=1, keepdim=True) / (2 * L) * (1 + 2.0**-8) + 1e-30
        assert bool((err <= bound).all()), (kind, G)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_ext)])
def test_stochastic_rounding_unbiased(use_kernel):
    x = torch.rand(512) * 2 - 1
    draws = 400
    total = torch.zeros(512, dtype=torch.float64)
    for t in range(draws):
        total += dequantize(quantize(x, "int4", 128, stochastic=True, seed=11, step=t, use_kernel=use_kernel)).double()
    mean_err = (total / draws - x.double()).abs()
    s = 1.0 / 7  # absmax <= 1; per-draw std <= s/2 -> mean std <= s/(2*sqrt(400)) ~ 3.6e-3
    assert mean_err.max().item() < 6 * s / (2 * draws**0.5)
    assert abs((total / draws - x.double()).mean().item()) < 1e-3
    # different steps give different draws, same step reproduces
    a = quantize(x, "int4", 128, stochastic=True, seed=11, step=1, use_kernel=use_kernel).data
    b = quantize(x, "int4", 128, stochastic=True, seed=11, step=2, use_kernel=use_kernel).data
    assert not torch.equal(a, b)
    assert torch.equal(a, quantize(x, "int4", 128, stochastic=True, seed=11, step=1, use_kernel=use_kernel).data)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_ext)])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp16"])
def test_error_feedback_telescopes(kind, use_kernel):
    n, steps = 3001, 50
    g = torch.Generator().manual_seed(1)
    e = torch.zeros(n)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        x = torch.randn(n, generator=g) * 1e-2
        total += x.double()
        sent += dequantize(quantize(x, kind, 128, error=e, use_kernel=use_kernel)).double()
    # e_{t+1} = v_t - deq_t is exact in fp32; only v_t = x_t + e_t rounds (<= 1 ulp per step)
    assert torch.allclose(sent + e.double(), total, rtol=0, atol=steps * 2.0**-24 * 0.1)
    assert (sent - total).abs().max() > 0  # something was actually delayed


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_ext)])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp16", "none"])
def test_nonfinite_raises(kind, use_kernel):
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(1000)
        x[321] = bad
        with pytest.raises(ValueError, match="non-finite value in tensor passed to"):
            quantize(x, kind, 128, use_kernel=use_kernel)
        e = torch.zeros(1000)
        e[5] = bad  # poisoned error buffer
        with pytest.raises(ValueError, match="NaN/inf"):
            quantize(torch.randn(1000), kind, 128, error=e, use_kernel=use_kernel)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_ext)])
@pytest.mark.parametrize("kind", ["int4", "int8", "fp16", "none"])
def test_dequantize_accumulate_adds(kind, use_kernel):
    x = torch.randn(777)
    p = quantize(x, kind, 64, use_kernel=use_kernel)
    out = torch.full((777,), 2.0)
    r = dequantize_accumulate(p, out, use_kernel=use_kernel)
    assert r is out
    assert torch.equal(out, 2.0 + dequantize(p, use_kernel=use_kernel))
    if kind == "none":
        assert torch.equal(dequantize(p), x)
    # a Packed built from a slice of a bigger receive buffer (as the collectives do)
    buf = torch.zeros(3 + p.data.numel(), dtype=torch.uint8)
    buf[3:] = p.data
    q = Packed(kind, 777, 64, buf[3:])
    assert torch.equal(dequantize(q, use_kernel=use_kernel), dequantize(p, use_kernel=use_kernel))


def test_bad_arguments():
    with pytest.raises(ValueError, match="even group_size"):
        quantize(torch.randn(10), "int4", 7)
    with pytest.raises(ValueError, match="unknown quantization kind"):
        quantize(torch.randn(10), "int3")
    with pytest.raises(ValueError, match="float32"):
        quantize(torch.randn(10).double(), "int4")
    with pytest.raises(ValueError, match="stochastic"):
        quantize(torch.randn(10), "fp16", stochastic=True)
    with pytest.raises(ValueError, match="error buffer"):
        quantize(torch.randn(10), "int4", error=torch.zeros(11))


# ---------------------------------------------------------------- CUDA vs CPU reference
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sr", [False, True])
def test_cuda_kernel_matches_cpu_reference(kind, sr):
    for n, G, ef in itertools.product(LENGTHS + [100003], GROUPS + [6, 130], [False, True]):
        x, e = make(n, seed=n + G)
        pa, ea, pb, eb = run_pair(x, e if ef else None, kind, G, sr, device_a="cuda")
        assert torch.equal(pa.data.cpu(), pb.data), (kind, n, G, ef, sr)
        if ef:
            assert torch.equal(bits_of(ea.cpu()), bits_of(eb)), (kind, n, G, sr)
        base = torch.linspace(-1, 1, n)
        da = dequantize_accumulate(pa, base.clone().cuda()).cpu()
        db = dequantize_accumulate(pb, base.clone(), use_kernel=False)
        assert torch.equal(bits_of(da), bits_of(db)), (kind, n, G, ef, sr)
        assert torch.equal(bits_of(dequantize(pa).cpu()), bits_of(dequantize(pb, use_kernel=False)))


@pytest.mark.cuda
@needs_cuda
def test_cuda_misaligned_and_nonfinite():
    bx, be = make(4003, seed=5)
    x, e = bx[1:4001], be.clone()[3:4003]  # misaligned -> scalar (non-float4) path
    ec, er = e.cuda(), e.clone()
    p = quantize(x.cuda(), "int4", 128, error=ec)
    r = quantize(x, "int4", 128, error=er, use_kernel=False)
    assert torch.equal(p.data.cpu(), r.data) and torch.equal(bits_of(ec.cpu()), bits_of(er))
    y = torch.randn(5000, device="cuda")
    y[4444] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf"):
        quantize(y, "int8", 128)
