"""Adaptive rank / H controller (ALGORITHMS §7)."""

import math

import pytest
import torch

from dilocox.compress.adaptive import AdaptiveController
from dilocox.config import CompressConfig, LowRankConfig


def brute_effective_rank(sigmas, eps):
    e = sorted((float(s) ** 2 for s in sigmas), reverse=True)
    total = sum(e)
    if total == 0:
        return 1
    acc = 0.0
    for k, v in enumerate(e, 1):
        acc += v
        if acc >= (1 - eps) * total * (1 - 1e-12):
            return k
    return len(e)


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


def _decaying_matrix(true_rank, n, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, true_rank, generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, true_rank, generator=g)).Q
    return u @ v.t()  # flat spectrum: r_eff = ceil((1 - eps) * true_rank) = true_rank for eps = 0.02


def test_rank_follows_window_mean_of_effective_rank():
    from dilocox.compress.compressor import build_compressor

    n, w, eps = 256, 3, 0.02
    ccfg = CompressConfig(quant="none", lowrank=LowRankConfig(enabled=True, rank=48))
    comp = build_compressor(ccfg, [torch.Size([n, n]), torch.Size([n])], seed=3)
    ctl = AdaptiveController(energy_eps=eps, window=w, rank_min=4, rank_max=48, h_min=1, h_max=10_000)
    true_ranks = [32, 32, 28, 24, 20, 16, 12, 8, 8, 8, 8]
    seen, ranks = [], []
    for step, tr in enumerate(true_ranks):
        m = _decaying_matrix(tr, n, seed=step)
        comp.allreduce_mean([m, torch.zeros(n)], None, step)
        sig = comp.sigmas()
        assert len(sig) == 1 and sig[0].numel() == comp.rank
        r_eff = brute_effective_rank(sig[0].tolist(), eps)
        seen.append(r_eff)
        rank, h = ctl.update(sig, 1.0, comp.payload_bytes(), comp.payload_bytes, 0.01)
        expect = min(48, max(4, math.ceil(sum(seen[-w:]) / len(seen[-w:]))))
        assert rank == expect
        comp.set_rank(rank)
        assert comp.rank == rank
        ranks.append(rank)
    # the rank never fell below the true rank, so r_eff measured the true rank exactly
    assert seen == true_ranks
    assert ranks[-1] == 8
    assert all(a >= b for a, b in zip(ranks, ranks[1:]))


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
