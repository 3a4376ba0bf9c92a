"""Edge cases of the adaptive controller and the codecs it drives (compress/adaptive.py, lowrank.py, compressor.py).

Each test reproduces a bug found in review: it failed before the fix named in its docstring."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from dilocox.compress.adaptive import AdaptiveController
from dilocox.compress.cocktail import CocktailCodec
from dilocox.compress.compressor import Compressor
from dilocox.compress.lowrank import PowerSGD, factorable


def test_small_min_compression_never_factors_at_a_rank_above_the_matrix():
    """min_compression < 0.5 let ``factorable`` accept r >= min(n, m): QR gave P̂ n×n, the Q segment had n·m values
    for r·m slots and the sync crashed (split_with_sizes). Fix: lowrank.factorable requires r < min(n, m)."""
    shape = torch.Size([8, 64])
    assert not factorable(shape, 10, 0.1) and not factorable(shape, 8, 0.1) and factorable(shape, 7, 0.1)
    c = Compressor([shape], quant="none", lowrank_rank=10, min_compression=0.1)
    x = torch.randn(shape)
    out = c.allreduce_mean([x], None, 0)
    assert torch.equal(out[0], x)  # not factored at r = 10: the exact fp32 mean of one member
    assert c.max_rank() == 7  # the largest rank still factored
    c.set_rank(c.max_rank())
    assert c.lowrank.factored == [0] and c.allreduce_mean([x], None, 1)[0].shape == shape


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_min_compression_must_be_a_finite_positive_number(bad):
    """compress.lowrank.min_compression=0 crashed with ZeroDivisionError; a negative (or inf) value silently factored
    nothing (low-rank on, doing nothing). Fix: PowerSGD.__init__ refuses it, naming the field."""
    with pytest.raises(ValueError, match="min_compression"):
        PowerSGD([torch.Size([64, 64])], 4, min_compression=bad)


def test_max_rank_and_the_controller_with_an_empty_matrix():
    """A (0, 0) tensor in the shard made ``max_rank`` (the controller's rank_cap) divide by n + m = 0. Fix:
    PowerSGD.max_rank skips empty matrices."""
    shapes = [torch.Size([0, 0]), torch.Size([64, 48])]
    c = Compressor(shapes, quant="int4", group_size=32, lowrank_rank=4, tail_sketch=True)
    assert c.max_rank() == Compressor(shapes[1:], lowrank_rank=4).max_rank() > 0
    c.allreduce_mean([torch.zeros(0, 0), torch.randn(64, 48)], None, 0)
    ctl = AdaptiveController(rank_min=1, rank_max=64, h_min=1, h_max=10)
    rank, h = ctl.update(c.sigmas(), 0.1, c.payload_bytes(), c.payload_bytes, 0.01, c.tail_energy(), c.max_rank())
    assert 1 <= rank <= c.max_rank() and 1 <= h <= 10


def test_cocktail_refuses_an_odd_int4_group_at_construction():
    """outer.method=cocktailsgd with compress.quant=int4 and an odd compress.group_size passed the config checks and
    crashed on the comm thread at the first training step. Fix: CocktailCodec.__init__ checks quant and group_size."""
    cfg = SimpleNamespace(quant="int4", group_size=3, random_fraction=0.5, topk_fraction=0.5, error_feedback=True)
    with pytest.raises(ValueError, match="group_size"):
        CocktailCodec(cfg, [16, 4], seed=0)
    cfg.group_size = 4
    out = CocktailCodec(cfg, [16, 4], seed=0).allreduce_mean([torch.randn(16), torch.randn(2, 2)], None, 0)
    assert [tuple(o.shape) for o in out] == [(16,), (2, 2)]


@pytest.mark.parametrize(
    "override,field",
    [
        ("--compress.adaptive.rank_min=0", "compress.adaptive.rank_min"),
        ("--compress.adaptive.h_min=0", "compress.adaptive.h_min"),
        ("--compress.lowrank.min_compression=0", "compress.lowrank.min_compression"),
        ("--compress.lowrank.min_compression=inf", "compress.lowrank.min_compression"),
        ("--compress.group_size=3", "compress.group_size"),
    ],
)
def test_the_config_refuses_what_would_fail_or_do_nothing_later(override, field):
    """Refused at load, naming the field (they passed the checks and failed at the first sync, or did nothing)."""
    from dilocox.config import ConfigError, load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(os.path.join(root, "configs", "tiny-dilocox-paper.yaml"), [override])


def test_cocktail_refuses_an_error_buffer_of_another_shape():
    """A checkpoint's error buffer of the wrong size is refused, not broadcast into the codec's."""
    cfg = SimpleNamespace(quant="int4", group_size=128, random_fraction=0.1, topk_fraction=0.1)
    codec = CocktailCodec(cfg, [64, 32], seed=0)
    with pytest.raises(ValueError, match="error buffer has shape"):
        codec.load_state_dict({"error": torch.ones(1)})
    codec.load_state_dict({"error": torch.ones(96)})
    assert torch.equal(codec.error, torch.ones(96))


def test_h_is_predicted_again_at_the_rank_the_tp_ranks_agreed_on():
    """Under TP > 1 the replica's TP ranks take the max of their ranks, but H had been predicted from this rank's own
    (smaller) rank's payload: fewer bytes, so a smaller H than the sync that follows needs. Fix:
    ``agree_rank`` predicts H again at the agreed rank, as ``update`` would have at that rank."""

    def payload(r: int) -> int:
        return 1000 * r

    flat = [torch.tensor([1.0, 0.0, 0.0, 0.0])]  # one direction holds all the energy: rank 1 of its own
    ctl = AdaptiveController(energy_eps=0.05, rank_min=1, rank_max=8, h_min=1, h_max=100)
    rank, h = ctl.update(flat, 0.4, payload(4), payload, 0.01)
    assert rank == 1 and h == 10  # 0.4 s for 4 kB -> 1e-4 s/B; 1 kB at rank 1 -> 0.1 s / 0.01 s a step
    h8 = ctl.agree_rank(8, payload)  # a TP peer chose rank 8: its payload is 8 kB
    assert (ctl.rank, h8, ctl.h) == (8, 80, 80)
    twin = AdaptiveController(energy_eps=0.05, rank_min=8, rank_max=8, h_min=1, h_max=100)
    assert twin.update(flat, 0.4, payload(4), payload, 0.01) == (8, h8)  # what update predicts at rank 8
