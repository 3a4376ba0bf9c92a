"""The outer loop of the DiLoCo family over one rank's shard (ALGORITHMS §1–§4, §7–§8).

- ``loop.OuterLoop``: what the training loop calls (on_gradients, after_inner_step, finish,
  state_dict/load_state_dict, stats).
- ``state.OuterState``: flat fp32 outer params θ and Nesterov momentum v of the shard.
- ``fragments``: Streaming DiLoCo fragment assignment and sync schedule.
"""

from dilocox.outer.loop import OuterLoop

__all__ = ["OuterLoop"]
