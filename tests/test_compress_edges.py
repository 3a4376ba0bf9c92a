"""Edge cases of the outer codecs (compress/): block sizes, empty tensors and config switches the main tests miss."""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.compress.cocktail import CocktailCodec
from dilocox.compress.compressor import build_compressor
from dilocox.compress.sign import SignCodec, reference_decode, reference_encode
from dilocox.config import CompressConfig, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sign_reference(ms: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """One member's decoded message per tensor, value by value (``reference_encode``/``reference_decode``)."""
    out = []
    for m in ms:
        flat = m.reshape(-1).tolist()
        out.append(torch.tensor(reference_decode(reference_encode(flat, block), len(flat), block), dtype=torch.float32))
    return out


@pytest.mark.parametrize("block", [8, 16, 24, 40])
def test_sign_codec_block_not_a_multiple_of_32(block):
    """A block of 8·j values has a message of 4 + j bytes per block: a later tensor's fp32 scales then start at an
    offset not divisible by 4 in the shard's message. The config accepts any multiple of 8."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--compress.sign.enabled=true"])
    cfg.compress.sign.block = block
    shapes = [torch.Size([7]), torch.Size([5, 3]), torch.Size([300]), torch.Size([1])]
    codec = build_compressor(cfg.compress, shapes, seed=0)
    g = torch.Generator().manual_seed(block)
    errors = [torch.zeros(s.numel()) for s in shapes]
    for step in range(2):
        ts = [torch.randn(s, generator=g) for s in shapes]
        out = codec.allreduce_mean(ts, None, step)
        ms = [t.reshape(-1) + e for t, e in zip(ts, errors)]
        want = _sign_reference(ms, block)
        errors = [m - w for m, w in zip(ms, want)]
        for o, w, s in zip(out, want, shapes):
            assert o.shape == s and torch.equal(o.reshape(-1), w)


def test_sign_codec_empty_tensor():
    shapes = [torch.Size([0]), torch.Size([9]), torch.Size([0, 4])]
    codec = SignCodec(shapes, 8)
    ts = [torch.randn(s) for s in shapes]
    out = codec.allreduce_mean(ts, None, 0)
    assert [o.shape for o in out] == shapes
    assert torch.equal(out[1], _sign_reference([ts[1]], 8)[0])
    assert codec.payload_bytes() == 2 * (4 + 1)
    sd = codec.state_dict()
    again = SignCodec(shapes, 8)
    again.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(again.errors, codec.errors))


def test_cocktail_honours_error_feedback_off():
    """compress.error_feedback=false (accepted with outer.method=cocktailsgd) must drop what is not sent, not keep it
    in an error buffer that is added to the next step's gradient."""
    cfg = CompressConfig(quant="int4", group_size=8, error_feedback=False)
    codec = CocktailCodec(cfg, [64, 30], seed=0)
    g = torch.Generator().manual_seed(0)
    codec.allreduce_mean([torch.randn(64, generator=g), torch.randn(30, generator=g)], None, 0)
    assert float(codec.error.abs().max()) == 0.0
    out = codec.allreduce_mean([torch.zeros(64), torch.zeros(30)], None, 1)
    assert all(float(o.abs().max()) == 0.0 for o in out)  # nothing carried over from step 0

    on = CocktailCodec(CompressConfig(quant="int4", group_size=8, error_feedback=True), [64, 30], seed=0)
    on.allreduce_mean([torch.randn(64, generator=g), torch.randn(30, generator=g)], None, 0)
    assert float(on.error.abs().max()) > 0.0  # (the default keeps its error feedback)


class _ForgingWire:
    """Two members: this one, and one that sends this member's payload after ``forge`` changed it."""

    def __init__(self, forge) -> None:
        self.forge = forge

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0

    def all_gather(self, out, t) -> None:
        out[0].copy_(t)
        out[1].copy_(self.forge(t.clone()))


@pytest.mark.parametrize("topk", [0.01, 0.5])  # (int32 positions; a bitmap)
def test_cocktail_refuses_a_members_positions_outside_the_survivors(topk):
    """Found by a review of what crosses the network: another member's int32 positions were used as sent, and a
    negative one indexed the mask from its end without a word (a wrong mean); a bitmap with another count of bits
    set. Now both are refused; an unchanged payload from the same fake wire is the control."""
    from dilocox.compress.cocktail import cocktail_allreduce, index_encoding, mask_count, topk_count

    cfg, n = CompressConfig(quant="int8", group_size=8, random_fraction=0.5, topk_fraction=topk), 4096
    K = mask_count(n, 0.5)
    enc, idx_bytes = index_encoding(K, topk_count(K, topk))
    assert enc == ("int32" if topk < 0.1 else "bitmap")
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    same = cocktail_allreduce(g, _ForgingWire(lambda t: t), None, cfg, step=0)
    assert torch.equal(same, cocktail_allreduce(g, None, None, cfg, step=0))  # (the control: the mean of two alike)

    def forged(value):
        def forge(t):
            if enc == "int32":
                t[:idx_bytes].view(torch.int32)[0] = value
            else:
                t[0] ^= 1  # (one position more or less)
            return t

        return forge

    for value in (-1, K):
        with pytest.raises(ValueError, match="cocktail payload"):
            cocktail_allreduce(g, _ForgingWire(forged(value)), None, cfg, step=0)
