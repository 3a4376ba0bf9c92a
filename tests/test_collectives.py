"""Quantized all-reduce (allgather / reduce_scatter / none / fp16) and the CocktailSGD baseline."""

import math

import torch
import torch.distributed as dist

from dilocox.compress.collectives import CommStats, quantized_allreduce
from dilocox.compress.quant import dequantize, quantize
from dilocox.config import CompressConfig
from dilocox.distributed.wire import wire_of
from tests.spawn import run_ranks

LEVELS = {"int4": 7, "int8": 127}


def _inputs(rank, n, t=0):
    g = torch.Generator().manual_seed(7919 * t + 31 * rank + n)
    x = torch.randn(n, generator=g) * torch.linspace(0.1, 3.0, n)  # groups of different magnitude
    e = torch.randn(n, generator=g) * 0.01  # a non-zero starting error-feedback buffer
    return x, e


def _payload(kind, n, G):
    """ALGORITHMS §6 layout, written out independently: [packed values | bf16 scales]."""
    if kind == "int4":
        return (n + 1) // 2 + 2 * math.ceil(n / G)
    if kind == "int8":
        return n + 2 * math.ceil(n / G)
    return {"fp16": 2, "none": 4}[kind] * n


def _reference(world, kind, n, G, t=0):
    """(Σ_r deq(q(x_r + e_r)), new error buffers) computed rank by rank in one process."""
    total = torch.zeros(n)
    errs = []
    for r in range(world):
        x, e = _inputs(r, n, t)
        if kind == "fp16":
            v = x + e
            sent = v.half().float()
            e = v - sent
        else:
            sent = dequantize(quantize(x, kind, G, error=e))
        total += sent
        errs.append(e)
    return total, errs


# cases: (kind, mode, op, n, G)
CASES = {
    2: [
        ("int4", "allgather", "mean", 1000, 32),
        ("int8", "allgather", "sum", 777, 64),
        ("int4", "reduce_scatter", "mean", 1000, 32),
        ("fp16", "allgather", "mean", 500, 32),
        ("none", "allgather", "mean", 1000, 32),
    ],
    3: [
        ("int4", "allgather", "mean", 1001, 32),
        ("int4", "reduce_scatter", "mean", 200, 128),
        ("int8", "reduce_scatter", "mean", 999, 32),
        ("fp16", "reduce_scatter", "mean", 300, 32),
        ("none", "reduce_scatter", "mean", 999, 32),
    ],
    4: [("int4", "reduce_scatter", "mean", 4096, 64)],
}


def _run_cases(rank, world, cases):
    out = []
    for kind, mode, op, n, G in cases:
        x, e = _inputs(rank, n)
        st = CommStats()
        wire = wire_of(dist.group.WORLD)
        y = quantized_allreduce(x, wire, kind, G, mode=mode, op=op, error=e, stats=st, seed=5, step=3)
        out.append((y, e, st.as_dict()))
    return out


