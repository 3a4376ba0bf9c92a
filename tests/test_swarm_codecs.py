"""Structured activation codecs (issue 24): the subspace-constrained model (dilocox/model/subspace.py) and the
``subspace*`` / ``colk*`` / ``int4`` codecs of dilocox/swarm/activations.py against plain references, their wire
bytes, the headers a receiver refuses, and the dense export of a subspace model."""

import dataclasses
import math

import pytest
import torch

from dilocox.config import ConfigError, ModelConfig, load_config
from dilocox.config.checks import _CHOICES
from dilocox.model import build_model, build_stage_model
from dilocox.model.subspace import basis, dense_state_dict, stream_base
from dilocox.swarm import activations as A

M = ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=256, max_seq_len=32, subspace_rank=8)


def _tokens(b=2, s=16, seed=0):
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


def _codec(kind, m=M, block=64, frac=0.125):
    structure = A.split_codec(kind)[0]
    return A.ActCodec(
        kind,
        m.d_model,
        block,
        k=m.subspace_rank if structure == "subspace" else 0,
        cols=A.colk_columns(m.d_model, frac) if structure == "colk" else 0,
        mcfg=m,
        max_tokens=64,
    )


def _stages(m=M, seed=3):
    return [build_stage_model(m, stage=j, n_stages=2, seed=seed) for j in range(2)]


def test_config_lists_every_codec_and_refuses_a_subspace_codec_without_the_constraint(tmp_path):
    assert _CHOICES["swarm.activations"] == A.CODECS
    with pytest.raises(ConfigError, match=r"swarm.activations.*model.subspace_rank"):
        load_config(None, ["--swarm.activations=subspace-int4"])
    with pytest.raises(ConfigError, match="model.dropout"):
        load_config(None, ["--model.subspace_rank=8", "--model.dropout=0.1"])
    with pytest.raises(ConfigError, match="model.subspace_rank"):
        load_config(None, ["--model.subspace_rank=128"])  # = d_model
    with pytest.raises(ConfigError, match="swarm.activation_block"):
        load_config(None, ["--swarm.activations=int4", "--swarm.activation_block=63"])
    cfg = load_config(None, ["--model.subspace_rank=8", "--swarm.activations=subspace-int4"])
    assert cfg.model.num_params() == sum(p.numel() for p in build_model(cfg.model).parameters())
    # 4 layers, 2 stages: the 2 layers before the boundary must be constrained
    two = ["--model.subspace_rank=8", "--swarm.activations=subspace", "--swarm.peers_per_stage=[2,2]"]
    with pytest.raises(ConfigError, match=r"model.subspace_layers=1 must be >= 2"):
        load_config(None, [*two, "--model.n_layers=4", "--model.subspace_layers=1"])
    cfg = load_config(None, [*two, "--model.n_layers=4", "--model.subspace_layers=2"])
    assert cfg.model.num_params() == sum(p.numel() for p in build_model(cfg.model).parameters())
    with pytest.raises(ConfigError, match="model.subspace_layers"):
        load_config(None, ["--model.subspace_rank=8", "--model.n_layers=4", "--model.subspace_layers=5"])


def test_the_residual_stream_stays_in_x0_plus_the_subspace():
    tok = _tokens()
    s0, _ = _stages()
    with torch.no_grad():
        h = s0(tok)
    r = (h - stream_base(M, tok)).reshape(-1, M.d_model)
    U = basis(M.d_model, M.subspace_rank)
    off = r - (r @ U) @ U.T  # the part outside span(U)
    assert float(r.norm()) > 0.1  # the blocks wrote something
    assert float(off.norm()) < 1e-5 * float(r.norm())
    torch.testing.assert_close(U.T @ U, torch.eye(M.subspace_rank), atol=1e-6, rtol=0)
    # the same check fails for the plain model: the constraint is what makes it hold
    plain = build_stage_model(dataclasses.replace(M, subspace_rank=0), stage=0, n_stages=2, seed=3)
    with torch.no_grad():
        rp = plain(tok).reshape(-1, M.d_model)
    assert float((rp - (rp @ U) @ U.T).norm()) > 0.5 * float(rp.norm())


