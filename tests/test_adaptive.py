"""Adaptive rank / H controller (ALGORITHMS §7)."""

import io
import math

import pytest
import torch
import torch.distributed as dist

from dilocox.compress.adaptive import AdaptiveController
from dilocox.compress.collectives import CommStats
from dilocox.compress.compressor import build_compressor
from dilocox.config import AdaptiveConfig, CompressConfig, LowRankConfig
from dilocox.distributed.wire import wire_of
from tests.spawn import run_ranks


def brute_effective_rank(sigmas, eps, tail=0.0, rank_max=10**9):
    """§7 by enumeration: add σ_j² until (1 − ε) of C + tail is reached, then σ_r² copies (flat tail)."""
    e = sorted((float(s) ** 2 for s in sigmas), reverse=True)
    goal = (1 - eps) * (sum(e) + tail) * (1 - 1e-12)
    if goal <= 0:
        return 1
    acc = 0.0
    for k, v in enumerate(e, 1):
        acc += v
        if acc >= goal:
            return k
    k = len(e)
    if e[-1] == 0:
        return rank_max
    while acc < goal and k < rank_max:
        acc += e[-1]
        k += 1
    return k


def test_effective_rank_matches_bruteforce():
    ctl = AdaptiveController(energy_eps=0.05)
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        s = torch.rand(40, generator=g) ** (1 + trial % 5) * 10
        s = s[torch.randperm(40, generator=g)]  # unsorted on purpose
        assert ctl.effective_rank(s) == brute_effective_rank(s.tolist(), 0.05)
    assert ctl.effective_rank(torch.zeros(8)) == 1
    assert ctl.effective_rank(torch.tensor([3.0, 0.0, 0.0])) == 1
    assert AdaptiveController(energy_eps=0.5).effective_rank([1.0, 1.0, 1.0, 1.0]) == 2


def test_effective_rank_with_tail_energy_matches_bruteforce():
    g = torch.Generator().manual_seed(1)
    grew = 0
    for trial in range(200):
        eps = [0.02, 0.05, 0.2][trial % 3]
        ctl = AdaptiveController(energy_eps=eps, rank_min=1, rank_max=[16, 64][trial % 2])
        r = 1 + trial % 12
        s = torch.rand(r, generator=g) ** (1 + trial % 4)
        tail = float(s.square().sum()) * [0.0, 0.01, 0.1, 1.0, 5.0][trial % 5] * float(torch.rand(1, generator=g))
        got = ctl.effective_rank(s, tail)
        assert got == brute_effective_rank(s.tolist(), eps, tail, ctl.rank_max), (trial, s.tolist(), tail)
        grew += got > r
    assert grew > 40  # the rank can rise above r (it never could before the tail was counted)
    ctl = AdaptiveController(energy_eps=0.05, rank_max=32)
    assert ctl.effective_rank([1.0, 1.0, 1.0, 1.0], tail=12.0) == 16  # flat tail: 0.95 * 16 = 15.2 -> 16 components
    assert ctl.effective_rank([1.0, 0.0], tail=1.0) == 32  # σ_r = 0 and energy missing: r_max
    assert ctl.effective_rank([0.0, 0.0], tail=0.0) == 1
    assert ctl.effective_rank([2.0, 1.0, 1.0], tail=0.0) == ctl.effective_rank([2.0, 1.0, 1.0])


