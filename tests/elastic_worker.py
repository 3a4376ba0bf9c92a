"""One elastic replica of the oracle's TinyNet run (tests/test_elastic_outer.py): ``DiLoCoOuter`` over an
``ElasticOuterGroup``, started as its own process (``python -m tests.elastic_worker ...``).

It joins (healing from a live replica when it is behind), trains ``steps`` inner steps on
``reference_diloco.batch(seed, replica, step)`` with the oracle's AdamW, and writes its final params
and a JSON line per event to ``--out``. ``--die-at N --die-mode phase``: SIGKILL itself after inner
step N (mid-phase); ``--die-mode inflight``: SIGKILL itself once the quorum of the outer step at
inner step N is formed (its peers' all-reduce with it is in flight).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

from dilocox.compress.codec import rank_of
from dilocox.config import CompressConfig, OuterConfig
from dilocox.elastic import ElasticConfig, ElasticOuterGroup
from dilocox.elastic.quorum import QuorumGroup
from dilocox.outer import build_outer
from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model


class _Poisoned(QuorumGroup):
    """A replica that sends ``factor`` x its pseudo-gradient (a faulty or crude rogue replica; outer.norm_check)."""

    def __init__(self, elastic, norm_check: float, factor: float) -> None:
        super().__init__(elastic, norm_check)
        self.factor = factor

    def _round(self, tensors, step, contribute, codec, propose, layout):
        if layout is not None:
            inner = layout

            def layout():
                ts, cd = inner()
                return [t * self.factor for t in ts], cd
        else:
            tensors = [t * self.factor for t in tensors]
        return super()._round(tensors, step, contribute, codec, propose, layout)


def main() -> None:
    if os.environ.get("DILOCOX_TEST_LOG"):  # debugging a test: torchft's and dilocox's Python logs on stderr
        import logging

        logging.basicConfig(level=logging.INFO)
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="the address this replica advertises (its namespace's)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--overlap", default="none")
    ap.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo: fragments (strided)")
    ap.add_argument("--tau", type=int, default=0, help="Streaming DiLoCo: launch tau steps before a fragment's sync")
    ap.add_argument("--alpha", type=float, default=0.5, help="Streaming DiLoCo: θ_m <- α θ_m + (1 - α) θ")
    ap.add_argument("--quant", default="none", help="none, int4, int8, or sparse (compress.sparse)")
    ap.add_argument("--lowrank", type=int, default=0)
    ap.add_argument("--adaptive", action="store_true", help="adaptive rank (1..4) and H (2..6), window 2")
    ap.add_argument(
        "--vary-h", action="store_true", help="adaptive: each replica proposes its own H sequence (not from times)"
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--initial-replicas", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--die-mode", default="phase")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hold-file", default=None, help="slow steps from --hold-at until it exists")
    ap.add_argument("--hold-at", type=int, default=16)
    ap.add_argument("--norm-check", type=float, default=0.0, help="outer.norm_check")
    ap.add_argument("--outer-optimizer", default="sgd", help="outer.optimizer (sgd, muon)")
    ap.add_argument("--poison", default=None, help="send this factor (or nan) x the pseudo-gradient at every sync")
    a = ap.parse_args()

    def rec(**kw) -> None:
        with open(a.out + ".jsonl", "a") as f:
            f.write(json.dumps(dict(kw, t=time.time())) + "\n")

    ecfg = ElasticConfig(
        lighthouse_addr=a.lighthouse,
        replica_rank=a.replica,
        min_replicas=a.min_replicas,
        initial_replicas=a.initial_replicas,
        max_replicas=4,
        timeout_s=a.timeout,
        quorum_timeout_s=a.quorum_timeout,
        host=a.host,
    )
    group = ElasticOuterGroup(ecfg)
    model = make_model(a.seed)
    opt = make_inner_opt(model)
    ocfg = OuterConfig(method="diloco", sync_every=a.H, overlap=a.overlap, optimizer=a.outer_optimizer)
    st = ocfg.streaming
    st.fragments, st.tau, st.alpha, st.pattern = a.fragments, a.tau, a.alpha, "strided"
    streaming = a.fragments > 1 or a.tau > 0
    ccfg = CompressConfig(quant="none" if a.quant == "sparse" else a.quant)
    if a.quant == "sparse":  # the dilocox preset's codec (top-k of chunks, 2-bit values, error feedback)
        sp = ccfg.sparse
        sp.enabled, sp.chunk, sp.density, sp.bits, sp.ef_decay = True, 64, 0.09, 2, 0.95
    if a.lowrank:
        ccfg.lowrank.enabled, ccfg.lowrank.rank = True, a.lowrank
    if a.adaptive:
        ad = ccfg.adaptive
        ad.enabled, ad.window, ad.rank_min, ad.rank_max, ad.h_min, ad.h_max = True, 2, 1, 4, 2, 6
    if a.vary_h:  # H from measured times hardly moves here; proposals that differ per replica and step test the max
        _vary_h(a.replica)
    qg = QuorumGroup(group, a.norm_check) if a.poison is None else _Poisoned(group, a.norm_check, float(a.poison))
    outer = build_outer(list(model.named_parameters()), None, ocfg, ccfg, a.seed, layer_of=layer_of, group=qg)
    n0 = outer.join()
    outer.membership.pop_jump()
    if n0 is not None:
        opt = make_inner_opt(model)  # a joiner starts from θ with a fresh inner optimizer
    rec(event="start", step=n0 or 0, healed=n0 is not None)
    if n0 is not None and a.hold_file:
        open(a.hold_file, "w").close()  # joined: the others may go on at full speed
    hold_until = time.monotonic() + 180
    step = n0 or 0
    armed = [False]  # inflight: set by the main thread at the sync of step die_at, read on the comm thread
    if a.die_mode == "inflight" and a.die_at is not None:

        def on_quorum(n_live: int) -> None:
            if armed[0]:
                rec(event="kill", step=a.die_at)
                os.kill(os.getpid(), signal.SIGKILL)

        group.on_quorum = on_quorum
    while step < a.steps:
        forward_backward(model, a.seed, a.replica, step)
        opt.step()
        opt.zero_grad()
        rec(event="step", step=step + 1)
        if a.die_mode == "phase" and a.die_at == step + 1:
            rec(event="kill", step=step + 1)
            os.kill(os.getpid(), signal.SIGKILL)
        armed[0] = a.die_mode == "inflight" and a.die_at == step + 1
        before = outer.outer_step
        outer.after_inner_step(step)
        if (outer.outer_step != before) if (a.adaptive or streaming) else (step + 1) % a.H == 0:
            rank = rank_of(outer.compressors[0])
            rec(event="sync", step=step + 1, outer_step=outer.outer_step, contributors=outer.contributors, rank=rank,
                H=outer.H)  # fmt: skip
        jump = outer.membership.pop_jump()
        if jump is not None:  # healed mid-run (it was behind): continue at the live step from θ, fresh AdamW
            rec(event="healed", step=jump)
            opt = make_inner_opt(model)
            step = jump - 1
        step += 1
        joined = a.hold_file is not None and os.path.exists(a.hold_file)
        # --step-sleep paces the run until the restarted replica has joined (so that it joins mid-run); from then on
        # the membership is settled (every later sync over all three) and the rest of the run goes at the pace of
        # the fault-free tests (0.05 s a step), not --step-sleep
        time.sleep(min(a.step_sleep, 0.05) if joined else a.step_sleep)
        if a.hold_file and step >= a.hold_at and not joined and time.monotonic() < hold_until:
            # slow steps (syncs go on) while a test waits for a restarted replica's start-up: up to 1.5 s a step,
            # cut short once the joiner has written the file
            slow_until = time.monotonic() + 1.5
            while time.monotonic() < slow_until and not os.path.exists(a.hold_file):
                time.sleep(0.05)
    outer.finish()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, a.out + ".pt")
    rec(event="done", step=step, contributors=outer.contributors)
    group.close()


def _vary_h(replica: int) -> None:
    from dilocox.compress.adaptive import AdaptiveController

    update = AdaptiveController.update

    def varied(self, *args, **kw):
        rank, _ = update(self, *args, **kw)
        self.calls = getattr(self, "calls", 0) + 1  # (a joiner starts counting at its join: any proposal goes)
        self.h = self.h_min + (3 * replica + 2 * self.calls) % (self.h_max - self.h_min + 1)
        return rank, self.h

    AdaptiveController.update = varied


if __name__ == "__main__":
    main()
