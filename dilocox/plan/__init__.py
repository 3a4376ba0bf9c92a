"""The planner: predict bytes, communication time and compute utilization before renting GPUs.

``dilocox plan --model configs/model/qwen1.5-107b.yaml --replicas 20 --bandwidth 1gbit``
prints, for each method preset, the bytes each replica sends per outer sync, the time of that
sync, the compute utilization, the predicted tokens/s and the inter-cluster bandwidth needed
for 90/95/99 % utilization.

Nothing here restates the code it predicts. The method settings (H, overlap, streaming K and
tau, quantizer, low-rank rank, CocktailSGD fractions) are read from ``configs/methods/<name>.yaml``,
the presets ``dilocox train`` includes. The parameters are those of the model the trainer
builds (``build_stage_model`` on the meta device: its names, shapes and tensor-parallel
split dims, per pipeline stage). The bytes come from the objects that send them: per rank
(stage x TP slice) and streaming fragment, ``build_compressor(...).wire_bytes(R)`` (group
padding, low-rank P/Q layout and the adaptive tail sketch included) for the DiLoCo family and
``allreduce``, and ``cocktail_payload_bytes`` (indices + values) for ``cocktailsgd``. So the
bytes per sync are what the outer stats of a real run count (``bytes_sent``; tested).
A replica's ranks share its link: the per-replica bytes are the sum over its P x T ranks
(a parameter replicated over TP, e.g. a norm, is sent by every TP rank, as in the code);
inner data parallelism (``shard_over_data``) spreads the same bytes over D ranks and is not modelled.

The time model is ALGORITHMS.md §10:

    T_comm = latency * steps_of_collective + wire_bytes * 8 / bandwidth
    T_step = 6 * N_params * tokens_per_step / (peak_flops * MFU)          (per replica)
    none:            utilization = H*T_step / (H*T_step + T_comm)
    delayed/eager:   utilization = H*T_step / max(H*T_step, T_comm)

generalised to streaming (K fragments, each synced once per H steps with overlap tau steps):
``wall = H*T_step + K * max(0, T_comm/K - tau*T_step)``; ``tau = 0`` is blocking and
``K = 1, tau = H`` is the one-outer-step overlap above, so one formula serves all methods.
Collective steps (for the latency term) follow the collective the code runs: fp32 (quant
``none``) is a ring all-reduce, 2(R-1) steps; the packed kinds (fp16, int8, int4) are an
all-gather (R-1 steps) for R <= 4 and reduce-scatter + all-gather (2(R-1)) above
(``compress.collective: auto``); CocktailSGD is one all-gather; low-rank adds the P round.
Bandwidth strings: ``100mbit``, ``1gbit``, ``10Gbit/s``, ``1Gbps`` (bits), ``125MB/s`` (bytes);
decimal prefixes.

Layout: ``units`` (bandwidth and duration strings), ``methods`` (the presets, ``Method``),
``payloads`` (bytes per sync, ``rank_shards``), ``predict`` (the time model, ``plan``, ``plan_all``,
``choose_preset``: which of the two ``dilocox`` presets a link wants),
``cli`` (``dilocox plan``). Import from ``dilocox.plan``: every name is re-exported here.
"""

from dilocox.plan.cli import format_table, main
from dilocox.plan.methods import Method, configs_dir, load_method, method_names
from dilocox.plan.payloads import collective_cost, quant_bytes, rank_shards, sync_bytes
from dilocox.plan.predict import (
    DEFAULT_GPU_FLOPS,
    DEFAULT_LATENCY_S,
    DEFAULT_MFU,
    DEFAULT_TOKENS_PER_STEP,
    PRESET_PAIR,
    TARGETS,
    bandwidth_for,
    choose_preset,
    paper_worked_example,
    plan,
    plan_all,
    step_time,
    utilization,
    wall_time,
)
from dilocox.plan.units import fmt_bandwidth, fmt_seconds, parse_bandwidth

__all__ = [
    "DEFAULT_GPU_FLOPS",
    "DEFAULT_LATENCY_S",
    "DEFAULT_MFU",
    "DEFAULT_TOKENS_PER_STEP",
    "PRESET_PAIR",
    "TARGETS",
    "Method",
    "bandwidth_for",
    "choose_preset",
    "collective_cost",
    "configs_dir",
    "fmt_bandwidth",
    "fmt_seconds",
    "format_table",
    "load_method",
    "main",
    "method_names",
    "paper_worked_example",
    "parse_bandwidth",
    "plan",
    "plan_all",
    "quant_bytes",
    "rank_shards",
    "step_time",
    "sync_bytes",
    "utilization",
    "wall_time",
]
