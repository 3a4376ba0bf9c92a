"""dilocox/optim.py: the one inner-optimizer builder. optim.name=muon is torch's Muon on the blocks' hidden
matrices and AdamW on the rest, seen as one optimizer (schedule, checkpoints)."""

import copy
import os

import pytest
import torch

from dilocox.config import ConfigError, load_config
from dilocox.model import build_model
from dilocox.optim import MuonAdamW, build_inner_optimizer, is_muon_param, param_order, set_lr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(*extra):
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--model.n_layers=2", "--model.d_model=64", *extra])


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 256, (2, 16), generator=g)
    return model(tok).float().logsumexp(-1).mean()


def _steps(model, opt, seeds):
    for s in seeds:
        opt.zero_grad()
        _loss(model, s).backward()
        opt.step()


def test_muon_groups_split_hidden_matrices_from_the_rest():
    cfg = _cfg("--optim.name=muon")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_inner_optimizer(cfg, model, torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for p in opt._muon.param_groups[0]["params"]]
    adamw = [names[id(p)] for g in opt._adamw.param_groups for p in g["params"]]
    assert muon and all(n.startswith("layers.") and n.endswith("weight") for n in muon)
    assert "embed.weight" in adamw and not any(is_muon_param(n, True) for n in adamw if n.startswith("embed"))
    assert sorted(muon + adamw) == sorted(names.values())
    order = param_order([(n, p.dim() >= 2) for n, p in model.named_parameters()], "muon")
    assert [n for g in order for n in g] == muon + adamw  # the state's index order
    set_lr(opt, 0.123)
    assert all(g["lr"] == 0.123 for g in opt._muon.param_groups + opt._adamw.param_groups)


def test_muon_composite_equals_torch_muon_and_adamw_side_by_side():
    cfg = _cfg("--optim.name=muon", "--optim.lr=0.01")
    torch.manual_seed(0)
    a = build_model(cfg.model)
    b = copy.deepcopy(a)
    opt_a = build_inner_optimizer(cfg, a, torch.device("cpu"))
    names = [[dict(b.named_parameters())[n] for n in g] for g in param_order(
        [(n, p.dim() >= 2) for n, p in b.named_parameters()], "muon")]  # fmt: skip
    o = cfg.optim
    m = torch.optim.Muon([{"params": names[0], "weight_decay": o.weight_decay}], lr=o.lr, momentum=o.muon_momentum,
                         adjust_lr_fn="match_rms_adamw")  # fmt: skip
    w = torch.optim.AdamW([{"params": names[1], "weight_decay": o.weight_decay}, {"params": names[2],
                          "weight_decay": 0.0}], lr=o.lr, betas=tuple(o.betas), eps=o.eps)  # fmt: skip
    for s in range(3):
        opt_a.zero_grad()
        _loss(a, s).backward()
        opt_a.step()
        m.zero_grad()
        w.zero_grad()
        _loss(b, s).backward()
        m.step()
        w.step()
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), n
    start = build_model(cfg.model)
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), start.parameters()))


def test_muon_state_dict_round_trip_is_exact():
    cfg = _cfg("--optim.name=muon", "--optim.lr=0.01")
    torch.manual_seed(1)
    model = build_model(cfg.model)
    opt = build_inner_optimizer(cfg, model, torch.device("cpu"))
    _steps(model, opt, [0, 1])
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    opt2 = build_inner_optimizer(cfg, twin, torch.device("cpu"))
    opt2.load_state_dict(sd)
    assert "momentum_buffer" in sd["state"][0] and "exp_avg" in sd["state"][len(opt._muon.param_groups[0]["params"])]
    _steps(model, opt, [2, 3])
    _steps(twin, opt2, [2, 3])
    for x, y in zip(model.parameters(), twin.parameters()):
        assert torch.equal(x, y)
    set_lr(opt2, 0.5)  # after a load the two halves still see the schedule
    assert opt2._muon.param_groups[0]["lr"] == 0.5 and opt2._adamw.param_groups[1]["lr"] == 0.5


def test_muon_with_tensor_parallel_is_refused():
    with pytest.raises(ConfigError, match="optim.name.*parallel.tensor=2"):
        _cfg("--optim.name=muon", "--parallel.tensor=2")
