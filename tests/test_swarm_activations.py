"""SWARM activation codec (dilocox/swarm/activations.py): error bound, sizes, kernel == reference."""

import pytest
import torch

from dilocox.compress import kernels
from dilocox.swarm.activations import KINDS, ActMeta, decode, encode, roundtrip, wire_bytes


def activations(shape, seed=0):
    """Activation-like data: mostly small values, a few large outlier channels, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if shape[-1] > 5:
        x[..., 3] *= 40.0  # an outlier channel (transformer activations have them)
        x[..., 5] = 0.0
    return x


@pytest.mark.parametrize("block", [64, 128, 2048, 1000])
@pytest.mark.parametrize("shape", [(2, 16, 64), (3, 7, 33), (1, 1, 1), (4, 130)])
def test_int8_per_block_error_bound(block, shape):
    x = activations(shape)
    y = roundtrip(x, "int8", block)
    assert y.shape == x.shape and y.dtype == x.dtype
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    n = flat_x.numel()
    for b0 in range(0, n, block):
        xb, yb = flat_x[b0 : b0 + block], flat_y[b0 : b0 + block]
        amax = float(xb.abs().max())
        # s = bf16(amax/127) is within a relative 2^-8 of amax/127: rounding error <= s/2, and where the
        # rounded-down scale clips the absmax, <= amax - 127 s <= amax/256 < the first; + fp32 rounding of s*q
        bound = amax / 127 / 2 * (1 + 2**-8) + amax * 2**-22
        err = float((xb - yb).abs().max())
        assert err <= bound, (b0, err, bound)
    # and the code actually quantizes: some error on a random tensor of more than a handful of values
    if n >= 64:
        assert 0 < float((x - y).abs().max())


def test_int8_error_bound_is_tight_enough_to_fail_a_wrong_block():
    # the bound is per block: measured against the absmax of a too-large block it would hide errors;
    # the quantizer really uses the small blocks (a block of tiny values is reproduced finely)
    x = torch.cat([torch.full((64,), 1e-3), torch.full((64,), 100.0)])
    x[0] = 1.3e-3
    y = roundtrip(x, "int8", 64)
    assert float((x[:64] - y[:64]).abs().max()) <= 1.3e-3 / 254 * (1 + 2**-8)
    y_one_block = roundtrip(x, "int8", 128)
    assert float((x[:64] - y_one_block[:64]).abs().max()) > 1.3e-3 / 254 * 2  # one block: tiny values collapse


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 16, 64), (3, 5, 7), (0, 8)])
def test_wire_bytes_equals_the_payload(kind, shape):
    x = activations(shape) if 0 not in shape else torch.zeros(shape)
    payload, meta = encode(x, kind, 128)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == wire_bytes(x.numel(), kind, 128)
    assert meta == ActMeta(kind, tuple(shape), "float32", 128)
    assert ActMeta.from_dict(meta.to_dict()) == meta
    n = x.numel()
    per = {"none": 4 * n, "fp16": 2 * n, "int8": n + 2 * -(-n // 128), "int4": -(-n // 2) + 2 * -(-n // 128)}[kind]
    assert payload.numel() == per


def test_none_is_exact_and_fp16_is_a_cast():
    x = activations((4, 8, 32))
    assert torch.equal(roundtrip(x, "none"), x)
    assert torch.equal(roundtrip(x, "fp16"), x.half().float())
    xb = x.to(torch.bfloat16)
    yb = roundtrip(xb, "int8", 64)
    assert yb.dtype == torch.bfloat16 and yb.shape == xb.shape  # the sender's dtype comes back


@pytest.mark.parametrize("block", [64, 2048, 77])
def test_kernel_equals_reference(block):
    if not kernels.have_extension("cpu"):
        pytest.skip("compiled kernels not built (make install)")
    x = activations((3, 50, 96), seed=block)
    pk, mk = encode(x, "int8", block, use_kernel=True)
    pr, mr = encode(x, "int8", block, use_kernel=False)
    assert mk == mr
    assert torch.equal(pk, pr)  # bit for bit: values and bf16 scales
    assert torch.equal(decode(pk, mk, use_kernel=True), decode(pr, mr, use_kernel=False))


def test_bad_input_gives_clear_errors():
    x = activations((2, 4, 8))
    with pytest.raises(ValueError, match="not one of"):
        encode(x, "int2")
    with pytest.raises(ValueError, match="block"):
        encode(x, "int8", 0)
    with pytest.raises(ValueError, match="floating-point"):
        encode(torch.ones(3, dtype=torch.int64), "int8")
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="activation codec int8: cannot encode tensor of shape"):
        encode(bad, "int8")
    with pytest.raises(ValueError, match="fp16 range"):
        encode(torch.full((4,), 1e6), "fp16")
    payload, meta = encode(x, "int8", 16)
    with pytest.raises(ValueError, match="truncated or mismatched"):
        decode(payload[:-1], meta)
