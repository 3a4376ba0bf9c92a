"""Combinations that load, run and silently ignore one of their keys: each refused here with a ``ConfigError`` that
names the key, why it has no effect and the fix (``checks._fail``'s style).

Only keys a user set to a value that differs from what the run does are refused; a parameter of a feature that is
switched off (``compress.lowrank.rank`` with ``lowrank.enabled: false``, ``optim.muon_momentum`` with AdamW, a
preset's ``outer.streaming.pattern`` with one fragment) is kept: a sweep flips the switch and leaves the rest as it
is. ``check_combos`` runs at the end of ``root.validate``; ``check_swarm_outer`` for a SWARM run only
(``root.validate_swarm_layout``)."""

from __future__ import annotations

from typing import Any

from dilocox.config.checks import _fail
from dilocox.config.sections import CompressConfig, DataConfig, OuterConfig, StreamingConfig

_PER_STEP = ("allreduce", "cocktailsgd")


def check_combos(cfg: Any) -> None:
    """Every combination rule of this module for the root config ``cfg`` of `dilocox train`: the streaming mix where
    the DiLoCo outer loop runs (outer.method=diloco), the collective where the default compressor carries the outer
    mean (diloco, allreduce). With outer.method=none there is no outer loop here and the outer and compress keys wait
    for a SWARM run with swarm.sync=diloco (``check_swarm_outer``)."""
    if cfg.outer.method == "diloco":
        check_streaming_mix(cfg.outer)
    if cfg.outer.method in ("diloco", "allreduce"):
        check_collective(cfg.compress)
    if cfg.outer.method in _PER_STEP:
        check_per_step_schedule(cfg.outer)
    check_without_outer_method(cfg.outer)
    check_comm_stream(cfg)
    check_profile_window(cfg)
    check_data_path(cfg.data)


def check_streaming_mix(o: OuterConfig) -> None:
    """``outer.streaming.alpha`` and ``merge`` act where a sync mixes the local params with θ: streaming (fragments > 1
    or tau > 0) with overlap none (outer/diloco.py: ``self.alpha``, ``self.replay``)."""
    s = o.streaming
    streaming = s.fragments > 1 or s.tau > 0
    if s.merge == "replay" and (o.overlap != "none" or s.tau == 0):
        why = (
            f"outer.overlap={o.overlap!r} (delayed/eager start every phase from the outer params: nothing to merge); "
            "set merge: mix or overlap: none"
            if o.overlap != "none"
            else "outer.streaming.tau=0 (it keeps the tau steps trained while a fragment's sync flies: with none it "
            "is the mix); set tau >= 1 or merge: mix"
        )
        _fail("outer.streaming.merge", s.merge, f"has no effect with {why}")
    if s.alpha != StreamingConfig.alpha and (o.overlap != "none" or not streaming):
        why = (
            f"outer.overlap={o.overlap!r} (delayed/eager set the params to the outer params θ at every sync: nothing "
            "is mixed); remove it or set overlap: none"
            if o.overlap != "none"
            else "outer.streaming.fragments=1 and tau=0 (plain DiLoCo sets the params to the outer params θ at every "
            "sync); stream (fragments > 1 or tau >= 1) or remove it"
        )
        _fail("outer.streaming.alpha", s.alpha, f"has no effect with {why}")


def check_per_step_schedule(o: OuterConfig) -> None:
    """``outer.overlap``, ``outer.streaming.fragments`` and ``tau`` shape the DiLoCo family's syncs; allreduce and
    cocktailsgd average every step's gradients (outer/gradsync.py)."""
    s = o.streaming
    if o.overlap != "none" or s.fragments > 1 or s.tau > 0:
        key, val = (
            ("outer.overlap", o.overlap)
            if o.overlap != "none"
            else ("outer.streaming.fragments", s.fragments)
            if s.fragments > 1
            else ("outer.streaming.tau", s.tau)
        )
        _fail(key, val, f"has no effect with outer.method={o.method!r} (DiLoCo family only); remove it or set diloco")


