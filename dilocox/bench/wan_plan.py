"""The plan side of ``dilocox bench wan``: the planner's prediction for each run, and plan against measured.

``predict`` is ``dilocox.plan.plan`` for a run's own config at the emulated link (its cap, RTT and tbf's frame
headers); ``own_step_time``/``add_own_plan`` give the plan at a run's own compute speed; ``join`` adds "% of
uncapped" and the errors. Pure: no run is started here.
"""

from __future__ import annotations

import math
from dataclasses import replace

from dilocox.plan import Method, plan

REPLICAS, PER_REPLICA = 2, 2
# Round trips one step of a gloo collective pays: a gloo pair sends into a buffer its peer has announced
# (the receiver's notification crosses first, then the data), so a step costs a round trip, not a one-way
# delay. Measured through the delay switch, 2 ranks, 100 Mbit/s: a 1.8 MB all_reduce (2 steps) took 149 ms
# at 0 ms and 441 ms at 150 ms RTT, i.e. +1.97 RTT.
GLOO_STEP_RTTS = 1.0
FRAME_HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + TCP timestamps option 12
# tc tbf caps the Ethernet frames: a full frame carries 1448 bytes of TCP payload in 1514, so the payload moves at
# 95.6 % of the cap (measured: diloco at 1 Mbit/s blocked 31.5 s on a sync the payload-only model put at 28.5 s)
TBF_GOODPUT = 1448 / (1448 + FRAME_HEADER_BYTES)


def run_method(cfg, name: str, H: int | None = None, rank: int | None = None) -> Method:
    """The planner's ``Method`` for a loaded run config (``H``/``rank`` override the configured ones)."""
    o, c = cfg.outer, cfg.compress
    if H is not None and o.method not in ("allreduce", "cocktailsgd"):
        o = replace(o, sync_every=H)
    if rank and c.lowrank.enabled:
        ad = replace(c.adaptive, rank_min=min(c.adaptive.rank_min, rank), rank_max=max(c.adaptive.rank_max, rank))
        c = replace(c, lowrank=replace(c.lowrank, rank=rank), adaptive=ad)
    return Method(name, o, c)


def predict(
    cfg,
    method: str,
    cap_bps: float | None,
    step_time_s: float = 1.0,
    H: int | None = None,
    rank: int | None = None,
    rtt_ms: float = 0.0,
) -> dict:
    """The plan for this config at this cap and round trip (2 replicas) and the run's own layout;
    every method setting comes from the config (``H``/``rank`` override it). Each collective step
    pays one full round trip (``GLOO_STEP_RTTS``), tbf adds none."""
    tokens = cfg.train.batch_size * cfg.train.seq_len
    return plan(
        cfg.model,
        REPLICAS,
        math.inf if cap_bps is None else cap_bps,
        method=run_method(cfg, method, H, rank),
        tokens_per_step=tokens,
        latency_s=GLOO_STEP_RTTS * rtt_ms / 1e3,
        step_time_s=step_time_s,
        pipeline=cfg.parallel.pipeline,
        tensor=cfg.parallel.tensor,
        goodput=1.0 if cap_bps is None else TBF_GOODPUT,
    )


def own_step_time(row: dict, ref: dict, per_step: bool) -> float:
    """The plan's step time at THIS run's own compute speed: its steady-state window (steps 2..N) minus the time it
    was blocked on outer collectives there, per step, plus what the collectives cost per step uncapped (``ref``: the
    method's uncapped no-delay run, whose step time the plan otherwise takes). On 2 shared cores the compute speed of
    two runs differs by up to ~20 %; at the run's own speed the plan's error is its communication model's alone.
    ``per_step``: the method blocks on every step, step 1 included (its share is outside the window)."""
    n = row["steps"]
    window_s = row["tokens_per_step"] * (n - 1) / row["tokens_per_s"]
    blocked = row["blocked_s"] * ((n - 1) / n if per_step else 1.0)
    return max(window_s - blocked, 0.0) / (n - 1) + ref["blocked_s"] / ref["steps"]


def add_own_plan(row: dict, ref: dict | None, cfg, method: str) -> None:
    """``row["plan_own"]``: the plan at the run's own compute speed (``own_step_time``); capped rows only."""
    if row["cap_bps"] is None or ref is None:
        return
    t = own_step_time(row, ref, per_step=method in ("allreduce", "cocktailsgd"))
    p = predict(cfg, method, row["cap_bps"], t, rtt_ms=row.get("rtt_ms") or 0.0)
    row["plan_own"] = {"step_time_s": t, "tokens_per_s": p["tokens_per_s"], "utilization": p["utilization"]}


