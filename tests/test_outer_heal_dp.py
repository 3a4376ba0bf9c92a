"""A replica healed mid-run with its outer state sharded over inner DP (``outer.shard_over_data``, D = 2) and
streaming fragments (K = 2, overlap none): ``_sync`` reloads EVERY fragment from the received θ, but each DP rank
reloads only the tensors it owns, so every fragment must then go out from its owners, not only the ones syncing at
that step (``join()`` broadcasts them all too). Before, the other fragment's tensors kept their pre-heal values on the
ranks that do not own them until that fragment's next sync: the DP ranks of one replica trained on different
parameters (docs/ELASTIC.md §6, §7: a replica healed in the middle of a run)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dilocox.config import CompressConfig, OuterConfig, StreamingConfig
from dilocox.outer import FixedGroup, build_outer
from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model

SEED = 11
HEAL_CALL = 3  # the third outer round (each fragment has synced once before): a mid-run heal


class _HealsOnce(FixedGroup):
    """One replica whose group heals it in its ``HEAL_CALL``-th round, as torchft's quorum does a replica that fell
    behind (all the ranks of a replica heal in the same round: one quorum and one commit vote per replica). The
    received θ is the launch's snapshot moved by 0.25 (a live peer's θ differs from this replica's)."""

    heals = True

    def __init__(self) -> None:
        super().__init__(None)
        self.calls = 0

    def set_state_fns(self, state_fn, load_fn, max_state_bytes=None) -> None:
        self.state_fn, self.load_fn = state_fn, load_fn

    def allreduce_mean(self, tensors, step, codec=None, propose=None):
        self.calls += 1
        if self.calls == HEAL_CALL:
            sd = dict(self.state_fn())
            sd["theta"] = sd["theta"] + 0.25
            self.load_fn(sd)  # (the comm thread, inside the all-reduce, as torchft's heal)
        return super().allreduce_mean(tensors, step, codec, propose)


def _params_flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _heal_rank(rank: int, world: int, tau: int) -> dict:
    from dilocox.config import ParallelConfig
    from dilocox.distributed.topology import build_topology

    topo = build_topology(ParallelConfig(replicas=1, data=world))
    model = make_model(SEED)
    opt = make_inner_opt(model)
    o = OuterConfig(method="diloco", sync_every=4, streaming=StreamingConfig(fragments=2, tau=tau))
    loop = build_outer(list(model.named_parameters()), topo, o, CompressConfig(), SEED, layer_of, 4, group=_HealsOnce())
    assert loop.dp_shard is not None
    healed_at, after_heal = None, None
    for step in range(10):
        forward_backward(model, SEED, rank, step)  # (each DP rank its own micro-batch; the gradients averaged)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=topo.group("dp"))
            p.grad.div_(world)
        opt.step()
        opt.zero_grad()
        loop.after_inner_step(step)
        if (n := loop.membership.pop_jump()) is not None:
            healed_at, after_heal = n, _params_flat(model).clone()
    end = _params_flat(model).clone()
    loop.finish()
    return {"healed_at": healed_at, "after_heal": after_heal, "end": end}


def _check(tau: int) -> None:
    from tests.spawn import run_ranks

    out = run_ranks(2, _heal_rank, tau, timeout=120)
    assert out[0]["healed_at"] is not None and out[0]["healed_at"] == out[1]["healed_at"]
    # the DP ranks of one replica hold the same parameters right after the heal and from then on
    assert torch.equal(out[0]["after_heal"], out[1]["after_heal"])
    assert torch.equal(out[0]["end"], out[1]["end"])


def test_dp_ranks_agree_after_a_mid_run_heal_with_streaming_fragments():
    _check(tau=0)


def test_dp_ranks_agree_after_a_mid_run_heal_with_streaming_fragments_and_tau():
    """tau = 1: the heal arrives in the round launched a step before the sync that applies it."""
    _check(tau=1)
