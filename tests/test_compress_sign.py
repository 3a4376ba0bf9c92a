"""compress.sign (dilocox/compress/sign.py): the codec protocol's smallest codec, against its plain reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dilocox.compress.codec import Codec, RankAdaptive, rank_of
from dilocox.compress.collectives import CommStats
from dilocox.compress.compressor import build_compressor
from dilocox.compress.sign import SignCodec, encode, message_bytes, reference_decode, reference_encode
from dilocox.config import ConfigError, load_config
from dilocox.distributed.wire import wire_of
from tests.spawn import run_ranks
from tests.test_train import _assert_resume_exact, _train_and_resume, tiny_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [torch.Size([40, 24]), torch.Size([7]), torch.Size([300])]  # blocks of 64: 15, 1 (short), 5 (short last)


def _sign_cfg(block=64):
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--compress.sign.enabled=true"])
    cfg.compress.sign.block = block
    return cfg.compress


@pytest.mark.parametrize("n,block", [(1, 8), (64, 64), (1000, 64), (257, 256), (4099, 128)])
def test_encode_and_decode_equal_the_reference(n, block):
    g = torch.Generator().manual_seed(n)
    m = torch.randn(n, generator=g) * torch.linspace(0.01, 4.0, n)
    m[::17] = 0.0  # sign(0) = +1
    payload = encode(m, block)
    assert payload.numel() == message_bytes(n, block)
    assert bytes(payload.tolist()) == reference_encode(m.tolist(), block)
    from dilocox.compress.sign import decode

    assert decode(payload, n, block).tolist() == reference_decode(bytes(payload.tolist()), n, block)


def test_the_registry_builds_it_and_it_is_a_codec():
    codec = build_compressor(_sign_cfg(), SHAPES, seed=0)
    assert isinstance(codec, SignCodec) and isinstance(codec, Codec) and not isinstance(codec, RankAdaptive)
    assert rank_of(codec) == 0 and codec.lossy
    assert codec.payload_bytes() == (15 + 1 + 5) * (4 + 8)
    assert codec.wire_bytes(3) == 2 * codec.payload_bytes() and codec.wire_bytes(1) == 0


def _inputs(rank, t):
    g = torch.Generator().manual_seed(100 * t + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _mean_over_ranks(rank, world, block, steps):
    codec = SignCodec(SHAPES, block)
    wire, out = wire_of(dist.group.WORLD), []
    for t in range(steps):
        st = CommStats()
        res = codec.allreduce_mean(_inputs(rank, t), wire, t, st)
        out.append((res, [e.clone() for e in codec.errors], st.bytes_sent))
    return out


def test_the_mean_over_three_ranks_equals_the_reference_rank_by_rank():
    """Every rank gets the same bits: the mean of the reference-decoded messages of the ranks (in rank order), and
    keeps its own residual m - sent as error feedback, sync after sync."""
    world, block, steps = 3, 64, 3
    res = run_ranks(world, _mean_over_ranks, block, steps)
    errors = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    for t in range(steps):
        total = [torch.zeros(s.numel(), dtype=torch.float64) for s in SHAPES]
        sent_sum = [torch.zeros(s.numel()) for s in SHAPES]
        for r in range(world):
            for i, (x, e) in enumerate(zip(_inputs(r, t), errors[r])):
                m = (x + e).reshape(-1)
                sent = torch.tensor(reference_decode(reference_encode(m.tolist(), block), m.numel(), block))
                sent_sum[i] = sent_sum[i] + sent  # (fp32, in rank order, as the codec sums)
                total[i] += sent.double()
                errors[r][i] = (m - sent).view(SHAPES[i])
        for r in range(world):
            got, err, sent_bytes = res[r][t]
            assert sent_bytes == (world - 1) * sum(message_bytes(s.numel(), block) for s in SHAPES)
            for i in range(len(SHAPES)):
                assert torch.equal(got[i].reshape(-1), sent_sum[i] / world), (t, r, i)
                assert torch.equal(got[i], res[0][t][0][i])  # bit-identical on every rank
                assert torch.allclose(got[i].reshape(-1).double(), total[i] / world, atol=1e-6)
                assert torch.equal(err[i], errors[r][i]), (t, r, i)


def test_one_member_applies_the_same_round_trip_and_state_round_trips():
    a, b = SignCodec(SHAPES, 64), SignCodec(SHAPES, 64)
    out = a.allreduce_mean(_inputs(0, 0), None, 0)
    m0 = _inputs(0, 0)[0].reshape(-1)
    assert out[0].reshape(-1).tolist() == reference_decode(reference_encode(m0.tolist(), 64), m0.numel(), 64)
    b.load_state_dict(a.state_dict())
    x = _inputs(0, 1)
    assert all(torch.equal(p, q) for p, q in zip(a.allreduce_mean(x, None, 1), b.allreduce_mean(x, None, 1)))


@pytest.mark.parametrize(
    "overrides,msg",
    [
        (["--compress.sign.enabled=true", "--compress.sign.block=12"], "compress.sign.block=12"),
        (["--compress.sign.enabled=true", "--compress.quant=int4"], "set compress.quant=none"),
        (["--compress.sign.enabled=true", "--compress.sparse.enabled=true"], "enable one codec"),
        (["--compress.sign.enabled=true", "--outer.method=cocktailsgd"], "not outer.method='cocktailsgd'"),
    ],
)
def test_config_refusals_name_the_field(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--outer.method=diloco", *overrides])


def _sign_run(rank, world, tmp, extra, steps, stop):
    from dilocox.train import Trainer

    t = Trainer(tiny_cfg(f"{tmp}/probe", *extra, "--checkpoint.resume=none", steps=1))
    codecs = t.outer.compressors
    del t
    return type(codecs[0]).__name__, len(codecs), _train_and_resume(rank, world, tmp, extra, steps, stop)


def test_two_replicas_train_and_resume_exactly(tmp_path):
    """The codec in a real run: 2 replicas of DiLoCo with sign-compressed syncs (the trainer built a SignCodec per
    fragment); a run stopped and resumed follows the uninterrupted one bit for bit (the error buffers are in the
    checkpoint)."""
    extra = ["--parallel.replicas=2", "--outer.method=diloco", "--outer.sync_every=3", "--compress.sign.enabled=true"]
    res = run_ranks(2, _sign_run, str(tmp_path), extra, 8, 4)
    assert [(name, n) for name, n, _ in res] == [("SignCodec", 1)] * 2
    _assert_resume_exact([r for _, _, r in res])
