"""SWARM parallelism and DiLoCo-SWARM (issue 11; papers: SWARM, Ryabinin et al. 2023; DiLoCo-SWARM).

n pipeline stages, m_j peers serving stage j, each peer its own OS process; every microbatch is
routed through one peer per stage (``routing``: interleaved weighted round-robin on measured
time, or random wiring), activations and their gradients cross the stage boundaries compressed
(``activations``: none | fp16 | blockwise int8), and the peers of a stage synchronise either
every step (SWARM) or every H steps with the DiLoCo outer step (DiLoCo-SWARM). ``plan`` predicts
the bytes of both kinds of traffic; ``rebalance`` picks which peer moves between stages.

Submodules are imported on use (``dilocox.swarm.routing`` etc.); this package imports nothing heavy.
"""