def steps_within(cfg, cap_bps: float | None, steps: int, max_comm_s: float, rtt_ms: float = 0.0) -> int:
    """``steps``, cut so the predicted communication time stays under ``max_comm_s``.

    Whole phases, at least 2 steps.
    """
    p = predict(cfg, cfg.outer.method, cap_bps, rtt_ms=rtt_ms)
    per_step = p["t_comm_s"] / p["H"]
    if per_step * steps <= max_comm_s:
        return steps
    cut = max(1, int(max_comm_s / per_step))
    return max(p["H"], 2, cut // p["H"] * p["H"])  # >= 2: tokens/s leaves out step 1


def window_tokens_per_s(row: dict, n: int) -> float | None:
    """Tokens/s of ``row``'s steps 2..n on rank 0's clock (the end of step 1 to the end of step n, from its per-step
    times ``loss_vs_time``). None where the row has no record per step (a run logged every k > 1 steps), fewer than
    n steps, or no ``tokens_per_step``."""
    el = [t for t, _ in row.get("loss_vs_time") or []]
    tokens = row.get("tokens_per_step")
    if not tokens or len(el) != row.get("steps") or len(el) < n or n < 2 or el[n - 1] <= el[0]:
        return None
    return tokens * (n - 1) / (el[n - 1] - el[0])


def join(rows: list[dict]) -> list[dict]:
    """Add "% of uncapped" and the plan-vs-measured errors to measured rows (pure).

    Each row has ``method``, ``cap_bps`` (None = uncapped), ``rtt_ms`` (absent = 0), the ``summarize``
    fields, and ``plan`` (``predict`` at the method's measured uncapped step time). "% of uncapped" divides
    by the same method's uncapped no-delay run of the SAME number of steps: the first-step warm-up and the drain of the
    last all-reduce weigh differently in runs of other lengths. Where there is none (a shortened capped run), its
    steps 2..n against the same steps of the shortest longer one, both on rank 0's clock (``window_tokens_per_s``;
    None without either; a 2-step run's window is one step long, so that ratio is as noisy as one step).
    Errors are (plan - measured) / measured; utilization errors are in percentage points.
    """
    ref = {(r["method"], r["steps"]): r for r in rows if r["cap_bps"] is None and not r.get("rtt_ms")}
    for r in rows:
        u = ref.get((r["method"], r["steps"]))  # like with like: an uncapped run of the same length ...
        if u:
            r["pct_of_uncapped"] = 100.0 * r["tokens_per_s"] / u["tokens_per_s"]
        else:  # ... or the same steps 2..n of a longer one, both on rank 0's clock (like with like)
            n = r["steps"]
            longer = sorted((x for (m, k), x in ref.items() if m == r["method"] and k > n), key=lambda x: x["steps"])
            w = next((w for w in (window_tokens_per_s(x, n) for x in longer) if w), None)
            own = window_tokens_per_s(r, n)
            r["pct_of_uncapped"] = 100.0 * own / w if w and own else None
            if w and own:
                r["uncapped_window_tokens_per_s"], r["window_tokens_per_s"] = w, own
        q = r.get("plan_own")
        if q:
            r["plan_own_tokens_per_s"] = q["tokens_per_s"]
            r["err_own_tokens_per_s_pct"] = 100.0 * (q["tokens_per_s"] / r["tokens_per_s"] - 1.0)
        p = r.get("plan")
        if not p:
            continue
        r["plan_tokens_per_s"] = p["tokens_per_s"]
        r["plan_utilization"] = p["utilization"]
        r["plan_bytes"] = p["wire_bytes_per_replica"] * r["steps"] / p["H"]
        r["err_tokens_per_s_pct"] = 100.0 * (p["tokens_per_s"] / r["tokens_per_s"] - 1.0)
        r["err_utilization_pp"] = 100.0 * (p["utilization"] - r["utilization"])
        r["err_bytes_pct"] = 100.0 * (r["plan_bytes"] / r["bytes_framework"] - 1.0) if r["bytes_framework"] else None
        q = r.get("plan_as_run")
        if q and r["bytes_framework"]:
            r["plan_as_run_bytes"] = q["wire_bytes_per_replica"] * r["steps"] / q["H"]
            r["err_as_run_bytes_pct"] = 100.0 * (r["plan_as_run_bytes"] / r["bytes_framework"] - 1.0)
    return rows
