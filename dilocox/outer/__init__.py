"""What the training loop calls between inner steps to communicate over the outer group (ALGORITHMS §1–§4, §7–§8).

- ``build_outer``: the object for ``outer.method`` (None for ``none``).
- ``gradsync.GradientSync``: per-step methods (allreduce, cocktailsgd): the mean of the gradients.
- ``diloco.DiLoCoOuter``: the DiLoCo family (overlap none/delayed/eager, streaming fragments, adaptive).
- ``base.OuterBase``: their common comm thread, stats and checkpoint fields.
- ``group.OuterGroup``: the replicas they average over (a fixed process group, or a torchft quorum:
  ``dilocox.elastic.quorum.QuorumGroup``).
- ``state.OuterState``: flat fp32 outer params θ and Nesterov momentum v of the shard.
- ``fragments``: Streaming DiLoCo fragment assignment and sync schedule; ``dp_shard``: inner-DP sharding.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from dilocox.config import CompressConfig, ConfigError, OuterConfig
from dilocox.outer.base import OuterBase
from dilocox.outer.diloco import METHODS as FAMILY
from dilocox.outer.diloco import DiLoCoOuter
from dilocox.outer.gradsync import METHODS as PER_STEP
from dilocox.outer.gradsync import GradientSync
from dilocox.outer.group import FixedGroup, OuterGroup


def build_outer(
    named_params: list[tuple[str, nn.Parameter]],
    topo,
    ocfg: OuterConfig,
    ccfg: CompressConfig,
    seed: int,
    layer_of: Callable[[str], int | None] | None = None,
    n_layers_total: int = 0,
    comm_delay_s: float = 0.0,
    comm_bandwidth: float | None = None,
    group: OuterGroup | None = None,
) -> OuterBase | None:
    """The outer object of ``ocfg.method`` over this rank's ``named_params`` (None for ``none``).

    ``layer_of``/``n_layers_total`` place parameters in streaming fragments (DiLoCo family only);
    ``comm_delay_s``/``comm_bandwidth`` emulate the link on the comm thread (distributed/comm.py).
    ``group``: the replicas to average over (group.py); default the fixed ``outer`` process group of ``topo``. A
    group that heals (the torchft quorum of ``outer.elastic``) needs the DiLoCo family.
    """
    if ocfg.method == "none":
        return None
    if group is not None and group.heals and ocfg.method not in FAMILY:
        raise ConfigError(f"outer.elastic needs outer.method in {list(FAMILY)}, not {ocfg.method!r}")
    if ocfg.method in PER_STEP:
        return GradientSync(
            named_params, topo, ocfg, ccfg, seed, comm_delay_s=comm_delay_s, comm_bandwidth=comm_bandwidth, group=group
        )
    if ocfg.method in FAMILY:
        return DiLoCoOuter(
            named_params,
            topo,
            ocfg,
            ccfg,
            seed,
            layer_of=layer_of,
            n_layers_total=n_layers_total,
            comm_delay_s=comm_delay_s,
            comm_bandwidth=comm_bandwidth,
            group=group,
        )
    raise ConfigError(f"outer.method={ocfg.method!r} is not one of {['none', *PER_STEP, *FAMILY]}")


__all__ = ["DiLoCoOuter", "FixedGroup", "GradientSync", "OuterBase", "OuterGroup", "build_outer"]
