"""The one outer-group protocol (dilocox/outer/group.py, issue 25): ``FixedGroup`` on gloo ranks against plain
sums, and the order every ``DiLoCoOuter`` keeps with any group (outer step, snapshot, launch).

The torchft ``QuorumGroup`` is checked against the oracle through the same protocol in tests/test_elastic_outer.py
and tests/test_swarm_runtime.py (real lighthouse, real processes)."""

from __future__ import annotations

import pytest
import torch

from dilocox.compress.cocktail import CocktailCodec, cocktail_allreduce
from dilocox.compress.collectives import CommStats, wire_bytes
from dilocox.compress.compressor import build_compressor
from dilocox.config import CompressConfig, OuterConfig
from dilocox.distributed.wire import wire_of
from dilocox.outer import FixedGroup, build_outer
from tests.reference_diloco import forward_backward, make_inner_opt, make_model
from tests.spawn import run_ranks


def _fixed_group_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    g = FixedGroup(dist.group.WORLD, world)
    torch.manual_seed(100 + rank)
    ts = [torch.randn(3, 4), torch.randn(5)]
    g.stats = stats = CommStats()  # (the group counts every call's bytes there: the plain mean's alone here)
    plain = g.allreduce_mean(ts, step=0)
    sent, g.stats = stats.bytes_sent, None
    cc = CompressConfig(quant="int8", group_size=4)
    codec = build_compressor(cc, [t.shape for t in ts], seed=3)
    twin = build_compressor(cc, [t.shape for t in ts], seed=3)  # the same codec called directly
    via = g.allreduce_mean(ts, step=1, codec=codec)
    direct = twin.allreduce_mean(ts, wire_of(dist.group.WORLD), 1, None)
    ccfg = CompressConfig(random_fraction=0.5, topk_fraction=0.5, quant="int8", group_size=4)
    n = sum(t.numel() for t in ts)
    cocktail = g.allreduce_mean(ts, step=2, codec=CocktailCodec(ccfg, n, seed=5))
    flat = torch.cat([t.reshape(-1) for t in ts])
    err = torch.zeros(n)
    ref = cocktail_allreduce(flat, wire_of(dist.group.WORLD), err, ccfg, 2, None, 5, [t.numel() for t in ts])
    g.allreduce_mean(ts, step=3, propose=10 + rank)
    mx = g.agreed
    return dict(ts=ts, plain=plain, via=via, direct=direct, cocktail=cocktail, ref=ref, max=int(mx), sent=sent)


def test_fixed_group_means_and_agrees_over_gloo_ranks():
    out = run_ranks(2, _fixed_group_rank, timeout=120)
    for o in out:
        for i in range(2):
            want = (out[0]["ts"][i] + out[1]["ts"][i]) / 2
            torch.testing.assert_close(o["plain"][i], want, rtol=1e-6, atol=1e-7)
            assert torch.equal(o["via"][i], o["direct"][i])  # the codec runs as itself, over the group's ranks
            assert not torch.equal(o["via"][i], o["plain"][i])  # (int8: lossy, so the codec really ran)
        assert torch.equal(torch.cat([t.reshape(-1) for t in o["cocktail"]]), o["ref"])
        assert o["max"] == 11  # the max of the proposals, on every rank
        assert o["sent"] == wire_bytes(3 * 4 + 5, 2, "none") > 0  # the plain mean counts its bytes
    assert torch.equal(out[0]["plain"][0], out[1]["plain"][0])


def test_fixed_group_refuses_what_only_an_elastic_group_does():
    g = FixedGroup(None)
    assert g.contributors == [0] and not g.heals and g.agreed is None
    t = [torch.randn(4)]
    assert torch.equal(g.allreduce_mean(t, 0)[0], t[0])  # one replica: the mean is itself
    g.allreduce_mean(t, 0, propose=5)
    assert g.agreed == 5
    g.allreduce_mean(t, 1)
    assert g.agreed is None  # of the last call
    with pytest.raises(ValueError, match="no joiners"):
        g.join(0, lambda: (t, None))
    with pytest.raises(ValueError, match="never heals"):
        g.set_state_fns(dict, print)
    with pytest.raises(ValueError, match="need a process group"):
        FixedGroup(None, 2)


