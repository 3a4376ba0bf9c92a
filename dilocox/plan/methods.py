"""The method presets the planner compares: ``configs/methods/<name>.yaml``, as ``dilocox train`` loads them.

``configs_dir`` finds the ``configs/`` directory (``DILOCOX_CONFIGS`` overrides it), ``method_names``
lists the presets in display order, and ``load_method`` loads one preset's ``outer`` and ``compress``
sections with some settings overridden (H, rank, quantizer, overlap, streaming fragments and tau)
into a ``Method``, whose properties give the view of the schedule the time model uses (per-step
methods sync every step; ``blocking`` puts the sync on the critical path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dilocox.config import CompressConfig, OuterConfig, load_config
from dilocox.outer.gradsync import METHODS as PER_STEP


def configs_dir() -> str:
    """The ``configs/`` directory next to the installed package (``make install`` is an editable
    install, so it is the checkout's); ``DILOCOX_CONFIGS`` overrides it."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dilocox/plan/ -> ../..
    path = os.environ.get("DILOCOX_CONFIGS") or os.path.join(checkout, "configs")
    if not os.path.isdir(os.path.join(path, "methods")):
        raise FileNotFoundError(
            f"method presets not found: {path}/methods does not exist; install dilocox editable "
            "from its checkout (make install) or set DILOCOX_CONFIGS to a directory with methods/"
        )
    return path


def method_names(cdir: str | None = None) -> list[str]:
    """The presets in ``configs/methods/`` (file names without .yaml), in a fixed display order."""
    d = os.path.join(cdir or configs_dir(), "methods")
    names = sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))
    order = ["allreduce", "cocktailsgd", "diloco", "opendiloco", "streaming", "eager", "dilocox"]
    return [n for n in order if n in names] + [n for n in names if n not in order]


@dataclass(frozen=True)
class Method:
    """One preset's outer and compress sections, as ``dilocox train`` would load them."""

    name: str
    outer: OuterConfig
    compress: CompressConfig

    @property
    def per_step(self) -> bool:
        return self.outer.method in PER_STEP

    @property
    def H(self) -> int:
        return 1 if self.per_step else self.outer.sync_every

    @property
    def overlap(self) -> str:
        """The overlap the time model uses: ``blocking: true`` puts the sync on the critical path."""
        return "none" if self.per_step or self.outer.blocking else self.outer.overlap

    @property
    def fragments(self) -> int:
        return 1 if self.per_step else self.outer.streaming.fragments

    @property
    def tau(self) -> int:
        return 0 if self.per_step else self.outer.streaming.tau

    def describe(self) -> str:
        c = self.compress
        q = {"none": "fp32"}.get(c.quant, c.quant) + (f"/G{c.group_size}" if c.quant in ("int4", "int8") else "")
        if self.outer.method == "cocktailsgd":
            return f"random {c.random_fraction:g} x top-k {c.topk_fraction:g} + {q}"
        if c.sparse.enabled:
            sp = c.sparse
            return f"top {sp.density:g} of {sp.chunk}-chunks, int{sp.bits} + EF {sp.ef_decay:g}"
        if c.lowrank.enabled:
            r = c.lowrank.rank
            if c.adaptive.enabled:
                r = max(c.adaptive.rank_min, min(c.adaptive.rank_max, r))
            return f"lowrank r{r}{' (adaptive)' if c.adaptive.enabled else ''} + {q}"
        return q


def load_method(
    name: str,
    *,
    H: int | None = None,
    rank: int | None = None,
    group_size: int | None = None,
    quant: str | None = None,
    overlap: str | None = None,
    fragments: int | None = None,
    tau: int | None = None,
    cdir: str | None = None,
) -> Method:
    """``configs/methods/<name>.yaml`` with the given settings overridden (None: the preset's).

    ``rank`` 0 turns low-rank off; a rank outside an adaptive preset's [rank_min, rank_max] widens it.
    ``H`` applies only to the DiLoCo family (per-step methods sync every step)."""
    path = os.path.join(cdir or configs_dir(), "methods", f"{name}.yaml")
    if not os.path.exists(path):
        raise ValueError(f"method {name!r}: no preset {path}; choose from {method_names(cdir)}")
    raw = load_config(path)
    ov: dict = {"outer": {}, "compress": {}}
    if H is not None and raw.outer.method not in PER_STEP:
        ov["outer"]["sync_every"] = H
        ad = raw.compress.adaptive
        if ad.enabled:
            ov["compress"]["adaptive"] = {"h_min": min(ad.h_min, H), "h_max": max(ad.h_max, H)}
    if overlap is not None:
        ov["outer"]["overlap"] = overlap
        if overlap != "none":  # asking for an overlap means not waiting on the critical path (opendiloco blocks)
            ov["outer"]["blocking"] = False
    if fragments is not None or tau is not None:
        ov["outer"]["streaming"] = {k: v for k, v in (("fragments", fragments), ("tau", tau)) if v is not None}
    if quant is not None:
        ov["compress"]["quant"] = quant
    if group_size is not None:
        ov["compress"]["group_size"] = group_size
    if rank is not None:
        if rank < 0:
            raise ValueError(f"rank={rank} must be >= 0 (0 = no low-rank)")
        ov["compress"]["lowrank"] = {"enabled": rank > 0, **({"rank": rank} if rank else {})}
        ad = raw.compress.adaptive
        if rank and ad.enabled:
            ov["compress"].setdefault("adaptive", {}).update(
                rank_min=min(ad.rank_min, rank), rank_max=max(ad.rank_max, rank)
            )
    cfg = load_config(path, ov) if ov["outer"] or ov["compress"] else raw
    return Method(name, cfg.outer, cfg.compress)