def _check_world(world):
    res = run_ranks(world, _run_cases, CASES[world])
    for c, (kind, mode, op, n, G) in enumerate(CASES[world]):
        ys = [res[r][c][0] for r in range(world)]
        for y in ys[1:]:
            assert torch.equal(y, ys[0]), f"{kind}/{mode}: result differs between ranks"
        total, errs = _reference(world, kind, n, G)
        want = total / world if op == "mean" else total
        if kind == "none":
            xs = [sum(_inputs(r, n)) for r in range(world)]
            torch.testing.assert_close(ys[0], sum(xs) / world, rtol=1e-6, atol=1e-6)
            for r in range(world):
                assert torch.count_nonzero(res[r][c][1]) == 0  # error consumed
        elif mode == "allgather":
            assert torch.equal(ys[0], want), f"{kind}/{mode}: not the dequantize-sum of the gathered inputs"
        elif kind == "fp16":
            torch.testing.assert_close(ys[0], want.half().float(), rtol=0, atol=0)
        else:  # reduce_scatter: one stochastic requantization of the exact mean, per group
            err = (ys[0] - want).abs()
            for lo in range(0, n, G):
                bound = want[lo : lo + G].abs().max() / LEVELS[kind] * 1.02 + 1e-12
                assert err[lo : lo + G].max() <= bound, (
                    f"{kind}/{mode}: group at {lo} off by {err[lo : lo + G].max()} > {bound}"
                )
            assert err.max() > 0  # it did requantize
        if kind != "none":
            for r in range(world):
                assert torch.equal(res[r][c][1], errs[r]), f"{kind}/{mode}: error feedback of rank {r}"
        # bytes: what one rank puts on the wire under the algorithm
        if kind == "none":
            expect = math.ceil(2 * (world - 1) * 4 * n / world)
        elif mode == "allgather":
            expect = (world - 1) * _payload(kind, n, G)
        else:
            chunk = math.ceil(math.ceil(n / world) / G) * G
            expect = 2 * (world - 1) * _payload(kind, chunk, G)
        for r in range(world):
            st = res[r][c][2]
            assert st["bytes_sent"] == expect and st["bytes_received"] == expect and st["n_calls"] == 1, (
                kind,
                mode,
                st,
                expect,
            )


def test_two_ranks():
    _check_world(2)


def test_three_ranks():
    _check_world(3)


def test_four_ranks_reduce_scatter():
    _check_world(4)


def _telescope(rank, world, steps, n, G):
    e = torch.zeros(n)
    outs = []
    for t in range(steps):
        x, _ = _inputs(rank, n, t)
        outs.append(quantized_allreduce(x, wire_of(dist.group.WORLD), "int4", G, error=e, step=t))
    return (outs, e)


def test_error_feedback_telescopes():
    world, steps, n, G = 2, 6, 640, 32
    res = run_ranks(world, _telescope, steps, n, G)
    sent_total = world * sum(res[0][0])  # Σ_t Σ_r sent_{r,t}
    x_total = sum(_inputs(r, n, t)[0] for r in range(world) for t in range(steps))
    e_final = sum(res[r][1] for r in range(world))
    torch.testing.assert_close(sent_total, x_total - e_final, rtol=0, atol=1e-4)
    # the residual stays bounded by one quantization step instead of growing with t
    assert e_final.abs().max() < 0.5 * max(_inputs(0, n, 0)[0].abs().max(), 1.0)


def test_single_rank_group_quantizes_locally():
    x, e = _inputs(0, 300)
    e0 = e.clone()
    st = CommStats()
    y = quantized_allreduce(x, None, "int4", 32, error=e, stats=st)
    assert torch.equal(y, dequantize(quantize(x, "int4", 32, error=e0)))
    assert torch.equal(e, e0) and st.bytes_sent == 0 and st.n_calls == 1


# ----------------------------------------------------------------------------- CocktailSGD


def _cocktail(rank, world, cases, steps):
    from dilocox.compress.cocktail import cocktail_allreduce

    out = []
    for cfg, sizes in cases:
        n = sum(sizes)
        e = _inputs(rank, n)[1]
        per = []
        for t in range(steps):
            g = _inputs(rank, n, t + 1)[0]
            st = CommStats()
            wire = wire_of(dist.group.WORLD)
            y = cocktail_allreduce(g, wire, e, cfg, t, st, seed=9, sizes=sizes if len(sizes) > 1 else None)
            per.append((y, e.clone(), st.as_dict()))
        out.append(per)
    return out


