"""Dropout under tensor parallelism (``attention.tp_rank_dropout``, Megatron's model-parallel RNG): the attention
masks of a TP rank's heads come from a stream of that rank's own, seeded from one draw of the shared CPU stream; the
shared streams are consumed identically on every TP rank, so the residual/embedding masks, the losses and the
replicated weights stay equal across the TP ranks, and a resumed run draws the masks of the run it continues."""

from __future__ import annotations

import math

import torch

from dilocox.model.attention import SDPAttention, tp_rank_dropout
from dilocox.seeding import mix_seed
from tests.small_run import small_cfg
from tests.spawn import run_ranks


def _qkv():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 16, 4, 8, generator=g) for _ in range(3)]


def _kernel():
    k = SDPAttention(4, 4, dropout=0.5)
    k.train()
    return k


def test_each_rank_draws_its_own_masks_and_the_shared_stream_moves_the_same():
    q, k, v = _qkv()
    outs, after = [], []
    for rank in (0, 1, 0):
        torch.manual_seed(11)
        outs.append(tp_rank_dropout(_kernel(), rank, q, k, v))
        after.append(torch.get_rng_state())
    assert not torch.equal(outs[0], outs[1])  # other heads, other masks
    assert torch.equal(outs[0], outs[2])  # the same rank from the same state: the same masks
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2])  # one shared draw on every rank
    # reference: the documented seeding, written out
    torch.manual_seed(11)
    shared = int(torch.randint(0, 2**62, (1,)).item())
    state = torch.get_rng_state()
    torch.manual_seed(mix_seed(shared, 1))
    ref = _kernel()(q, k, v)
    assert torch.equal(outs[1], ref) and torch.equal(after[1], state)
    # dropout really acted: without it the output differs
    assert not torch.equal(outs[0], SDPAttention(4, 4, dropout=0.0)(q, k, v))


def _train(rank, world, tmp, steps):
    from dilocox.train import Trainer

    runs = {}
    for name, extra in (("drop", ["--model.dropout=0.2"]), ("nodrop", [])):
        t = Trainer(small_cfg(f"{tmp}/{name}", "--parallel.tensor=2", "--checkpoint.every=0", *extra, steps=steps))
        losses = [t.train_step() for _ in range(steps)]
        shared = {n: p.detach().clone() for n, p in t.model.named_parameters() if not hasattr(p, "partition_dim")}
        runs[name] = (losses, shared)
        if t.run_lock is not None:
            t.run_lock.release()
        t.logger.close()
    return runs


def test_tensor_parallel_ranks_stay_in_step_with_dropout(tmp_path):
    r0, r1 = run_ranks(2, _train, str(tmp_path), 4)
    (l0, w0), (l1, w1) = r0["drop"], r1["drop"]
    assert l0 == l1 and all(math.isfinite(v) for v in l0), (l0, l1)  # the same loss on both TP ranks
    assert w0 and w0.keys() == w1.keys()
    assert all(torch.equal(w0[n], w1[n]) for n in w0), [n for n in w0 if not torch.equal(w0[n], w1[n])]
    assert l0 != r0["nodrop"][0]  # the masks acted
