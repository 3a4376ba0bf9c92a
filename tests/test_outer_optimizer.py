"""The outer optimizer seam (issue 43): ``dilocox.optim.OuterSGD`` and ``build_outer_optimizer`` behind
``outer.state.OuterState``, against the rule of ALGORITHMS §1 written out and against torch's own optimizers."""

from __future__ import annotations

import pytest
import torch

from dilocox.config import ConfigError, load_config
from dilocox.config.sections import OuterConfig
from dilocox.optim import OuterSGD, build_outer_optimizer
from dilocox.outer.state import OuterState


def _hand_rule(theta: torch.Tensor, v: torch.Tensor, g: torch.Tensor, lr: float, mu: float, nesterov: bool) -> None:
    """ALGORITHMS §1 on flat tensors, as outer/state.py wrote it before the seam."""
    v.mul_(mu).add_(g)
    if nesterov:
        theta.sub_(g.add(v, alpha=mu), alpha=lr)
    else:
        theta.sub_(v, alpha=lr)


SHAPES = [(6, 4), (4,), (3, 5, 2), (7,)]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("mu,nesterov", [(0.9, True), (0.5, False), (0.0, True), (0.0, False)])
def test_outer_sgd_is_the_rule_bit_for_bit(mu, nesterov):
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    n = sum(t.numel() for t in init)
    theta, v = torch.cat([t.reshape(-1) for t in init]), torch.zeros(n)  # the hand rule's flat buffers
    flat_theta, flat_v = theta.clone(), torch.zeros(n)  # OuterSGD's, as views of a flat buffer (OuterState's layout)
    views, vbufs, pos = [], [], 0
    for s in SHAPES:
        k = torch.Size(s).numel()
        views.append(flat_theta[pos : pos + k].view(s))
        vbufs.append(flat_v[pos : pos + k].view(s))
        pos += k
    opt = OuterSGD(views, lr=0.7, momentum=mu, nesterov=nesterov, momentum_buffers=vbufs)
    ref = [t.clone() for t in init]
    torch_opt = torch.optim.SGD(ref, lr=0.7, momentum=mu, nesterov=nesterov) if mu > 0 else None
    for step in range(5):
        gs = _grads(step)
        _hand_rule(theta, v, torch.cat([g.reshape(-1) for g in gs]), 0.7, mu, nesterov)
        for t, g in zip(views, gs):
            t.grad = g.clone()
        opt.step()
        assert torch.equal(flat_theta, theta) and torch.equal(flat_v, v), step
        if torch_opt is not None:
            for t, g in zip(ref, gs):
                t.grad = g.clone()
            torch_opt.step()
            assert torch.equal(torch.cat([t.reshape(-1) for t in ref]), theta), step


def test_outer_state_steps_one_fragment_and_keeps_v_flat():
    torch.manual_seed(1)
    params = [torch.randn(s) for s in SHAPES]
    st = OuterState(params, [[0, 2], [1, 3]], lr=0.5, momentum=0.9, nesterov=True)
    before = st.theta.clone()
    s, e = st.bounds[1]
    g = torch.randn(e - s)
    st.outer_step(1, g)
    theta, v = before.clone(), torch.zeros_like(before)
    _hand_rule(theta[s:e], v[s:e], g, 0.5, 0.9, True)
    assert torch.equal(st.theta, theta) and torch.equal(st.momentum, v)
    assert torch.equal(st.theta[: st.bounds[0][1]], before[: st.bounds[0][1]])  # fragment 0 untouched
    assert all(t.grad is None for t in st._views.values())  # no gradient left behind
    assert "optimizer" not in st.state_dict()  # SGD's whole state is the flat v


def _named_shard():
    torch.manual_seed(2)
    named = [("layers.0.w", torch.randn(8, 6)), ("layers.0.b", torch.randn(8)), ("head.w", torch.randn(3, 8))]
    return named, [[0, 1], [2]]


def _muon_state(named, frags):
    o = OuterConfig(lr=0.3, momentum=0.9, optimizer="muon")
    names = [n for n, _ in named]

    def make(order, ts, vs):
        return build_outer_optimizer(o, [(names[i], t) for i, t in zip(order, ts)], vs)

    return OuterState([t.clone() for _, t in named], frags, make_optimizer=make)