def check_collective(c: CompressConfig) -> None:
    """``compress.collective`` picks how quantized payloads (and compress.sparse's) travel; an fp32 mean
    (compress.quant=none, no codec section) is one all-reduce whatever it says (compress/collectives.py)."""
    codec = any(getattr(c, n).enabled for n in ("sparse", "sign"))
    if c.collective != "auto" and c.quant == "none" and not codec:
        _fail(
            "compress.collective",
            c.collective,
            "has no effect with compress.quant='none' (an fp32 mean is one ring all-reduce); set compress.quant "
            "(fp16, int8, int4) or compress.collective=auto",
        )


def check_without_outer_method(o: OuterConfig) -> None:
    """``outer.norm_check`` and ``outer.lr_schedule=inner`` act on the outer loop of `dilocox train`, which
    outer.method=none does not build; a SWARM stage's outer loop refuses the one and does not apply the other
    (``check_swarm_outer``). (checks.check_outer names the other methods the schedule needs.)"""
    if o.method != "none":
        return
    if o.norm_check:
        _fail(
            "outer.norm_check",
            o.norm_check,
            "has no effect with outer.method='none' (a single replica: no outer mean to check; SWARM's stage sync "
            "does not support it either); set outer.method (e.g. diloco with parallel.replicas >= 3) or set it to 0",
        )
    if o.lr_schedule != "constant":
        _fail(
            "outer.lr_schedule",
            o.lr_schedule,
            "has no effect with outer.method='none' (no outer optimizer in this run, and SWARM's stage sync does "
            "not apply it); set outer.method=diloco or outer.lr_schedule=constant",
        )


def check_comm_stream(cfg: Any) -> None:
    """``outer.comm_stream`` puts the comm thread's kernels on a CUDA stream of its own (distributed/comm.py); a CPU
    run has no streams (train.device=auto decides on the machine it runs on: a GPU's run takes it)."""
    if cfg.outer.comm_stream and cfg.train.device == "cpu":
        _fail(
            "outer.comm_stream",
            cfg.outer.comm_stream,
            "has no effect with train.device='cpu' (a CUDA stream of its own for the comm thread; a CPU runs each "
            "kernel as it is called); set train.device=cuda (or auto on a GPU machine) or remove it",
        )


def check_profile_window(cfg: Any) -> None:
    """``log.profile_start`` traces steps profile_start .. + profile_steps - 1 (profiling.py): a start past
    train.steps never opens the window (the run wrote no trace and said nothing)."""
    start, steps = cfg.log.profile_start, cfg.train.steps
    if start > steps:
        _fail(
            "log.profile_start",
            start,
            f"is past train.steps={steps}: the run ends before the traced steps and writes no profile; set it to a "
            f"step <= {steps} (e.g. 10 with log.profile_steps=3) or 0 (off)",
        )


def check_data_path(d: DataConfig) -> None:
    """``data.path`` is read by the text, memmap and hf sources; the built-in corpora never read it."""
    if d.path and d.source in ("stdlib", "prose", "docs"):
        _fail(
            "data.path",
            d.path,
            f"is not read with data.source={d.source!r} (a built-in corpus: Python's own files); set "
            "data.source=text (a file, directory or glob), memmap or hf, or remove data.path",
        )


def check_swarm_outer(cfg: Any) -> None:
    """A SWARM run (`dilocox swarm`): ``swarm.sync`` picks the stage sync; with diloco its DiLoCo outer step takes
    outer.sync_every, lr, momentum, nesterov, optimizer, overlap, streaming and the compress section, not
    outer.method or outer.lr_schedule (swarm/peer.py ``_build_outer``)."""
    o = cfg.outer
    if o.method in _PER_STEP:
        _fail(
            "outer.method",
            o.method,
            "is not what SWARM runs: swarm.sync picks the stage sync (swarm: the stage's grads averaged every step; "
            "diloco: the DiLoCo outer step every outer.sync_every); set outer.method=none or diloco",
        )
    if o.lr_schedule != "constant":
        _fail(
            "outer.lr_schedule",
            o.lr_schedule,
            "is not applied by SWARM's stage sync (its outer lr stays outer.lr); set outer.lr_schedule=constant",
        )
    if cfg.swarm.sync == "diloco":
        check_streaming_mix(o)
        check_collective(cfg.compress)
