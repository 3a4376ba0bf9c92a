"""Module crossings per outer round of a method preset (issue 43's measure of how tangled the outer loop is).

A crossing is a Python call from one ``dilocox`` module into another (``sys.setprofile``: caller's module !=
callee's module, both under ``dilocox.``); a call back into the module just left within the same chain counts as a
"bounce". The loop is the ``dilocox`` preset's outer and codec (configs/methods/dilocox.yaml) on one replica of the
oracle's TinyNet (tests/reference_diloco.py), driven for ``--steps`` inner steps as the trainer drives it; the count
is divided by the outer steps taken. Traced: the main thread inside ``after_inner_step`` and the comm thread (the
group and the codec), not the model.

    python3 tools/crossings.py [--preset dilocox] [--steps 40] [--top 15]

The same script runs on an older checkout (``git worktree add /tmp/old <commit>``; ``PYTHONPATH=/tmp/old python3
tools/crossings.py``) to compare.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or ROOT)


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("dilocox.") else None


class Counter:
    """Counts dilocox -> dilocox calls between modules while active."""

    def __init__(self) -> None:
        self.crossings = 0
        self.bounces = 0
        self.pairs: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        callee, back = _module(frame), frame.f_back
        caller = _module(back) if back is not None else None
        if callee is None or caller is None or callee == caller:
            return
        self.crossings += 1
        self.pairs[(caller, callee)] += 1
        grand = back.f_back
        while grand is not None and _module(grand) == caller:
            grand = grand.f_back
        if grand is not None and _module(grand) == callee:
            self.bounces += 1  # straight back into the module the caller was called from


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/crossings.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="dilocox")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    import torch

    from dilocox.config import load_config
    from dilocox.outer import build_outer
    from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model

    cfg = load_config(os.path.join(ROOT, "configs", "methods", f"{a.preset}.yaml"))
    torch.manual_seed(0)
    model = make_model(7)
    opt = make_inner_opt(model)
    count = Counter()
    threading.setprofile(count)  # the comm thread (started by the first launch) runs the group and the codec
    loop = build_outer(list(model.named_parameters()), None, cfg.outer, cfg.compress, 7, layer_of=layer_of)
    for step in range(a.steps):
        forward_backward(model, 7, 0, step)
        opt.step()
        opt.zero_grad()
        sys.setprofile(count)
        try:
            loop.after_inner_step(step)
        finally:
            sys.setprofile(None)
    loop.finish()
    threading.setprofile(None)
    rounds = max(1, loop.outer_step)
    print(f"{a.preset}: {loop.outer_step} outer steps in {a.steps} inner steps")
    print(f"crossings per outer round: {count.crossings / rounds:.1f} ({count.bounces / rounds:.1f} straight back)")
    for (src, dst), n in count.pairs.most_common(a.top):
        print(f"  {n / rounds:7.1f}  {src} -> {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