def test_muon_outer_matches_torch_muon_and_resumes():
    """outer.optimizer=muon: Muon on the block matrix, SGD on the rest, equal to torch's own; the state_dict holds
    Muon's momentum and a reload continues bit for bit."""
    named, frags = _named_shard()
    st = _muon_state(named, frags)
    mat, vec, head = (t.clone() for _, t in named)
    muon = torch.optim.Muon(
        [mat], lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"
    )
    sgd = torch.optim.SGD([vec, head], lr=0.3, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        for p in range(2):
            s, e = st.bounds[p]
            g = torch.randn(e - s, generator=gen)
            st.outer_step(p, g)
            ref = [mat, vec] if p == 0 else [head]
            for t, gg in zip(ref, st._split(g, p)):
                t.grad = gg.clone()
            muon.step()
            sgd.step()
            for t in ref:
                t.grad = None
        got = [st.view(st.theta, i) for i in range(3)]
        assert torch.allclose(got[0], mat, atol=1e-6) and torch.equal(got[1], vec) and torch.equal(got[2], head)
    sd = st.state_dict()
    assert sd["optimizer"]["state"], "Muon's momentum is saved"
    again = _muon_state(named, frags)
    again.load_state_dict(sd)
    g = torch.randn(st.bounds[0][1], generator=gen)
    st.outer_step(0, g)
    again.outer_step(0, g.clone())
    assert torch.equal(st.theta, again.theta) and torch.equal(st.momentum, again.momentum)
    with pytest.raises(ValueError, match="different outer.optimizer"):
        OuterState([t.clone() for _, t in named[:1]], [[0]]).load_state_dict(
            {**sd, "theta": sd["theta"][:48], "momentum": sd["momentum"][:48], "optimizer": {"state": {5: {}}}}
        )


def test_a_live_join_carries_muons_state():
    """What a live join's snapshot holds of the outer optimizer (``optimizer_extra(copy=False)``: the live tensors,
    str keys for the heal's JSON skeleton), loaded with θ and v into a fresh shard, makes the next outer step equal
    the source's; without it (Muon's momentum restarting from zero, what a heal of θ and v alone gave) it differs."""
    named, frags = _named_shard()
    src = _muon_state(named, frags)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        src.outer_step(0, torch.randn(src.bounds[0][1], generator=gen))
    extra = src.optimizer_extra(copy=False)
    assert extra is not None and all(isinstance(k, str) for k in extra["state"])
    live = next(iter(next(iter(extra["state"].values())).values()))
    assert any(live is v for st in src.optimizer.state.values() for v in st.values())  # not a copy
    healed, theta_v_only = _muon_state(named, frags), _muon_state(named, frags)
    for st in (healed, theta_v_only):
        st.theta.copy_(src.theta)
        st.momentum.copy_(src.momentum)
    healed.load_optimizer_extra(extra)
    g = torch.randn(src.bounds[0][1], generator=gen)
    for st in (src, healed, theta_v_only):
        st.outer_step(0, g.clone())
    assert torch.equal(healed.theta, src.theta)
    assert not torch.equal(theta_v_only.theta, src.theta)
    healed.load_optimizer_extra(None)  # a heal from a source without any: nothing of the old trajectory is kept
    assert healed.optimizer_extra() is None


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["--outer.optimizer=adam"], "must be one of"),
        (["--outer.optimizer=muon", "--parallel.tensor=2"], "parallel.tensor=2"),
        (
            ["--outer.optimizer=muon", "--outer.streaming.tau=0", "--outer.overlap=delayed", "--outer.lookahead=1"],
            "outer.lookahead",
        ),
        (["--outer.optimizer=muon", "--outer.method=allreduce"], "outer.method='allreduce'"),
    ],
)
def test_outer_optimizer_config_is_checked(overrides, match):
    with pytest.raises(ConfigError, match="outer.optimizer") as e:
        load_config("configs/tiny-dilocox.yaml", overrides)
    assert match in str(e.value)


def _single_replica(steps: int, lr_factor=None, **outer) -> dict:
    """One replica of the oracle's TinyNet under DiLoCoOuter (H = 4, overlap none) with ``lr_factor``."""
    from dilocox.config import CompressConfig, OuterConfig
    from dilocox.outer import build_outer
    from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model

    model = make_model(7)
    opt = make_inner_opt(model)
    ocfg = OuterConfig(method="diloco", sync_every=4, overlap="none", **outer)
    loop = build_outer(list(model.named_parameters()), None, ocfg, CompressConfig(), 7, layer_of=layer_of)
    loop.lr_factor = lr_factor
    for step in range(steps):
        forward_backward(model, 7, 0, step)
        opt.step()
        opt.zero_grad()
        loop.after_inner_step(step)
    loop.finish()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_outer_lr_schedule_scales_every_outer_step_by_the_factor_of_its_step():
    """outer.lr_schedule=inner: the outer step after inner step s is taken at lr x factor(s). A constant factor equals
    the oracle at that lr; a factor that drops to 0 after step 7 leaves θ where the sync at step 8 put it."""
    from tests.reference_diloco import run_reference

    half = _single_replica(12, lambda s: 0.5)
    ref = run_reference(1, 12, 7, 4, lr=0.35)
    assert all(torch.equal(half[n], ref[0][n]) for n in half)
    cut = _single_replica(12, lambda s: 1.0 if s < 8 else 0.0)
    at8 = run_reference(1, 8, 7, 4)
    assert all(torch.equal(cut[n], at8[0][n]) for n in cut)
    assert not all(torch.equal(cut[n], v) for n, v in _single_replica(12).items())


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["--outer.lr_schedule=cosine"], "must be constant or inner"),
        (["--outer.lr_schedule=inner", "--outer.method=allreduce"], "outer.method='allreduce'"),
    ],
)
def test_outer_lr_schedule_config_is_checked(overrides, match):
    with pytest.raises(ConfigError, match="outer.lr_schedule") as e:
        load_config("configs/tiny-dilocox.yaml", overrides)
    assert match in str(e.value)