def _norm_check_rank(rank: int, world: int) -> dict:
    """3 replicas; replica 2 sends 50x the others at call 0 and NaN at call 1; call 2 is honest; call 3 is an int8
    codec with replica 1 far above."""
    import torch.distributed as dist

    return _norm_check_calls(FixedGroup(dist.group.WORLD, world, norm_check=4.0), rank)


def _norm_check_calls(g, rank: int) -> dict:
    torch.manual_seed(200 + rank)
    ts = [torch.randn(3, 4), torch.randn(5)]
    outs, rejected = [], []
    for call in range(3):
        x = [t.clone() for t in ts]
        if rank == 2 and call == 0:
            x = [t * 50 for t in x]
        if rank == 2 and call == 1:
            x[1][2] = float("nan")
        outs.append(g.allreduce_mean(x, step=call))
        rejected.append((list(g.rejected), list(g.contributors)))
    cc = CompressConfig(quant="int8", group_size=4)
    codec = build_compressor(cc, [t.shape for t in ts], seed=3)
    x = [t * 100 for t in ts] if rank == 1 else ts
    outs.append(g.allreduce_mean(x, step=3, codec=codec))
    rejected.append((list(g.rejected), list(g.contributors)))
    return dict(ts=ts, outs=outs, rejected=rejected)


def test_norm_check_leaves_an_outlier_or_a_nan_out_of_the_mean():
    """outer.norm_check (issue 21): a replica 50x above the median, or with a NaN, is left out of the mean on every
    replica (the mean of the other two, the same everywhere); an honest call averages all three; through a codec the
    mean is rescaled to the accepted replicas'."""
    _check_norm_check(run_ranks(3, _norm_check_rank, timeout=120))