def _two_stage_grads(stages, tok, codec=None):
    """Loss and parameter grads of the 2-stage model, the boundary through ``codec`` both ways (or direct)."""
    for s in stages:
        s.zero_grad(set_to_none=True)
    y = stages[0](tok)
    if codec is None:
        loss = stages[1].loss(stages[1](y), tok.roll(-1, 1))
        loss.backward()
    else:
        payload, meta = codec.encode(y, tok if codec.needs_tokens else None)
        x = codec.decode(payload, meta, tok if codec.needs_tokens else None).requires_grad_(True)
        loss = stages[1].loss(stages[1](x), tok.roll(-1, 1))
        loss.backward()
        gp, gm = codec.encode(x.grad)
        y.backward(codec.decode(gp, gm))
    grads = {f"{j}.{n}": p.grad.clone() for j, s in enumerate(stages) for n, p in s.named_parameters()}
    return float(loss.detach()), grads


@pytest.mark.parametrize("layers", [None, 1])
def test_subspace_codec_is_exact_for_the_constrained_model_both_ways(layers):
    """fp32 coefficients: loss and EVERY parameter gradient of both stages as without the codec, with d/k = 8x
    fewer values each way; the same codec on the plain model is lossy (the test can fail). ``layers=1``: only the
    layer before the boundary is constrained (model.subspace_layers), the last stage's layer writes full-rank."""
    tok = _tokens()
    codec = _codec("subspace")
    m = dataclasses.replace(M, subspace_layers=layers)
    stages = _stages(m)
    if layers == 1:
        assert stages[1].layers["1"].mlp.down_proj.weight.shape[0] == M.d_model  # not constrained
        assert stages[0].layers["0"].mlp.down_proj.weight.shape[0] == M.subspace_rank
    l0, g0 = _two_stage_grads(stages, tok)
    l1, g1 = _two_stage_grads(stages, tok, codec)
    assert abs(l0 - l1) < 1e-5
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
    assert codec.wire_bytes(tok.numel()) == 4 * tok.numel() * M.subspace_rank  # vs 4 * d per token
    plain = _stages(dataclasses.replace(M, subspace_rank=0))
    _, p0 = _two_stage_grads(plain, tok)
    _, p1 = _two_stage_grads(plain, tok, codec)
    assert max(float((p1[n] - p0[n]).norm() / (p0[n].norm() + 1e-12)) for n in p0) > 0.1


def test_subspace_code_matches_the_plain_reference():
    g = torch.Generator().manual_seed(1)
    tok = _tokens(2, 8)
    x = stream_base(M, tok) + torch.randn(2, 8, M.d_model, generator=g)  # not in the subspace: a projection
    codec = _codec("subspace")
    U = basis(M.d_model, M.subspace_rank)
    for tokens, base in ((tok, stream_base(M, tok)), (None, None)):  # an activation, a gradient
        y = codec.decode(*codec.encode(x, tokens), tokens)
        ref = A.subspace_reference(x, U, base)
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("values,levels", [("int8", 127), ("int4", 7)])
def test_subspace_with_quantized_coefficients_is_within_the_blockwise_bound(values, levels):
    tok = _tokens()
    s0, _ = _stages()
    with torch.no_grad():
        y = s0(tok)
    exact = _codec("subspace")
    q = _codec(f"subspace-{values}", block=64)
    c = (y - stream_base(M, tok)).reshape(-1, M.d_model) @ basis(M.d_model, M.subspace_rank)
    err = (q.decode(*q.encode(y, tok), tok) - exact.decode(*exact.encode(y, tok), tok)).reshape(-1, M.d_model)
    # per block of 64 coefficients (8 tokens x k=8): |dc| <= absmax / (2 levels) (1 + 2^-8); U has orthonormal
    # columns, so a token's error norm is its coefficients' error norm <= sqrt(k) x that
    flat = c.reshape(-1)
    for t in range(err.shape[0]):
        blk = flat[(t * 8) // 64 * 64 : (t * 8) // 64 * 64 + 64]
        bound = float(blk.abs().max()) / (2 * levels) * (1 + 2**-8) * math.sqrt(M.subspace_rank) + 1e-6
        assert float(err[t].norm()) <= bound, (t, float(err[t].norm()), bound)
    assert float(err.abs().max()) > 0  # it quantized
    n = tok.numel() * M.subspace_rank
    bits = {"int8": 8, "int4": 4}[values]
    assert q.wire_bytes(tok.numel()) == n * bits // 8 + 2 * -(-n // 64)


def test_colk_keeps_the_largest_columns_exactly_and_matches_the_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 64, generator=g)
    x[..., 7] *= 30.0
    x[..., [20, 21]] = 5.0  # a tie: the lower index wins
    codec = _codec("colk", frac=0.125)  # 8 of 64 columns
    payload, meta = codec.encode(x)
    assert payload.numel() == codec.wire_bytes(32) == 4 * 8 + 4 * 32 * 8
    y = codec.decode(payload, meta)
    keep = A.colk_select_reference(x, 8)
    assert A.colk_select(x, 8).tolist() == keep and 7 in keep
    assert torch.equal(y[..., keep], x[..., keep])
    rest = [j for j in range(64) if j not in keep]
    assert torch.count_nonzero(y[..., rest]) == 0
    tie = torch.zeros(1, 4, 6)
    tie[..., [1, 4]] = 1.0
    assert A.colk_select(tie, 1).tolist() == A.colk_select_reference(tie, 1) == [1]
    q = _codec("colk-int8")
    yq = q.decode(*q.encode(x))
    assert torch.count_nonzero(yq[..., rest]) == 0
    assert float((yq[..., keep] - x[..., keep]).abs().max()) <= float(x[..., keep].abs().max()) / 254 * 1.01


