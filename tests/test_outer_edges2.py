"""More edges of the DiLoCo outer loop (second review of dilocox/outer), on one replica unless said otherwise."""

from __future__ import annotations

import io

import torch

from dilocox.config import CompressConfig, OuterConfig, StreamingConfig
from dilocox.outer import FixedGroup, build_outer
from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model

SEED = 7


def _build(H: int, overlap: str = "none", K: int = 1, tau: int = 0, **outer):
    model = make_model(SEED)
    o = OuterConfig(
        method="diloco", sync_every=H, overlap=overlap, streaming=StreamingConfig(fragments=K, tau=tau), **outer
    )
    loop = build_outer(
        list(model.named_parameters()), None, o, CompressConfig(), seed=SEED, layer_of=layer_of, n_layers_total=4
    )
    return model, make_inner_opt(model), loop


def _train(model, opt, loop, start: int, stop: int, progress: bool = True) -> None:
    for step in range(start, stop):
        if progress:
            forward_backward(model, SEED, 0, step)
            opt.step()
            opt.zero_grad()
        loop.after_inner_step(step)


def _roundtrip(model, loop, build):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "outer": loop.state_dict()}, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    model, opt, loop = build()
    model.load_state_dict(sd["model"])
    loop.load_state_dict(sd["outer"])
    return model, opt, loop


def test_lookahead_after_finish_takes_the_pseudo_gradient_from_theta():
    """outer.lookahead: finish() sets the params to θ, so the phase of a finished run resumed with more train.steps
    starts from θ, not from θ − γηv. Its pseudo-gradient is its own work from θ: zero for a phase with no local
    progress. It was θ − γηv − θ_m = −γηv, a step no rule makes."""

    def build():
        return _build(3, "delayed", lookahead=1.0)

    model, opt, loop = build()
    _train(model, opt, loop, 0, 6)
    loop.finish()
    model, opt, loop = _roundtrip(model, loop, build)
    assert float(loop.state.momentum.norm()) > 0 and loop.pending == [None]
    _train(model, opt, loop, 6, 9, progress=False)  # the sync at 9 launches the phase's pseudo-gradient
    delta = loop.pending[0].wait()  # (one replica, quant none: the "average" is the replica's own)
    assert all(float(d.abs().max()) == 0.0 for d in delta)
    loop.finish()


def test_step_times_are_kept_only_for_the_adaptive_controller():
    """The inner-step times feed §7's controller, whose update empties the list; without a controller nothing
    emptied it: one float per inner step for the whole run (unbounded memory in a long run)."""
    model, opt, loop = _build(3)
    _train(model, opt, loop, 0, 40, progress=False)
    assert len(loop._step_times) == 0
    loop.finish()


class _LiveGroup(FixedGroup):
    """One replica whose group claims to heal: keeps, per launch, what a joiner healed by it gets and the average."""

    heals = True

    def __init__(self) -> None:
        super().__init__(None)
        self.rounds: list[tuple[dict, list[torch.Tensor]]] = []

    def set_state_fns(self, state_fn, load_fn, max_state_bytes=None) -> None:
        self.state_fn = state_fn

    def allreduce_mean(self, tensors, step, codec=None, propose=None):
        snap = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.state_fn().items()}
        out = super().allreduce_mean(tensors, step, codec, propose)
        self.rounds.append((snap, [t.clone() for t in out]))
        return out


class _JoinGroup(FixedGroup):
    """A joiner's group: its join is healed with a recorded snapshot and receives that round's average."""

    heals = True

    def __init__(self, snap: dict, avg: list[torch.Tensor]) -> None:
        super().__init__(None)
        self.snap, self.avg = snap, avg

    def set_state_fns(self, state_fn, load_fn, max_state_bytes=None) -> None:
        self.load_fn = load_fn

    def join(self, step, layout):
        self.load_fn(self.snap)
        layout()
        return [t.clone() for t in self.avg]


def test_a_joiner_takes_the_heal_steps_outer_step_at_the_scheduled_outer_lr():
    """outer.lr_schedule=inner with a live join (overlap none, tau = 0): the joiner applies the round it joins at
    the outer lr of that step, as the live replicas did, so its θ is theirs bit for bit. It stepped at the
    unscaled outer.lr (no step had set the factor yet): a θ apart from the live replicas' for the rest of the run."""

    def build(group):
        model = make_model(SEED)
        o = OuterConfig(method="diloco", sync_every=3)
        loop = build_outer(list(model.named_parameters()), None, o, CompressConfig(), seed=SEED, group=group)
        loop.lr_factor = lambda step: 0.25 + 0.05 * step  # (the inner schedule's ratio: warm-up, decay)
        return model, make_inner_opt(model), loop

    model, opt, live = build(_LiveGroup())
    _train(model, opt, live, 0, 6)
    snap, avg = live.group.rounds[-1]  # the round launched at step 6
    assert snap["n"] == 6 and float(snap["momentum"].norm()) > 0
    model2, _, joiner = build(_JoinGroup(snap, avg))
    assert joiner.join() == 6
    assert torch.equal(joiner.state.theta, live.state.theta)
    assert torch.equal(joiner.state.momentum, live.state.momentum)
    for a, b in zip(model2.parameters(), model.parameters()):
        assert torch.equal(a, b)
    live.finish()
    joiner.finish()


def _per_step_stats(rank: int, world: int) -> list[dict]:
    from dilocox.config import ParallelConfig
    from dilocox.distributed.topology import build_topology

    topo = build_topology(ParallelConfig(replicas=world))
    out = []
    for method in ("allreduce", "cocktailsgd"):
        model = make_model(SEED)
        opt = make_inner_opt(model, "sgd")
        o = OuterConfig(method=method)  # (outer.sync_every left at its default: the DiLoCo family's H)
        loop = build_outer(list(model.named_parameters()), topo, o, CompressConfig(quant="int4"), seed=SEED)
        for step in range(3):
            forward_backward(model, SEED, topo.replica, step)
            loop.on_gradients(step)
            opt.step()
            opt.zero_grad()
        sd = loop.state_dict()
        loop.finish()
        again = build_outer(list(model.named_parameters()), topo, o, CompressConfig(quant="int4"), seed=SEED)
        again.load_state_dict(dict(sd, H=100))  # (a checkpoint written before: outer.sync_every there)
        out.append({**loop.stats, "resumed_H": again.stats["H"], "resumed_outer_step": again.stats["outer_step"]})
        again.close(timeout=5.0)
    return out


def test_per_step_methods_report_h_1_and_count_their_averages():
    """allreduce and cocktailsgd average every step's gradients: the stats (step records, the log line "outer N H ..")
    said H = outer.sync_every (100 by default) and outer step 0 for the whole run."""
    from tests.spawn import run_ranks

    for stats in run_ranks(2, _per_step_stats, timeout=120):
        for s in stats:
            assert (s["H"], s["outer_step"], s["n_syncs"]) == (1, 3, 3)
            assert (s["resumed_H"], s["resumed_outer_step"]) == (1, 3)