def _flat_matrix(true_rank, n, seed):
    """n×n matrix with ``true_rank`` unit singular values in a random subspace (fresh per seed)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, true_rank, generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, true_rank, generator=g)).Q
    return u @ v.t()  # flat spectrum: r_eff = ceil((1 - eps) * true_rank) = true_rank for eps = 0.02


def _true_effective_rank(m, eps):
    return brute_effective_rank(torch.linalg.svdvals(m.double()).tolist(), eps)


def _window_mean(values, w, lo, hi):
    last = values[-w:]
    return min(hi, max(lo, math.ceil(sum(last) / len(last))))


def _adaptive_ccfg(rank, rank_min, rank_max, **kw):
    return CompressConfig(
        lowrank=LowRankConfig(enabled=True, rank=rank),
        adaptive=AdaptiveConfig(enabled=True, rank_min=rank_min, rank_max=rank_max),
        **kw,
    )


def test_rank_falls_with_window_mean_of_effective_rank():
    n, w, eps = 256, 3, 0.02
    comp = build_compressor(_adaptive_ccfg(48, 4, 48, quant="none"), [torch.Size([n, n]), torch.Size([n])], seed=3)
    ctl = AdaptiveController(energy_eps=eps, window=w, rank_min=4, rank_max=48, h_min=1, h_max=10_000)
    true_ranks = [32, 32, 28, 24, 20, 16, 12, 8, 8, 8, 8]
    seen, ranks = [], []
    for step, tr in enumerate(true_ranks):
        m = _flat_matrix(tr, n, seed=step)
        fed = m + comp.errors[0] if comp.errors is not None else m  # what is compressed (error feedback)
        comp.allreduce_mean([m, torch.zeros(n)], None, step)
        sig, tail = comp.sigmas(), comp.tail_energy()
        assert len(sig) == 1 and sig[0].numel() == comp.rank and tail.shape == (1,)
        assert float(tail[0]) < 1e-3 * tr  # the rank holds the whole matrix: nothing outside the basis
        seen.append(_true_effective_rank(fed, eps))
        rank, h = ctl.update(sig, 1.0, comp.payload_bytes(), comp.payload_bytes, 0.01, tail=tail)
        assert ctl.history[-1] == brute_effective_rank(sig[0].tolist(), eps, float(tail[0]), 48)
        assert rank == _window_mean(seen, w, 4, 48)
        comp.set_rank(rank)
        assert comp.rank == rank
        ranks.append(rank)
    # the rank never fell below the true rank, so r_eff measured the true rank exactly
    assert seen == true_ranks
    assert ranks[-1] == 8
    assert all(a >= b for a, b in zip(ranks, ranks[1:]))


def test_rank_grows_with_window_mean_of_effective_rank():
    """True rank rises 4 -> 24 from rank 4: the rank follows it up (without the tail it stays at 4)."""
    n, w, eps = 256, 3, 0.02
    true_ranks = [4, 4, 8, 12, 16, 20, 24, 24, 24, 24, 24, 24, 24]
    runs = {}
    for use_tail in (True, False):
        comp = build_compressor(
            _adaptive_ccfg(4, 2, 48, quant="none", error_feedback=False), [torch.Size([n, n]), torch.Size([n])], seed=3
        )
        ctl = AdaptiveController(energy_eps=eps, window=w, rank_min=2, rank_max=48, h_min=1, h_max=10_000)
        seen, ranks, est, truth = [], [], 0.0, 0.0
        for step, tr in enumerate(true_ranks):
            m = _flat_matrix(tr, n, seed=100 + step)
            comp.allreduce_mean([m, torch.zeros(n)], None, step)
            sig, tail = comp.sigmas(), comp.tail_energy()
            p_hat = comp.lowrank.p_hat()[0]
            est += float(tail[0])
            truth += float((m - p_hat @ (p_hat.t() @ m)).square().sum())  # energy outside the basis
            seen.append(_true_effective_rank(m, eps))
            rank, _ = ctl.update(
                sig, 1.0, comp.payload_bytes(), comp.payload_bytes, 0.01, tail=tail if use_tail else None
            )
            comp.set_rank(rank)
            ranks.append(rank)
        assert seen == true_ranks
        runs[use_tail] = ranks
        if not use_tail:
            assert 0.8 < est / truth < 1.25, (est, truth)  # the sketch is unbiased: 12 draws of a 4..20-rank tail
    ranks = runs[True]
    expect = [_window_mean(seen[: t + 1], w, 2, 48) for t in range(len(seen))]
    assert all(abs(a - b) <= 2 for a, b in zip(ranks, expect)), (ranks, expect)
    assert ranks[-1] == 24 and max(ranks) <= 26
    assert all(b >= a for a, b in zip(ranks, ranks[1:]))
    assert runs[False] == [4] * len(true_ranks)  # σ's alone: the rank can only fall


SHAPES2 = [torch.Size([128, 96]), torch.Size([96, 128]), torch.Size([64])]


def _replica_matrix(rank, step, shape, true_rank):
    """Shared decaying spectrum on fixed directions, replica-specific mixing of those directions
    (DiLoCo replicas agree on the subspace, not on the coefficients) plus private noise."""
    n, m = shape
    g = torch.Generator().manual_seed(7 + n)
    u = torch.linalg.qr(torch.randn(n, 16, generator=g)).Q
    v = torch.linalg.qr(torch.randn(m, 16, generator=g)).Q
    on = (torch.arange(16) < true_rank).float()
    s = 0.85 ** torch.arange(16, dtype=torch.float32) * on
    gr = torch.Generator().manual_seed(1000 * step + 10 * n + rank)
    mix = (torch.eye(16) + 0.5 * torch.randn(16, 16, generator=gr)) * on[:, None] * on[None, :]
    return u @ torch.diag(s) @ mix @ v.t() + 0.001 * torch.randn(n, m, generator=gr)


def _two_rank_adaptive(rank, world, collectives, true_ranks):
    out = {}
    for coll in collectives:
        ccfg = _adaptive_ccfg(3, 2, 24, quant="int4", group_size=32, collective=coll)
        comp = build_compressor(ccfg, SHAPES2, seed=5)
        ctl = AdaptiveController(energy_eps=0.05, window=3, rank_min=2, rank_max=24, h_min=1, h_max=100)
        st = CommStats()
        recs = []
        for step, tr in enumerate(true_ranks):
            ts = [_replica_matrix(rank, step, s, tr) for s in SHAPES2[:2]] + [
                torch.randn(64, generator=torch.Generator().manual_seed(step))
            ]
            fed = [t + e for t, e in zip(ts, comp.errors)] if comp.errors is not None else ts
            r_now, wire = comp.rank, comp.wire_bytes(world)
            comp.allreduce_mean(ts, wire_of(dist.group.WORLD), step, st)
            sig, tail = comp.sigmas(), comp.tail_energy()
            rank_next, h = ctl.update(sig, 0.1, comp.payload_bytes(), comp.payload_bytes, 0.01, tail=tail)
            ref = []  # independent: the energies of the averaged matrices, from all of them
            for i in (0, 1):
                both = [torch.zeros_like(fed[i]) for _ in range(world)]
                dist.all_gather(both, fed[i].contiguous())
                mbar, ph = sum(both) / world, comp.lowrank.p_hat()[i]
                ref.append(
                    {
                        "mbar2": float(mbar.double().square().sum()),
                        "mean2": float(sum(b.double().square().sum() for b in both)) / world,
                        "outside": float((mbar - ph @ (ph.t() @ mbar)).double().square().sum()),
                        "true_eff": brute_effective_rank(torch.linalg.svdvals(mbar.double()).tolist(), 0.05),
                    }
                )
            recs.append(
                {
                    "rank": r_now,
                    "next": rank_next,
                    "h": h,
                    "r_eff": ctl.history[-1],
                    "wire": wire,
                    "sig": [x.clone() for x in sig],
                    "tail": tail.clone(),
                    "ref": ref,
                    "local": [float(f.double().square().sum()) for f in fed[:2]],
                }
            )
            comp.set_rank(rank_next)
        out[coll] = {"recs": recs, "bytes": st.bytes_sent}
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def test_two_replicas_take_identical_decisions_on_different_matrices():
    true_ranks = [3] * 4 + [10] * 10
    colls = ("allgather", "reduce_scatter")
    res = [torch.load(io.BytesIO(b), weights_only=True) for b in run_ranks(2, _two_rank_adaptive, colls, true_ranks)]
    for coll in colls:
        a, b = res[0][coll]["recs"], res[1][coll]["recs"]
        for x, y in zip(a, b):  # bit-identical inputs to the rule, so identical decisions
            assert (x["rank"], x["next"], x["h"], x["r_eff"]) == (y["rank"], y["next"], y["h"], y["r_eff"]), coll
            assert torch.equal(x["tail"], y["tail"]) and all(torch.equal(p, q) for p, q in zip(x["sig"], y["sig"]))
            assert all(abs(p - q) > 1e-3 * p for p, q in zip(x["local"], y["local"]))  # different local matrices
        # every byte counted: the tail sketch is part of the analytic wire size
        assert res[0][coll]["bytes"] == sum(x["wire"] for x in a) > 0
        # T̂ estimates the energy of the AVERAGED matrix outside the basis, C + T̂ its whole energy
        ratios = sorted(float(x["tail"][i]) / x["ref"][i]["outside"] for x in a for i in (0, 1))
        assert 0.8 < ratios[len(ratios) // 2] < 1.25, (coll, ratios)  # a random estimate (0.5x-3x each), centred
        whole = sum(x["ref"][i]["mbar2"] for x in a for i in (0, 1))
        ours = sum(float(x["sig"][i].double().square().sum() + x["tail"][i]) for x in a for i in (0, 1))
        replicas = sum(x["ref"][i]["mean2"] for x in a for i in (0, 1))
        assert abs(ours / whole - 1) < 0.08, (coll, ours, whole)
        assert replicas > 1.3 * whole  # mean_m ‖M_m‖² is no proxy for ‖M̄‖² (module docstring) ...
        ctl = AdaptiveController(energy_eps=0.05, rank_min=2, rank_max=24)
        for x in a[-5:]:  # ... taken as the total, it would call for r_max at every late step
            for i in (0, 1):
                c = float(x["sig"][i].double().square().sum())
                assert ctl.effective_rank(x["sig"][i], x["ref"][i]["mean2"] - c) == 24
        # the rank stays near the low true rank, then rises with it, and stays below r_max
        late = [x["next"] for x in a[-5:]]
        true_late = min(x["ref"][i]["true_eff"] for x in a[-5:] for i in (0, 1))
        assert a[3]["next"] <= 5 and true_late <= min(late) and max(late) <= 20, (
            coll,
            [x["next"] for x in a],
            true_late,
        )


def test_rank_cap_keeps_some_matrix_factored():
    """A grown rank never passes the largest rank at which some matrix is still factored."""
    from dilocox.compress.compressor import Compressor

    shapes = [torch.Size([128, 128]), torch.Size([128, 512]), torch.Size([256, 128]), torch.Size([128])]
    comp = Compressor(shapes, quant="int4", lowrank_rank=8, tail_sketch=True)
    cap = comp.max_rank()
    assert cap == 51  # (128 + 512)·r·2 < 128·512  <=>  r ≤ 51
    assert comp.lowrank.factored_for(cap) == [1] and comp.lowrank.factored_for(cap + 1) == []
    assert Compressor(shapes).max_rank() == 0 and Compressor([torch.Size([8])], lowrank_rank=2).max_rank() == 0

    def payload(r):
        return 10 * r

    sig = [torch.ones(8)]
    free = AdaptiveController(window=2, rank_min=2, rank_max=64, h_min=1, h_max=100)
    capped = AdaptiveController(window=2, rank_min=2, rank_max=64, h_min=1, h_max=100)
    for _ in range(3):  # a huge tail: grow as far as allowed
        assert free.update(sig, 1.0, 80, payload, 0.1, tail=[1e6])[0] == 64
        assert capped.update(sig, 1.0, 80, payload, 0.1, tail=[1e6], rank_cap=cap)[0] == cap
    assert max(capped.history) == cap
    assert capped.update(sig, 1.0, 80, payload, 0.1, tail=[0.0], rank_cap=cap)[0] == math.ceil(
        (cap + 8) / 2
    )  # and back down


def test_h_is_smallest_that_hides_comm_and_is_clamped():
    def payload(r):
        return 1000 * r

    ctl = AdaptiveController(window=1, rank_min=2, rank_max=64, h_min=10, h_max=100, ema=0.5)
    sig = [torch.tensor([1.0] * 16 + [0.0] * 16)]  # r_eff = 16 at any eps < 1
    rank, h = ctl.update(sig, t_comm_measured=2.0, payload_bytes_now=payload(32), payload_fn=payload, t_step=0.03)
    t_comm = 2.0 / payload(32) * payload(16)  # scaled to the new payload: 1.0 s
    assert rank == 16
    assert h * 0.03 >= t_comm and (h - 1) * 0.03 < t_comm and h == 34
    # EMA: second measurement averaged with weight 0.5 (per byte and per step)
    rank, h = ctl.update(sig, 0.5, payload(16), payload, 0.01)
    spb = 0.5 * (2.0 / payload(32)) + 0.5 * (0.5 / payload(16))
    tstep = 0.5 * 0.03 + 0.5 * 0.01
    expect = math.ceil(spb * payload(16) / tstep)
    assert h == expect and h * tstep >= spb * payload(16) > (h - 1) * tstep
    # clamps
    assert ctl.update(sig, 100.0, payload(16), payload, 0.02)[1] == 100
    lo = AdaptiveController(window=1, rank_min=2, rank_max=64, h_min=10, h_max=100)
    assert lo.update(sig, 0.001, payload(16), payload, 1.0)[1] == 10
    assert AdaptiveController(window=1, rank_min=20, rank_max=64).update(sig, 1.0, 1, payload, 1.0)[0] == 20


def test_state_dict_round_trip():
    def payload(r):
        return 100 * r

    a = AdaptiveController(window=3, h_min=1, h_max=1000)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        a.update([torch.rand(16, generator=g)], 0.1 * (i + 1), payload(16), payload, 0.01)
    b = AdaptiveController(window=3, h_min=1, h_max=1000)
    b.load_state_dict(torch.load(_roundtrip(a.state_dict()), weights_only=True))
    s = [torch.rand(16, generator=g)]
    assert a.update(s, 0.3, payload(16), payload, 0.02) == b.update(s, 0.3, payload(16), payload, 0.02)
    assert a.state_dict() == b.state_dict()


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="energy_eps"):
        AdaptiveController(energy_eps=1.5)
    with pytest.raises(ValueError, match="rank_min"):
        AdaptiveController(rank_min=10, rank_max=5)
