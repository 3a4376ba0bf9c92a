"""PowerSGD (ALGORITHMS §5) and the Compressor that the outer optimizer uses."""

import io
import math

import pytest
import torch
import torch.distributed as dist

from dilocox.compress.collectives import CommStats, nbytes, wire_bytes
from dilocox.compress.compressor import Compressor, build_compressor
from dilocox.compress.lowrank import PowerSGD, factorable
from dilocox.compress.quant import dequantize, quantize
from dilocox.config import CompressConfig, LowRankConfig
from dilocox.distributed.wire import wire_of
from tests.spawn import run_ranks


def _low_rank(n, m, r, seed, shared_left=None):
    g = torch.Generator().manual_seed(seed)
    a = shared_left if shared_left is not None else torch.randn(n, r, generator=g)
    return a @ torch.randn(r, m, generator=g)


def _decaying(n, m, seed, decay=0.7):
    """n×m matrix with singular values decay**j (a pseudo-gradient-like spectrum)."""
    g = torch.Generator().manual_seed(seed)
    k = min(n, m)
    u = torch.linalg.qr(torch.randn(n, k, generator=g)).Q
    v = torch.linalg.qr(torch.randn(m, k, generator=g)).Q
    return (u * decay ** torch.arange(k, dtype=torch.float32)) @ v.t()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_eligibility_routes_vectors_and_thin_matrices_to_quantization():
    shapes = [torch.Size([64]), torch.Size([64, 48]), torch.Size([4, 1000]), torch.Size([16, 4, 64])]
    p = PowerSGD(shapes, rank=4, seed=0)
    assert p.factored == [
        i for i, s in enumerate(shapes) if len(s) >= 2 and (s[0] + math.prod(s[1:])) * 4 * 2 < math.prod(s)
    ]
    assert p.factored == [1, 3]
    assert not factorable(torch.Size([64]), 1) and not factorable(torch.Size([4, 1000]), 4)


def test_rank_r_matrix_recovered_single_process():
    m = _low_rank(64, 48, 4, seed=1)
    p = PowerSGD([m.shape], rank=4, seed=3)
    m_hat, residual = p.allreduce([m], None)
    torch.testing.assert_close(m_hat[0], m, rtol=0, atol=1e-4 * m.abs().max())
    assert residual[0].abs().max() < 1e-4 * m.abs().max()