@pytest.mark.parametrize("kind", A.CODECS)
def test_wire_bytes_equal_the_payload_of_every_codec(kind):
    tok = _tokens()
    s0, _ = _stages()
    with torch.no_grad():
        y = s0(tok)
    codec = _codec(kind)
    payload, meta = codec.encode(y, tok if codec.needs_tokens else None)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == codec.wire_bytes(tok.numel())
    back = codec.decode(payload, A.ActMeta.from_dict(meta.to_dict()), tok if codec.needs_tokens else None)
    assert back.shape == y.shape and back.dtype == y.dtype


def test_a_receiver_refuses_headers_that_do_not_fit_the_run_before_allocating():
    codec = _codec("subspace-int4")
    tok = _tokens(2, 16)
    y = stream_base(M, tok)
    payload, meta = codec.encode(y, tok)
    bad = [
        (dataclasses.replace(meta, kind="subspace-int8"), payload, "every peer of a run"),
        (dataclasses.replace(meta, shape=(10**6, 1000, 64)), payload, "at most 64"),
        (dataclasses.replace(meta, shape=(2, 16, 65)), payload, "d_model=64"),
        (meta, payload[:-1], "bytes"),
        (dataclasses.replace(meta, dtype="object"), payload, "dtype"),
    ]
    for m, p, msg in bad:
        with pytest.raises(ValueError, match=msg):
            codec.decode(p, m, tok)
    colk = _codec("colk")
    p, m = colk.encode(torch.randn(2, 16, 64))
    p = p.clone()
    p[:4] = torch.tensor([255, 0, 0, 0], dtype=torch.uint8)  # index 255 of 64
    with pytest.raises(ValueError, match="column indices"):
        colk.decode(p, m)
    ids = A.pack_ids(tok, tok, 256)
    assert ids.dtype == torch.uint8 and torch.equal(A.check_ids(ids, 256, 64)[0], tok)
    torch.testing.assert_close(codec.receive(payload, meta.to_dict(), ids), codec.decode(payload, meta, tok))
    with pytest.raises(ValueError, match="came with 16 token ids"):  # the ids of another microbatch shape
        codec.receive(payload, meta.to_dict(), A.pack_ids(tok[:1], tok[:1], 256))
    with pytest.raises(ValueError, match="at most 16"):
        A.check_ids(ids, 256, 16)
    with pytest.raises(ValueError, match="uint8"):
        A.check_ids(ids.long(), 256, 64)
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        A.check_ids(A.pack_ids(tok, tok, 100).to(torch.uint8), 100, 64)
    assert A.ids_dtype(50304) == torch.int32 and A.ids_dtype(32000) == torch.int16


@pytest.mark.parametrize("layers", [None, 1])
def test_dense_state_dict_is_the_same_function_as_the_subspace_model(layers):
    """HF export of a subspace model (item 2): the dense weights (W = U A, wte = E0 + B U^T, ...) in the plain
    model give the subspace model's logits (``layers``: model.subspace_layers)."""
    m = build_model(dataclasses.replace(M, subspace_layers=layers), seed=5)
    with torch.no_grad():  # trained-looking weights: biases and all parameters away from their init
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    dense_cfg = dataclasses.replace(M, subspace_rank=0)
    plain = build_model(dense_cfg, device="meta")
    plain.to_empty(device="cpu")
    plain.load_full_state_dict(dense_state_dict(m.mcfg, m.gather_full_state_dict()))
    tok = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(plain(tok), m(tok), rtol=1e-4, atol=1e-5)
