"""Edges of the DiLoCo outer loop on one replica (no process group): a finished run resumed with more steps, the
local steps the final model leaves out at the end of a run, and settings that would do nothing."""

from __future__ import annotations

import io

import pytest
import torch

from dilocox.config import CompressConfig, ConfigError, OuterConfig, StreamingConfig
from dilocox.outer import build_outer
from dilocox.outer.fragments import tail_warning, uncommunicated_tail
from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model

SEED = 7


def _build(H: int, overlap: str = "none", K: int = 1, tau: int = 0, merge: str = "mix"):
    model = make_model(SEED)
    o = OuterConfig(
        method="diloco",
        sync_every=H,
        overlap=overlap,
        streaming=StreamingConfig(fragments=K, tau=tau, alpha=0.5, merge=merge),
    )
    loop = build_outer(
        list(model.named_parameters()), None, o, CompressConfig(), seed=SEED, layer_of=layer_of, n_layers_total=4
    )
    return model, make_inner_opt(model), loop


def _train(model, opt, loop, start: int, stop: int, before_outer=None) -> None:
    for step in range(start, stop):
        forward_backward(model, SEED, 0, step)
        opt.step()
        opt.zero_grad()
        if before_outer is not None:
            before_outer(step)
        loop.after_inner_step(step)


@pytest.mark.parametrize("overlap,tau,end", [("delayed", 0, 6), ("none", 1, 5)])
def test_a_finished_run_resumed_with_more_steps_applies_nothing_twice(overlap, tau, end):
    """finish() applied the average in flight at the end (H = 3: delayed's launched at 6, streaming's launched at 5
    for the sync at 6); the extended run's next sync point has nothing pending. The delayed mode stepped the outer
    optimizer with a zero gradient there, which still moved θ by −η μ² v (the momentum alone): no rule makes that
    step. (overlap none already skipped that sync's outer step.)"""
    model, opt, loop = _build(3, overlap, tau=tau)
    _train(model, opt, loop, 0, end)
    loop.finish()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "outer": loop.state_dict()}, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    model, opt, loop = _build(3, overlap, tau=tau)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])
    loop.load_state_dict(sd["outer"])
    assert loop.pending == [None] and float(loop.state.momentum.norm()) > 0
    theta, v = loop.state.theta.clone(), loop.state.momentum.clone()
    nxt = (end // 3 + 1) * 3
    _train(model, opt, loop, end, nxt)  # the next sync point: nothing pending
    assert torch.equal(loop.state.theta, theta) and torch.equal(loop.state.momentum, v)
    _train(model, opt, loop, nxt, nxt + 3)  # the one after applies the average launched since
    assert not torch.equal(loop.state.theta, theta)
    loop.finish()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    "H,overlap,K,tau,steps",
    [(4, "none", 1, 0, 7), (4, "delayed", 1, 0, 8), (4, "none", 2, 0, 8), (4, "none", 1, 2, 8), (4, "none", 1, 2, 6),
     (4, "delayed", 2, 0, 8), (4, "none", 2, 1, 9)],
)  # fmt: skip
def test_uncommunicated_tail_is_what_the_final_model_leaves_out(H, overlap, K, tau, steps):
    """Wrecking a fragment's params during its last ``uncommunicated_tail`` steps leaves the final model as it is
    (those steps never reach it); wrecking them one step earlier does not."""
    lost = uncommunicated_tail(steps, H, K, tau)

    def final(p: int | None, from_step: int) -> dict:
        model, opt, loop = _build(H, overlap, K, tau)
        names = [n for n, _ in model.named_parameters()]
        mine = {names[i] for i in loop.state.fragments[p]} if p is not None else set()

        def wreck(step: int) -> None:
            if step >= from_step:
                with torch.no_grad():
                    for n, w in model.named_parameters():
                        if n in mine:
                            w.add_(100.0)

        _train(model, opt, loop, 0, steps, wreck)
        loop.finish()
        return {n: w.detach().clone() for n, w in model.named_parameters()}

    clean = final(None, steps)
    for p in range(K):
        names = [n for n, _ in make_model(SEED).named_parameters()]
        frag = [names[i] for i in _build(H, overlap, K, tau)[2].state.fragments[p]]
        kept = final(p, steps - lost[p])
        assert all(torch.equal(kept[n], clean[n]) for n in frag), (p, lost)
        changed = final(p, steps - lost[p] - 1)
        assert not all(torch.equal(changed[n], clean[n]) for n in frag), (p, lost)


def test_the_start_up_warning_names_the_steps_left_out():
    assert tail_warning(10, 5, 1, 0) is None and tail_warning(6, 4, 1, 2) is None
    assert "train.steps=7 is not a multiple of outer.sync_every=5: the last 2 local steps" in tail_warning(7, 5, 1, 0)
    # a multiple of H still leaves steps out when streaming: the old start-up check said nothing
    assert "leaves out the last 0 / 2 local steps of train.steps=8" in tail_warning(8, 4, 2, 0)
    assert "the last 2 local steps" in tail_warning(8, 4, 1, 2) and "multiple of 4 minus 2" in tail_warning(8, 4, 1, 2)


@pytest.mark.parametrize("overlap", ["delayed", "eager"])
def test_merge_replay_is_refused_where_it_would_do_nothing(overlap):
    """merge=replay is streaming's mix (overlap none); with delayed/eager it loaded and the run was bit-identical to
    merge=mix."""
    with pytest.raises(ConfigError, match="merge='replay' has no effect with outer.overlap"):
        _build(3, overlap, merge="replay")
    _build(4, "none", 1, 2, merge="replay")[2].close(timeout=5.0)  # where it does something: accepted


def test_a_live_replicas_state_of_another_shape_or_range_is_refused_before_anything_is_copied():
    """A heal takes θ and v from a live replica (``_restore``); ``copy_`` would broadcast a smaller tensor (a scalar,
    a row) over the whole state without a word. Found by a review of what crosses the network: the shapes, dtypes
    and H / outer_step are checked first, and nothing of this replica changes on a refusal."""
    model, opt, loop = _build(H=2)
    _train(model, opt, loop, 0, 2)
    good = {k: v for k, v in loop._snapshot(2, 0).items()}
    good["theta"], good["momentum"] = loop.state.theta.clone() + 1, loop.state.momentum.clone()
    before = loop.state.theta.clone()
    for key, bad, match in (
        ("theta", torch.zeros(()), r"sent theta as \(\)"),
        ("momentum", loop.state.momentum[:3].clone(), r"sent momentum as \(3,\)"),
        ("theta", loop.state.theta.double(), "float64"),
        ("theta", [1.0], "sent theta as list"),
        ("H", 0, "H=0"),
        ("outer_step", -1, "outer_step=-1"),
    ):
        with pytest.raises(RuntimeError, match=match):
            loop._restore({**good, key: bad})
        assert torch.equal(loop.state.theta, before)
    loop._restore(good)  # (the control: a state of this model is taken)
    assert torch.equal(loop.state.theta, before + 1)