def test_warm_start_improves_over_outer_steps():
    m = _decaying(96, 80, seed=2)
    r = 4
    best = torch.linalg.svdvals(m)[r:].square().sum().sqrt() / m.norm()  # optimal rank-r error
    p = PowerSGD([m.shape], rank=r, seed=5)
    errs = []
    for t in range(6):
        m_hat, _ = p.allreduce([m], None, step=t)
        errs.append(float((m_hat[0] - m).norm() / m.norm()))
    assert errs[-1] < errs[0]
    assert all(b <= a * 1.0001 for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < best * 1.05, (errs, float(best))
    # σ estimates converge to the top singular values
    torch.testing.assert_close(p.sigmas()[0], torch.linalg.svdvals(m)[:r], rtol=0.05, atol=0)


def test_set_rank_truncates_and_extends_deterministically():
    shapes = [torch.Size([64, 48])]
    a, b = PowerSGD(shapes, 4, seed=11), PowerSGD(shapes, 4, seed=11)
    assert torch.equal(a.q[0], b.q[0])
    q4 = a.q[0].clone()
    a.set_rank(2)
    assert torch.equal(a.q[0], q4[:, :2])
    a.set_rank(6)
    b.set_rank(2)
    b.set_rank(6)
    assert torch.equal(a.q[0], b.q[0]) and a.q[0].shape == (48, 6)
    extra = a.q[0][:, 2:]
    torch.testing.assert_close(extra.t() @ extra, torch.eye(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(q4[:, :2].t() @ extra, torch.zeros(2, 4), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- multi-rank


def _matrices(rank, n, m, r):
    shared = torch.randn(n, r, generator=torch.Generator().manual_seed(99))
    return _low_rank(n, m, r, seed=10 + rank, shared_left=shared)  # each rank rank-r, same column space


def _powersgd_ranks(rank, world, n, m, r, kinds, G):
    out = {}
    for kind in kinds:
        mat = _matrices(rank, n, m, r) + 0.01 * _decaying(n, m, seed=50 + rank)
        p = PowerSGD([mat.shape], rank=r, seed=7)
        q0 = p.q[0].clone()
        st = CommStats()
        m_hat, residual = p.allreduce([mat], wire_of(dist.group.WORLD), kind=kind, group_size=G, stats=st)
        out[kind] = {
            "m_hat": m_hat[0],
            "p_hat": p.p_hat()[0],
            "q0": q0,
            "residual": residual[0],
            "mat": mat,
            "bytes": st.bytes_sent,
        }
    return out


def _reference_powersgd(mats, q0, kind, G):
    """Independent single-process PowerSGD step over R replicas (sum of P, orth, mean of Q)."""

    def wire(t):
        if kind == "none":
            return t
        return dequantize(quantize(t.contiguous().reshape(-1), kind, G)).view(t.shape)

    R = len(mats)
    p = torch.zeros(q0.shape[1], mats[0].shape[0])
    for mat in mats:
        p += wire((mat @ q0).t())
    p_hat = torch.linalg.qr(p.t()).Q
    q = torch.zeros(q0.shape[1], mats[0].shape[1])
    for mat in mats:
        q += wire(p_hat.t() @ mat)
    return p_hat, p_hat @ (q / R)


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_allreduce_identical_and_matches_reference(world):
    n, m, r, G = 64, 96, 4, 32
    kinds = ("int4", "none")
    by_rank = run_ranks(world, _powersgd_ranks, n, m, r, kinds, G)
    for kind in kinds:
        res = [x[kind] for x in by_rank]
        for x in res[1:]:
            assert torch.equal(x["p_hat"], res[0]["p_hat"]), "P̂ must be bit-identical on every replica"
            assert torch.equal(x["m_hat"], res[0]["m_hat"])
        mats = [x["mat"] for x in res]
        p_hat, m_ref = _reference_powersgd(mats, res[0]["q0"], kind, G)
        torch.testing.assert_close(res[0]["p_hat"], p_hat, rtol=0, atol=1e-6)
        torch.testing.assert_close(res[0]["m_hat"], m_ref, rtol=0, atol=1e-5)
        # what was sent, summed over replicas, is exactly R·M̂ (error feedback subtracts it)
        sent = sum(x["mat"] - x["residual"] for x in res)
        torch.testing.assert_close(sent / world, res[0]["m_hat"], rtol=0, atol=1e-5)
        mean = sum(mats) / world
        rel = float((res[0]["m_hat"] - mean).norm() / mean.norm())
        assert rel < (0.02 if kind == "none" else 0.35), (kind, rel)  # int4 P and Q: ~0.1 each
        assert res[0]["bytes"] == _wire(kind, r * n, world, G) + _wire(kind, r * m, world, G)


def _wire(kind, k, world, G):
    if kind == "none":  # ring all-reduce of fp32
        return math.ceil(2 * (world - 1) * 4 * k / world)
    return (world - 1) * ((k + 1) // 2 + 2 * math.ceil(k / G))  # all-gather of the int4 payload


def _compressor_ranks(rank, world, ccfgs, shapes, steps):
    runs = []
    for ccfg in ccfgs:
        comp = build_compressor(ccfg, shapes, seed=21)
        st = CommStats()
        outs = []
        for t in range(steps):
            g = torch.Generator().manual_seed(1000 * t + rank)
            ts = [torch.randn(s, generator=g) for s in shapes]
            ts[0] = ts[0] * 0.1 + _matrices(rank, *shapes[0], 4)
            outs.append((ts, comp.allreduce_mean(ts, wire_of(dist.group.WORLD), t, st)))
        runs.append(
            {
                "outs": outs,
                "bytes": st.bytes_sent,
                "calls": st.n_calls,
                "wire": comp.wire_bytes(world),
                "errors": comp.errors,
            }
        )
    return runs


SHAPES = [torch.Size([64, 96]), torch.Size([96]), torch.Size([3, 200]), torch.Size([40, 128])]


def test_compressor_on_two_ranks():
    steps = 3
    lowrank = LowRankConfig(enabled=True, rank=4)
    ccfgs = [
        CompressConfig(),  # no compression: exact fp32 mean
        CompressConfig(quant="int4", group_size=32, collective="allgather", lowrank=lowrank),
        CompressConfig(quant="int4", group_size=32, collective="reduce_scatter", lowrank=lowrank),
    ]
    by_rank = run_ranks(2, _compressor_ranks, ccfgs, SHAPES, steps)
    exact = [x[0] for x in by_rank]
    for t in range(steps):
        ins = [exact[r]["outs"][t][0] for r in range(2)]
        for i in range(len(SHAPES)):
            want = (ins[0][i] + ins[1][i]) / 2
            assert torch.equal(exact[0]["outs"][t][1][i], want) and torch.equal(exact[1]["outs"][t][1][i], want)
    assert exact[0]["calls"] == steps and exact[0]["bytes"] == exact[0]["wire"] * steps == steps * 4 * sum(
        s.numel() for s in SHAPES
    )

    for c in (1, 2):
        res = [x[c] for x in by_rank]
        for t in range(steps):
            for a, b in zip(res[0]["outs"][t][1], res[1]["outs"][t][1]):
                assert torch.equal(a, b), ccfgs[c].collective
        assert res[0]["calls"] == 2 * steps  # P round + (Q | rest) round
        assert res[0]["bytes"] == steps * res[0]["wire"]
        # error feedback telescopes: Σ_t out_t + mean_r e_r,T = Σ_t mean_r Δ_r,t, for every tensor
        # (exact up to fp32 rounding with allgather; reduce_scatter adds its unbiased requantization)
        for i in range(len(SHAPES)):
            truth = sum(sum(res[r]["outs"][t][0][i] for r in range(2)) / 2 for t in range(steps))
            got = sum(res[0]["outs"][t][1][i] for t in range(steps)) + sum(res[r]["errors"][i] for r in range(2)) / 2
            rel = float((got - truth).norm() / truth.norm())
            assert rel < (1e-5 if c == 1 else 0.3), (ccfgs[c].collective, i, rel)
            assert torch.count_nonzero(res[0]["errors"][i]) > 0


def test_compressor_vectors_only_quantized_and_payload():
    ccfg = CompressConfig(quant="int4", group_size=32, lowrank=LowRankConfig(enabled=True, rank=4))
    shapes = [torch.Size([96]), torch.Size([64, 96])]
    comp = build_compressor(ccfg, shapes, seed=1)
    g = torch.Generator().manual_seed(0)
    v, mat = torch.randn(96, generator=g), torch.randn(64, 96, generator=g)
    out = comp.allreduce_mean([v, mat], None, 0)
    assert torch.equal(out[0], dequantize(quantize(v, "int4", 32)))  # 1-D: plain int4 (starts on a group boundary)
    p_el, q_el = 4 * 64, 4 * 96
    pay = lambda k: (k + 1) // 2 + 2 * math.ceil(k / 32)  # noqa: E731
    assert comp.payload_bytes() == pay(p_el) + pay(q_el + 96)
    assert comp.payload_bytes(2) == pay(2 * 64) + pay(2 * 96 + 96)
    ratio = 4 * (96 + 64 * 96) / comp.payload_bytes()
    assert ratio > 30


def test_state_dict_round_trip_gives_identical_next_step():
    ccfg = CompressConfig(quant="int4", group_size=32, lowrank=LowRankConfig(enabled=True, rank=4))
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(3)]
    a = build_compressor(ccfg, SHAPES, seed=4)
    for t in range(2):
        a.allreduce_mean(steps[t], None, t)
    a.set_rank(3)
    b = build_compressor(ccfg, SHAPES, seed=4)
    b.load_state_dict(_roundtrip(a.state_dict()))
    assert b.rank == 3
    oa, ob = a.allreduce_mean(steps[2], None, 2), b.allreduce_mean(steps[2], None, 2)
    for x, y in zip(oa, ob):
        assert torch.equal(x, y)
    for x, y in zip(a.errors, b.errors):
        assert torch.equal(x, y)


def test_tail_sketch_is_linear_and_unbiased():
    """‖S‖² estimates ‖(I − P̂P̂ᵀ) M‖² without bias over fresh probes; S is linear in M."""
    from dilocox.compress.lowrank import SKETCH_COLS, SKETCH_ROWS

    m1, m2 = _decaying(96, 80, seed=4, decay=0.9), _decaying(96, 80, seed=5, decay=0.9)
    p = PowerSGD([m1.shape], rank=4, seed=2)
    q1 = p.q_step([m1], p.p_step([m1]))  # fixes P̂ (from m1) for the rest of the test
    q2 = p.p_hat()[0].t().matmul(m2).reshape(-1)
    s1, s2 = p.tail_sketch([m1], q1, step=0), p.tail_sketch([m2], q2, step=0)
    assert s1.shape == (SKETCH_ROWS * SKETCH_COLS,)
    torch.testing.assert_close(p.tail_sketch([m1 + m2], q1 + q2, step=0), s1 + s2, rtol=0, atol=1e-5)
    ph = p.p_hat()[0]
    outside = float((m1 - ph @ (ph.t() @ m1)).double().square().sum())
    draws = torch.tensor([float(p.tail_sketch([m1], q1, step=t).double().square().sum()) for t in range(300)])
    assert abs(float(draws.mean()) / outside - 1) < 0.05, (float(draws.mean()), outside)
    assert float(draws.std()) / outside > 0.05  # fresh probes every step: the draws differ
    assert torch.equal(p.tail_sketch([m1], q1, step=7), p.tail_sketch([m1], q1, step=7))  # same step: same probes


def test_tail_sketch_layout_payload_and_no_effect_on_the_result():
    shapes = [torch.Size([96]), torch.Size([64, 96]), torch.Size([48, 80])]
    g = torch.Generator().manual_seed(6)
    steps = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
    k = 2  # factored matrices at rank 4
    for kind, G in (("int4", 32), ("int4", 256), ("int8", 64), ("none", 32), ("fp16", 32)):
        plain = Compressor(shapes, quant=kind, group_size=G, lowrank_rank=4, seed=9)
        sk = Compressor(shapes, quant=kind, group_size=G, lowrank_rank=4, seed=9, tail_sketch=True)
        # int kinds: every segment (each P_iᵀ, Q_iᵀ, sketch block, rest tensor) in whole groups
        seg = (lambda x: math.ceil(x / G) * G) if kind in ("int4", "int8") else (lambda x: x)  # noqa: E731
        p_el, q_el, rest = seg(4 * 64) + seg(4 * 48), seg(4 * 96) + seg(4 * 80), seg(96)
        n2 = q_el + k * seg(128) + rest
        assert sk.payload_bytes() == nbytes(kind, p_el, G) + nbytes(kind, n2, G), kind
        assert plain.payload_bytes() == nbytes(kind, p_el, G) + nbytes(kind, q_el + rest, G)
        assert sk.wire_bytes(3) == wire_bytes(p_el, 3, kind, G) + wire_bytes(n2, 3, kind, G)
        for t, ts in enumerate(steps):
            fed = [x + e for x, e in zip(ts, sk.errors)] if sk.errors is not None else ts
            a, b = plain.allreduce_mean(ts, None, t), sk.allreduce_mean(ts, None, t)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), kind  # the sketch changes nothing else
            if plain.errors is not None:
                assert all(torch.equal(x, y) for x, y in zip(plain.errors, sk.errors))
        assert plain.tail_energy() is None and sk.tail_energy().shape == (k,)
        # one replica: T̂ = ‖S‖² of its own error-fed matrices, up to the wire format
        lr = sk.lowrank
        q_local = torch.cat(
            [
                (lr.p_hat()[i].t() @ fed[i].reshape(s[0], -1)).reshape(-1)
                for i, s in zip(lr.factored, [shapes[1], shapes[2]])
            ]
        )
        want = lr.tail_sketch(fed, q_local, len(steps) - 1).view(k, -1).double().square().sum(1)
        tol = {"none": 1e-5, "fp16": 2e-3}.get(kind, 0.1)
        torch.testing.assert_close(sk.tail_energy(), want, rtol=tol, atol=0)
        c = _roundtrip(sk.state_dict())
        other = Compressor(shapes, quant=kind, group_size=G, lowrank_rank=4, seed=9, tail_sketch=True)
        other.load_state_dict(c)
        assert torch.equal(other.tail_energy(), sk.tail_energy())
        sk.set_rank(3)
        assert sk.tail_energy() is None  # measured for the old basis


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="compress.quant"):
        Compressor([torch.Size([4])], quant="int3")
    comp = Compressor([torch.Size([4])])
    with pytest.raises(ValueError, match="shapes"):
        comp.allreduce_mean([torch.zeros(5)], None, 0)
