"""The inner schedule and step against a hand computation: ``lr_at`` reaches ``optim.lr * min_lr_ratio`` at the
last step (the decay ran over one step too many, so a short run ended well above the floor), and one trainer
step equals a plain PyTorch loop (own AdamW groups, own schedule, own clipping)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dilocox.config import load_config
from dilocox.optim import lr_at
from tests.small_run import small_cfg


def _hand_lr(step: int, lr: float, warm: int, total: int, ratio: float, sched: str) -> float:
    """Warm-up to lr at step warm-1; decay from lr at step warm to lr * ratio at step total-1."""
    if step < warm:
        return lr * (step + 1) / warm
    if sched == "constant" or total - 1 - warm <= 0:
        return lr
    frac = min(1.0, (step - warm) / (total - 1 - warm))
    floor = lr * ratio
    if sched == "linear":
        return floor + (lr - floor) * (1 - frac)
    return floor + (lr - floor) * (1 + math.cos(math.pi * frac)) / 2


@pytest.mark.parametrize("sched", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("steps,warm", [(1, 0), (2, 0), (4, 1), (10, 0), (10, 3), (21, 20), (5, 8), (30, 30)])
def test_lr_schedule_matches_the_hand_computation(sched, steps, warm):
    cfg = load_config(None, [f"--train.steps={steps}", f"--optim.warmup_steps={warm}", f"--optim.schedule={sched}",
                             "--optim.lr=0.5", "--optim.min_lr_ratio=0.2"])  # fmt: skip
    got = [lr_at(s, cfg) for s in range(steps)]
    assert got == pytest.approx([_hand_lr(s, 0.5, warm, steps, 0.2, sched) for s in range(steps)], rel=1e-12)
    if sched != "constant" and steps - warm >= 2:  # the config check's promise: the final lr is lr * min_lr_ratio
        assert got[-1] == pytest.approx(0.1, rel=1e-12)
        assert got[warm] == 0.5 and all(a >= b for a, b in zip(got[warm:], got[warm + 1 :]))


def _hand_wsd(step: int, lr: float, warm: int, total: int, ratio: float, share: float, sqrt: bool) -> float:
    """Warmup-stable-decay: held at lr over the first 1 - share of the steps after the warm-up, then the progress
    p through the last share goes 0 -> 1 and lr falls as 1 - p (or 1 - sqrt p) to lr * ratio."""
    if step < warm:
        return lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - 1 - warm))
    if frac <= 1 - share:
        return lr
    p = (frac - (1 - share)) / share
    return lr * ratio + (lr - lr * ratio) * (1 - (math.sqrt(p) if sqrt else p))


@pytest.mark.parametrize("sched", ["wsd", "wsd-sqrt"])
@pytest.mark.parametrize(
    "steps,warm,share",  # (11, 0, 0.2) ...: the last stable step sits exactly on 1 - share (it once dipped 1e-8 below)
    [(100, 10, 0.2), (21, 1, 0.5), (10, 0, 1.0), (7, 2, 0.1), (3, 0, 0.3), (11, 0, 0.2), (11, 0, 0.1), (12, 1, 0.2),
     (6, 0, 0.2), (31, 5, 0.4)],
)  # fmt: skip
def test_warmup_stable_decay_matches_the_hand_computation(sched, steps, warm, share):
    cfg = load_config(None, [f"--train.steps={steps}", f"--optim.warmup_steps={warm}", f"--optim.schedule={sched}",
                             "--optim.lr=0.5", "--optim.min_lr_ratio=0.2",
                             f"--optim.decay_fraction={share}"])  # fmt: skip
    got = [lr_at(s, cfg) for s in range(steps)]
    want = [_hand_wsd(s, 0.5, warm, steps, 0.2, share, sched == "wsd-sqrt") for s in range(steps)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[-1] == 0.5 * 0.2 and all(a >= b for a, b in zip(got[warm:], got[warm + 1 :]))  # the floor exactly
    held = sum(1 for g in got[warm:] if g == 0.5)  # the stable part: exactly the peak
    assert held == sum(1 for s in range(warm, steps) if (s - warm) / max(1, steps - 1 - warm) <= 1 - share)
    if steps == 100:  # 89 steps after the warm-up, the last 20 % cool down: steps 10..81 hold the peak
        assert held == 72


def test_wsd_with_decay_fraction_one_is_the_linear_schedule():
    base = ["--train.steps=37", "--optim.warmup_steps=4", "--optim.lr=0.3", "--optim.min_lr_ratio=0.1"]
    wsd = load_config(None, [*base, "--optim.schedule=wsd", "--optim.decay_fraction=1"])
    lin = load_config(None, [*base, "--optim.schedule=linear"])
    assert [lr_at(s, wsd) for s in range(37)] == pytest.approx([lr_at(s, lin) for s in range(37)], rel=1e-15)


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1"])
def test_decay_fraction_out_of_range_is_named(bad):
    from dilocox.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.decay_fraction=.* must be in \(0, 1\]"):
        load_config(None, ["--optim.schedule=wsd", f"--optim.decay_fraction={bad}"])


def test_trainer_steps_equal_a_plain_pytorch_loop(tmp_path):
    """Decay (no weight decay on biases and norms), lr per step, global-norm clipping, microbatches summing to the
    batch's mean loss: the trainer's parameters after 4 steps equal a plain loop's."""
    from dilocox.train import Trainer

    extra = ("--optim.grad_clip=0.5", "--optim.schedule=linear", "--parallel.microbatches=2", "--train.batch_size=4",
             "--optim.betas=[0.8,0.9]", "--optim.eps=1e-4", "--optim.weight_decay=0.3")  # fmt: skip
    cfg = small_cfg(str(tmp_path), *extra, steps=4)
    t = Trainer(cfg)
    ref, sampler, o = copy.deepcopy(t.model), copy.deepcopy(t.sampler), cfg.optim
    groups = [{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.3},
              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(0.8, 0.9), eps=1e-4)
    for s in range(4):
        x, y = sampler.next_batch()
        logits = ref(x)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for g in opt.param_groups:
            g["lr"] = _hand_lr(s, o.lr, o.warmup_steps, 4, o.min_lr_ratio, "linear")
        opt.step()
        opt.zero_grad()
        t.train_step()
        assert float(t.grad_norm) == pytest.approx(norm.item(), rel=1e-5)
        assert t.optimizer.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
    for (n, a), b in zip(t.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=n)