def _check_norm_check(out: list[dict]) -> None:
    ts = [o["ts"] for o in out]
    mean = lambda who, i: sum(ts[r][i] for r in who) / len(who)  # noqa: E731
    for o in out:
        assert o["rejected"] == [([2], [0, 1]), ([2], [0, 1]), ([], [0, 1, 2]), ([1], [0, 2])]
        for i in range(2):
            torch.testing.assert_close(o["outs"][0][i], mean([0, 1], i), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(o["outs"][1][i], mean([0, 1], i), rtol=1e-6, atol=1e-7)
            assert torch.isfinite(o["outs"][1][i]).all()
            torch.testing.assert_close(o["outs"][2][i], mean([0, 1, 2], i), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(o["outs"][3][i], mean([0, 2], i), rtol=0.0, atol=0.05)  # int8 of the two
            assert torch.equal(o["outs"][3][i], out[0]["outs"][3][i])


class _FakeElastic:
    """Just what ``QuorumGroup`` uses of an ``ElasticOuterGroup``, over gloo ranks: one attempt, every rank in the
    quorum (the torchft one is checked against the oracle in tests/test_elastic_outer.py)."""

    def __init__(self, rank: int, world: int) -> None:
        import torch.distributed as dist

        from dilocox.elastic.group import ElasticConfig

        self.cfg = ElasticConfig(lighthouse_addr="x:1", replica_rank=rank, max_replicas=4)
        self.group, self.dist = wire_of(dist.group.WORLD), dist

    def flat_sum(self, flat, contribute):
        mr = self.cfg.max_replicas
        buf = torch.zeros(flat.numel() + mr)
        if contribute:
            buf[: flat.numel()].copy_(flat)
            buf[flat.numel() + self.cfg.replica_rank] = 1
        self.dist.all_reduce(buf)
        return buf[: flat.numel()], buf[flat.numel() :]

    def run_step(self, body, contribute=True):
        from dilocox.elastic.group import ElasticResult

        total, onehot = body(contribute)
        who = [int(i) for i in torch.nonzero(onehot).flatten().tolist()]
        return ElasticResult(total, who, 0, 0, 1, 0.0, 0.0, world=self.group.size())


def _quorum_norm_check_rank(rank: int, world: int) -> dict:
    """``_norm_check_rank``'s four calls through a ``QuorumGroup``: the plain path (norms first, then the sum) and
    the codec path (norms in the count's buffer)."""
    from dilocox.elastic.quorum import QuorumGroup

    g = QuorumGroup(_FakeElastic(rank, world), norm_check=4.0)
    return _norm_check_calls(g, rank)


def test_quorum_group_norm_check_equals_the_fixed_group_rule():
    """outer.norm_check on the elastic group (issue 21): the same calls as the fixed group's test give the same
    rejections, contributors and means on every replica, with and without a codec."""
    _check_norm_check(run_ranks(3, _quorum_norm_check_rank, timeout=120))


def test_norm_check_rule_and_its_refusals():
    from dilocox.config import ConfigError, load_config
    from dilocox.outer.group import outliers

    assert outliers([1.0, 1.2, 0.9, 9.0], 4.0) == [3]
    assert outliers([1.0, float("inf"), 1.1], 4.0) == [1]
    assert outliers([1.0, 100.0], 4.0) == []  # 2 replicas: the median is their mean, never exceeded 2x
    with pytest.raises(ValueError, match="above 1"):
        FixedGroup(None, 1, norm_check=0.5)
    with pytest.raises(ConfigError, match="outer.norm_check"):
        load_config(None, ["--outer.method=diloco", "--outer.norm_check=1"])
    with pytest.raises(ConfigError, match="outer.overlap=eager"):
        load_config(None, ["--outer.method=diloco", "--outer.overlap=eager", "--outer.norm_check=4"])
    from dilocox.config import validate_swarm_layout

    with pytest.raises(ConfigError, match="SWARM"):
        validate_swarm_layout(load_config(None, ["--outer.norm_check=4"]))


class _RecordingGroup(FixedGroup):
    """A one-replica group that claims to heal: records, at every all-reduce, what a joiner would receive."""

    heals = True

    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[dict] = []

    def set_state_fns(self, state_fn, load_fn, max_state_bytes=None) -> None:
        self.state_fn = state_fn

    def allreduce_mean(self, tensors, step, codec=None, propose=None):
        sd = self.state_fn()
        self.seen.append({"n": sd["n"], "outer_step": sd["outer_step"], "theta": sd["theta"].clone()})
        return super().allreduce_mean(tensors, step, codec, propose)


@pytest.mark.parametrize("overlap", ["none", "delayed", "eager"])
def test_every_group_sees_the_outer_step_before_the_launch(overlap):
    """One order for every group: a snapshot taken at a launch holds θ after that sync's outer step (delayed/eager:
    θ^t; none: θ^{t-1}, its outer step comes after the wait), and a heal-capable group does not change the math."""
    H, steps, seed = 2, 8, 7
    runs = {}
    for kind in ("fixed", "recording"):
        model = make_model(seed)
        opt = make_inner_opt(model)
        group = _RecordingGroup() if kind == "recording" else None
        outer = build_outer(
            list(model.named_parameters()),
            None,
            OuterConfig(method="diloco", sync_every=H, overlap=overlap),
            CompressConfig(),
            seed,
            group=group,
        )
        theta0 = outer.state.theta.clone()
        thetas = []
        for step in range(steps):
            forward_backward(model, seed, 0, step)
            opt.step()
            opt.zero_grad()
            outer.after_inner_step(step)
            if (step + 1) % H == 0:
                outer.comm.drain()
                thetas.append(outer.state.theta.clone())
        outer.finish()
        runs[kind] = (thetas, {n: p.detach().clone() for n, p in model.named_parameters()}, group, theta0)
    (t_fixed, p_fixed, _, _), (t_rec, p_rec, group, theta0) = runs["fixed"], runs["recording"]
    for a, b in zip(t_fixed, t_rec):
        assert torch.equal(a, b)
    for n in p_fixed:
        assert torch.equal(p_fixed[n], p_rec[n]), n
    assert [s["n"] for s in group.seen] == [H * (i + 1) for i in range(steps // H)]
    for i, s in enumerate(group.seen):
        if overlap == "none":  # launched before this sync's outer step
            assert s["outer_step"] == i
            assert torch.equal(s["theta"], t_rec[i - 1] if i else theta0)
        else:  # after it: a joiner gets θ^t
            assert s["outer_step"] == i + 1
            assert torch.equal(s["theta"], t_rec[i])