def _cocktail_reference(world, cfg, sizes, steps):
    """Per tensor (segment) s: K_s mask survivors, top-k_s of them, int4 of those k_s values alone."""
    from dilocox.compress.cocktail import shared_mask

    n = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    errs = [_inputs(r, n)[1] for r in range(world)]
    outs = []
    for t in range(steps):
        mask = shared_mask(n, cfg.random_fraction, 9, t, torch.device("cpu"), sizes if len(sizes) > 1 else None)
        assert torch.all(mask[1:] > mask[:-1])  # sorted, unique
        segs = []  # (start, kept indices inside the segment, k_s)
        for s0, ns in zip(starts, sizes):
            m = mask[(mask >= s0) & (mask < s0 + ns)] - s0
            K = max(1, math.ceil(cfg.random_fraction * ns))
            # stratified: exactly one kept index in each of the segment's K strata [⌊jn/K⌋, ⌊(j+1)n/K⌋)
            j = torch.arange(K)
            assert m.numel() == K and torch.all(m >= j * ns // K) and torch.all(m < (j + 1) * ns // K)
            segs.append((s0, m, math.ceil(cfg.topk_fraction * K)))
        assert mask.numel() == sum(m.numel() for _, m, _ in segs)
        total = torch.zeros(n)
        for r in range(world):
            v = _inputs(r, n, t + 1)[0] + errs[r]
            dense = torch.zeros(n)
            for s0, m, k in segs:
                surv = v[s0 + m]
                top = torch.sort(torch.topk(surv.abs(), k).indices).values
                vals = surv[top]
                dense[s0 + m[top]] = (
                    vals if cfg.quant == "none" else dequantize(quantize(vals.contiguous(), cfg.quant, cfg.group_size))
                )
            total += dense
            errs[r] = v - dense
        K, ks = mask.numel(), [k for _, _, k in segs]
        outs.append((total / world, [e.clone() for e in errs], K, ks))
    return outs


def test_cocktail_matches_reference_and_counts_bytes():
    from dilocox.compress.cocktail import cocktail_payload_bytes

    steps, world = 3, 2
    tensors = [3000, 40, 1, 517, 12000, 64]  # per-tensor masks, top-k and quantization groups
    cases = [
        (CompressConfig(quant="int4", random_fraction=0.1, topk_fraction=0.08), [20000]),  # bitmap indices
        (
            CompressConfig(quant="int4", group_size=32, random_fraction=0.1, topk_fraction=0.01),
            [20000],
        ),  # int32 indices
        (CompressConfig(quant="int4", group_size=32, random_fraction=0.1, topk_fraction=0.08), tensors),
        (CompressConfig(quant="none", random_fraction=0.1, topk_fraction=0.08), tensors),
    ]
    res = run_ranks(world, _cocktail, cases, steps)
    for c, (cfg, sizes) in enumerate(cases):
        ref = _cocktail_reference(world, cfg, sizes, steps)
        for t in range(steps):
            want, errs, K, ks = ref[t]
            for r in range(world):
                y, e, st = res[r][c][t]
                assert torch.equal(y, res[0][c][t][0])
                torch.testing.assert_close(y, want, rtol=0, atol=1e-6)
                torch.testing.assert_close(e, errs[r], rtol=0, atol=1e-6)
                idx_bytes = min(math.ceil(K / 8), 4 * sum(ks))
                vals = sum(_payload(cfg.quant, k, cfg.group_size) for k in ks)  # each tensor's values quantized alone
                payload = cocktail_payload_bytes(
                    sizes if len(sizes) > 1 else sizes[0],
                    cfg.random_fraction,
                    cfg.topk_fraction,
                    cfg.quant,
                    cfg.group_size,
                )
                assert st["bytes_sent"] == (world - 1) * (idx_bytes + vals) == (world - 1) * payload
    # compression ratio near the analytic bits/element: p·1 (bitmap) + p·t·(4 + 16/G)
    cfg, n = cases[0][0], 20000
    ratio = 4 * n / cocktail_payload_bytes(n, cfg.random_fraction, cfg.topk_fraction, "int4", cfg.group_size)
    analytic = 32 / (cfg.random_fraction * (1 + cfg.topk_fraction * (4 + 16 / cfg.group_size)))
    assert abs(ratio / analytic - 1) < 0.02, (ratio, analytic)
    assert ratio > 200
