"""The planner: predict bytes, communication time and compute utilization before renting GPUs.

``dilocox plan --model configs/model/qwen1.5-107b.yaml --replicas 20 --bandwidth 1gbit``
prints, for each method preset, the bytes each replica sends per outer sync, the time of that
sync, the compute utilization, the predicted tokens/s and the inter-cluster bandwidth needed
for 90/95/99 % utilization. The model is ALGORITHMS.md §10:

    T_comm = latency * steps_of_collective + wire_bytes * 8 / bandwidth
    T_step = 6 * N_params * tokens_per_step / (peak_flops * MFU)          (per replica)
    none:            utilization = H*T_step / (H*T_step + T_comm)
    delayed/eager:   utilization = H*T_step / max(H*T_step, T_comm)

generalised to streaming (K fragments, each synced once per H steps with overlap tau steps):
``wall = H*T_step + K * max(0, T_comm/K - tau*T_step)``; ``tau = 0`` is blocking and
``K = 1, tau = H`` is the one-outer-step overlap above, so one formula serves all methods.

Payloads (§5-§6): fp32 4 bytes/param, fp16 2, int8 1 + 2/G, int4 0.5 + 2/G (bf16 scale per
group of G). Low-rank factors a 2-D shard (n x m) into (n + m)*r elements when
(n + m)*r*2 < n*m, the rest goes dense; both are then quantized. Wire bytes per replica:
ring all-reduce 2(R-1)/R * payload for summable fp32/fp16; int4/int8 cannot be summed on the
wire, so all-gather (R-1) * payload for R <= 4 and reduce-scatter + all-gather
2(R-1)/R * payload above (§6 ``collective: auto``). Bandwidth strings: ``100mbit``,
``1gbit``, ``10Gbit/s``, ``1Gbps`` (bits), ``125MB/s`` (bytes); decimal prefixes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, replace

from dilocox.config import ModelConfig, load_config

TARGETS = (0.90, 0.95, 0.99)
DEFAULT_TOKENS_PER_STEP = 2048 * 256  # per replica per inner step (256 sequences of 2048)
DEFAULT_GPU_FLOPS = 989e12  # H100 SXM dense bf16
DEFAULT_MFU = 0.4
DEFAULT_LATENCY_S = 0.02  # per collective step on a WAN link


# --------------------------------------------------------------------------- units

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}


def parse_bandwidth(text: str | float | int) -> float:
    """``"100mbit"`` -> 1e8 bits/s. Lowercase ``b``/``bit``/``bps`` are bits, ``B``/``byte`` bytes.

    Note ``1Gbps`` means gigabits here (as in the papers), unlike tc, where ``mbps`` is bytes.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*", str(text))
        if not m:
            raise ValueError(f"bandwidth {text!r} is not a number with a unit; write e.g. 100mbit, 1gbit, 10Gbit/s, 125MB/s")
        unit = m.group(2)
        unit = unit[:-2] if unit.endswith("/s") else unit
        um = re.fullmatch(r"([kKmMgGtT]i?)?(bit|bps|b|Bps|B|byte|bytes)?", unit)
        if not um:
            raise ValueError(f"bandwidth {text!r}: unknown unit {m.group(2)!r}; use bit, kbit, mbit, gbit (or Gbps, MB/s)")
        scale = _PREFIX[(um.group(1) or "").lower()]
        per_byte = (um.group(2) or "bit") in ("Bps", "B", "byte", "bytes")
        value = float(m.group(1)) * scale * (8.0 if per_byte else 1.0)
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"bandwidth {text!r} must be a finite number > 0 bits/s")
    return value


def fmt_bandwidth(bps: float) -> str:
    if math.isinf(bps):
        return "unreachable"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"


# --------------------------------------------------------------------------- payloads (§5-§6)


@dataclass(frozen=True)
class Compression:
    """What one replica puts on the wire per sync: quantizer, low-rank rank, kept fraction."""

    quant: str = "none"  # none (fp32) | fp16 | int8 | int4
    group_size: int = 128
    rank: int | str | None = None  # PowerSGD rank; None = no low-rank; "auto" = d_model // 4
    density: float = 1.0  # fraction of elements sent (CocktailSGD: random_fraction * topk_fraction)
    index_bytes: float = 0.0  # bytes per kept element for indices (0 = the §8 nominal ratio)
    min_compression: float = 1.0  # factor a matrix when (n+m)*r*2 < n*m / min_compression

    def __post_init__(self) -> None:
        if self.quant not in ("none", "fp16", "int8", "int4"):
            raise ValueError(f"compression quant={self.quant!r} is not one of none, fp16, int8, int4")
        if self.group_size <= 0:
            raise ValueError(f"compression group_size={self.group_size} must be > 0")
        if self.rank is not None and self.rank != "auto" and not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"compression rank={self.rank!r} must be an integer > 0, 'auto' (d_model/4) or None (no low-rank)")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"compression density={self.density} must be in (0, 1]")

    @property
    def summable(self) -> bool:
        """fp32/fp16 dense payloads can be summed on the wire by a ring all-reduce."""
        return self.quant in ("none", "fp16") and self.density == 1.0

    def describe(self) -> str:
        parts = [{"none": "fp32"}.get(self.quant, self.quant) + (f"/G{self.group_size}" if self.quant in ("int4", "int8") else "")]
        if self.rank:
            parts.insert(0, f"lowrank r{self.rank}")
        if self.density < 1.0:
            parts.insert(0, f"sparse {self.density:.3g}")
        return " + ".join(parts)


def quant_bytes(n: int, quant: str, group_size: int = 128) -> float:
    """Bytes of a flat buffer of n elements under §6 (packed nibbles + one bf16 scale per group)."""
    groups = math.ceil(n / group_size)
    return {"none": 4.0 * n, "fp16": 2.0 * n, "int8": n + 2.0 * groups, "int4": math.ceil(n / 2) + 2.0 * groups}[quant]


def param_shapes(mcfg: ModelConfig) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, full shape, tensor-parallel split dim or None) of every parameter of the model."""
    d, f, V, hd = mcfg.d_model, mcfg.ffn_dim, mcfg.vocab_size, mcfg.head_dim
    qkv_b = mcfg.bias if mcfg.qkv_bias is None else mcfg.qkv_bias
    norm = [("weight", (d,))] + ([] if mcfg.norm == "rmsnorm" else [("bias", (d,))])
    out: list[tuple[str, tuple[int, ...], int | None]] = [("embed", (V, d), 0)]
    if mcfg.pos_emb == "learned":
        out.append(("pos_embed", (mcfg.max_seq_len, d), None))
    for i in range(mcfg.n_layers):
        p = f"layers.{i}."
        for k, rows in (("q", mcfg.n_heads * hd), ("k", mcfg.kv_heads * hd), ("v", mcfg.kv_heads * hd)):
            out.append((f"{p}attn.{k}_proj.weight", (rows, d), 0))
            if qkv_b:
                out.append((f"{p}attn.{k}_proj.bias", (rows,), 0))
        out.append((f"{p}attn.o_proj.weight", (d, mcfg.n_heads * hd), 1))
        ups = ("gate", "up") if mcfg.activation == "swiglu" else ("up",)
        for k in ups:
            out.append((f"{p}mlp.{k}_proj.weight", (f, d), 0))
        out.append((f"{p}mlp.down_proj.weight", (d, f), 1))
        if mcfg.bias:
            out += [(f"{p}attn.o_proj.bias", (d,), None), (f"{p}mlp.down_proj.bias", (d,), None)]
            out += [(f"{p}mlp.{k}_proj.bias", (f,), 0) for k in ups]
        out += [(f"{p}norm{j}.{n}", s, None) for j in (1, 2) for n, s in norm]
    out += [(f"final_norm.{n}", s, None) for n, s in norm]
    if not mcfg.tie_embeddings:
        out.append(("head", (V, d), 0))
    return out


def payload_bytes(model: ModelConfig | int, comp: Compression, tensor: int = 1) -> dict:
    """Bytes one replica contributes per sync (before the collective multiplies them).

    With ``tensor = T`` the low-rank condition is checked per TP shard (each rank factors its
    own slice); parameters replicated over TP are counted once.
    """
    if isinstance(model, int):
        if comp.rank:
            raise ValueError("low-rank payloads need the matrix shapes: pass a ModelConfig, not a parameter count")
        shapes = [("params", (model,), None)]
    else:
        shapes = param_shapes(model)
    n_params = lowrank = dense = 0
    for _, shape, split in shapes:
        numel = math.prod(shape)
        n_params += numel
        if comp.rank and len(shape) == 2:
            n, m = shape
            shards = tensor if split is not None else 1
            if split is not None:
                n, m = (n // tensor, m) if split == 0 else (n, m // tensor)
            if (n + m) * comp.rank * 2 < n * m / comp.min_compression:
                lowrank += (n + m) * comp.rank * shards
                continue
        dense += numel
    sent = math.ceil((lowrank + dense) * comp.density)
    total = quant_bytes(sent, comp.quant, comp.group_size) + comp.index_bytes * sent * (comp.density < 1.0)
    return {"n_params": n_params, "lowrank_elements": lowrank, "dense_elements": dense,
            "sent_elements": sent, "bytes": total, "ratio": 4.0 * n_params / total}


def collective_cost(payload: float, replicas: int, collective: str, n_collectives: int = 1) -> tuple[float, int]:
    """(bytes each replica sends, sequential latency steps) of one sync over R replicas."""
    R = replicas
    if R <= 1:
        return 0.0, 0
    if collective in ("ring", "reduce_scatter"):
        return 2.0 * (R - 1) / R * payload, 2 * (R - 1) * n_collectives
    if collective == "allgather":
        return (R - 1) * payload, (R - 1) * n_collectives
    raise ValueError(f"collective={collective!r} is not one of ring, allgather, reduce_scatter, auto")


def resolve_collective(comp: Compression, replicas: int, collective: str = "auto") -> str:
    if collective != "auto":
        return collective
    if comp.summable:
        return "ring"
    return "allgather" if replicas <= 4 else "reduce_scatter"


# --------------------------------------------------------------------------- time model (§10)


def step_time(n_params: int, tokens_per_step: float, peak_flops: float, mfu: float) -> float:
    """Seconds of one inner step of one replica: 6 N tokens / (peak * MFU)."""
    return 6.0 * n_params * tokens_per_step / (peak_flops * mfu)


def wall_time(compute_s: float, comm_s: float, overlap_s: float, fragments: int = 1) -> float:
    """Wall time of H inner steps whose sync (split in K fragments) may hide behind overlap_s each."""
    return compute_s + fragments * max(0.0, comm_s / fragments - overlap_s)


def utilization(compute_s: float, comm_s: float, overlap: str) -> float:
    """§10 as written: none -> C/(C+T); delayed/eager -> C/max(C, T)."""
    if overlap == "none":
        return compute_s / (compute_s + comm_s)
    if overlap in ("delayed", "eager"):
        return compute_s / max(compute_s, comm_s)
    raise ValueError(f"overlap={overlap!r} is not one of none, delayed, eager")


def bandwidth_for(target: float, compute_s: float, wire_bytes: float, latency_total_s: float,
                  overlap_s: float, fragments: int = 1) -> float:
    """Smallest bandwidth (bits/s) at which utilization reaches ``target`` (inf if none does)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target utilization {target} must be in (0, 1]")
    if wire_bytes == 0:
        return 0.0
    avail = overlap_s + compute_s * (1.0 / target - 1.0) / fragments - latency_total_s / fragments
    return math.inf if avail <= 0 else wire_bytes * 8.0 / fragments / avail


# --------------------------------------------------------------------------- presets

PRESETS: dict[str, dict] = {
    # per-step data parallel: fp32 gradients every step, ring all-reduce (DiLoCoX's baseline)
    "allreduce": dict(H=1, comp=Compression("none"), overlap="none"),
    # OpenDiLoCo as run in DiLoCoX §4.1.3: H=500, fp16 pseudo-gradients, blocking
    "opendiloco": dict(H=500, comp=Compression("fp16"), overlap="none"),
    # CocktailSGD (§8): per step, random 0.1 x top-k 0.08 x int4 (indices not counted: nominal)
    "cocktailsgd": dict(H=1, comp=Compression("int4", density=0.1 * 0.08), overlap="none"),
    # Streaming DiLoCo (paper 004; paper 001 Table 5 "1-inner-step overlapped FP4", int4 stand-in)
    "streaming": dict(H=100, comp=Compression("int4"), overlap="none", fragments=4, tau=1),
    # eager updates (paper 001): one-outer-step overlap, 4-bit outer gradients
    "eager": dict(H=100, comp=Compression("int4"), overlap="eager"),
    # DiLoCoX §4.1.3: H=125, low-rank (rank d_model/4 = 2048 for d 8192) + int4, one-step delay
    "dilocox": dict(H=125, comp=Compression("int4", rank="auto"), overlap="delayed"),
}
LOCAL_STEP_METHODS = ("opendiloco", "streaming", "eager", "dilocox")


def plan(model: ModelConfig | int, replicas: int, bandwidth_bps: float, *, method: str = "dilocox",
         H: int | None = None, compression: Compression | None = None, overlap: str | None = None,
         fragments: int | None = None, tau: int | None = None, tokens_per_step: float = DEFAULT_TOKENS_PER_STEP,
         peak_flops: float = 8 * DEFAULT_GPU_FLOPS, mfu: float = DEFAULT_MFU, latency_s: float = DEFAULT_LATENCY_S,
         step_time_s: float | None = None, tensor: int = 1, collective: str = "auto",
         targets: tuple[float, ...] = TARGETS) -> dict:
    """Predict one method's communication, utilization and throughput (ALGORITHMS §10).

    ``model`` is a ModelConfig or a bare parameter count; ``peak_flops`` is per replica (all its
    GPUs); ``step_time_s`` overrides the 6*N*tokens/(peak*MFU) estimate. Arguments left None
    take the method preset's value (see PRESETS).
    """
    if method not in PRESETS:
        raise ValueError(f"method={method!r} is not one of {sorted(PRESETS)}")
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth_bps={bandwidth_bps} must be > 0")
    pre = PRESETS[method]
    H = pre["H"] if H is None else H
    comp = compression or pre["comp"]
    if comp.rank == "auto":  # rank d_model / 4: the paper's 2048 for a d_model of 8192
        comp = replace(comp, rank=model.d_model // 4 if isinstance(model, ModelConfig) else None)
    overlap = overlap or pre["overlap"]
    if overlap not in ("none", "delayed", "eager"):
        raise ValueError(f"overlap={overlap!r} is not one of none, delayed, eager")
    if tensor < 1:
        raise ValueError(f"tensor={tensor} must be >= 1")
    K = fragments or pre.get("fragments", 1)
    if isinstance(model, ModelConfig) and K > model.n_layers:
        K = model.n_layers
    tau_steps = pre.get("tau", 0) if tau is None else tau
    if H < 1 or (K > 1 and not 0 <= tau_steps < max(1, H // K)):
        raise ValueError(f"H={H}, fragments={K}, tau={tau_steps}: need H >= 1 and 0 <= tau < H/fragments")

    pay = payload_bytes(model, comp, tensor)
    coll = resolve_collective(comp, replicas, collective)
    wire, steps = collective_cost(pay["bytes"], replicas, coll, 2 if pay["lowrank_elements"] else 1)
    lat = latency_s * steps * K  # every fragment's collective pays the latency
    t_comm = lat + wire * 8.0 / bandwidth_bps
    t_step = step_time_s if step_time_s is not None else step_time(pay["n_params"], tokens_per_step, peak_flops, mfu)
    compute = H * t_step
    # one-outer-step overlap: each fragment's sync hides behind its H/K-step slot of the next phase
    overlap_s = compute / K if overlap in ("delayed", "eager") else tau_steps * t_step
    wall = wall_time(compute, t_comm, overlap_s, K)
    return {
        "method": method, "replicas": replicas, "bandwidth_bps": bandwidth_bps, "H": H,
        "compression": comp.describe(), "quant": comp.quant, "group_size": comp.group_size, "rank": comp.rank,
        "density": comp.density, "overlap": overlap, "fragments": K, "tau": tau_steps, "collective": coll,
        "n_params": pay["n_params"], "payload_bytes": pay["bytes"], "compression_ratio": pay["ratio"],
        "lowrank_elements": pay["lowrank_elements"], "wire_bytes_per_replica": wire,
        "peak_wire_bytes": wire / K, "collective_steps": steps * K, "t_comm_s": t_comm, "t_step_s": t_step,
        "compute_s": compute, "wall_s": wall, "idle_s": wall - compute, "utilization": compute / wall,
        "tokens_per_s": replicas * tokens_per_step * H / wall,
        "bandwidth_for": {f"{u:.2f}": bandwidth_for(u, compute, wire, lat, overlap_s, K) for u in targets},
    }


def plan_all(model: ModelConfig | int, replicas: int, bandwidth_bps: float, methods=tuple(PRESETS), H: int | None = None,
             rank: int | None = None, group_size: int | None = None, **kw) -> list[dict]:
    """One plan per method preset; ``H`` applies to local-step methods, ``rank`` to dilocox."""
    rows = []
    for m in methods:
        comp = PRESETS[m]["comp"]
        if group_size is not None:
            comp = replace(comp, group_size=group_size)
        if rank is not None and m == "dilocox":
            comp = replace(comp, rank=rank or None)
        rows.append(plan(model, replicas, bandwidth_bps, method=m, compression=comp,
                         H=H if m in LOCAL_STEP_METHODS else None, **kw))
    return rows


def paper_worked_example(n_params: float = 100e9, replicas: int = 3, bandwidth_bps: float = 1e9,
                         local_steps: int = 500, step_s: float = 1.0) -> dict:
    """DiLoCoX §2.4.1: fp32 pseudo-gradients of 100B params, 3 clusters, ring all-reduce, 1 Gbit/s.

    Ring all-reduce sends 2(R-1)/R * 400 GB = 533.3 GB per replica; 533.3e9*8/1e9 s = 1.185 h;
    500 local steps of 1 s = 0.139 h; with the one-step overlap the idle time is the rest,
    1.046 h (the paper prints these truncated: 533.3 GB, 1.18 h, 0.13 h, 1.04 h).
    """
    payload = quant_bytes(int(n_params), "none")
    wire, _ = collective_cost(payload, replicas, "ring")
    t_comm = wire * 8.0 / bandwidth_bps
    compute = local_steps * step_s
    return {"payload_bytes": payload, "wire_bytes": wire, "comm_h": t_comm / 3600, "local_h": compute / 3600,
            "idle_h": (wall_time(compute, t_comm, compute) - compute) / 3600,
            "utilization_delayed": utilization(compute, t_comm, "delayed"),
            "utilization_none": utilization(compute, t_comm, "none")}


# --------------------------------------------------------------------------- CLI


def format_table(rows: list[dict]) -> str:
    tgt = list(rows[0]["bandwidth_for"]) if rows else []
    head = ["method", "H", "compression", "overlap", "collective", "sent/sync/replica", "ratio", "T_comm",
            "H*T_step", "util", "tokens/s"] + [f"BW for {float(u):.0%}" for u in tgt]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ov = r["overlap"] if r["fragments"] == 1 else f"streaming K={r['fragments']} tau={r['tau']}"
        cells = [r["method"], str(r["H"]), r["compression"], ov, r["collective"], fmt_bytes(r["wire_bytes_per_replica"]),
                 f"{r['compression_ratio']:.0f}x", fmt_seconds(r["t_comm_s"]), fmt_seconds(r["compute_s"]),
                 f"{r['utilization']:.1%}", f"{r['tokens_per_s']:,.0f}"] + [fmt_bandwidth(r["bandwidth_for"][u]) for u in tgt]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _finite(x):
    """JSON has no infinity: an unreachable bandwidth is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="YAML with a model: section (configs/model/*.yaml)")
    ap.add_argument("--replicas", type=int, required=True, help="R clusters joined by the slow link")
    ap.add_argument("--bandwidth", required=True, help="per-replica link, e.g. 100mbit, 1gbit, 10Gbit/s")
    ap.add_argument("--methods", default=",".join(PRESETS), help=f"comma list of {','.join(PRESETS)}")
    ap.add_argument("--H", type=int, default=None, help="inner steps per outer step (local-step methods)")
    ap.add_argument("--rank", type=int, default=None, help="dilocox low-rank rank (0 = int4 only; default d_model/4)")
    ap.add_argument("--group-size", type=int, default=None, help="quantization group G (default 128)")
    ap.add_argument("--tokens-per-step", type=float, default=DEFAULT_TOKENS_PER_STEP, help="tokens per replica per inner step")
    ap.add_argument("--gpus-per-replica", type=int, default=8)
    ap.add_argument("--gpu-tflops", type=float, default=DEFAULT_GPU_FLOPS / 1e12, help="peak TFLOP/s per GPU (H100 bf16: 989)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU)
    ap.add_argument("--step-time", type=float, default=None, help="seconds per inner step (overrides the FLOP estimate)")
    ap.add_argument("--latency", type=float, default=DEFAULT_LATENCY_S, help="seconds per collective step")
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (low-rank is decided per shard)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    try:
        bw = parse_bandwidth(args.bandwidth)
        mcfg = load_config(args.model).model
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in methods if m not in PRESETS]
        if bad:
            raise ValueError(f"--methods: unknown {bad}; choose from {sorted(PRESETS)}")
        rows = plan_all(mcfg, args.replicas, bw, methods, H=args.H, rank=args.rank, group_size=args.group_size,
                        tokens_per_step=args.tokens_per_step, peak_flops=args.gpus_per_replica * args.gpu_tflops * 1e12,
                        mfu=args.mfu, latency_s=args.latency, step_time_s=args.step_time, tensor=args.tensor)
    except (ValueError, OSError) as e:
        print(f"dilocox plan: error: {e}", file=sys.stderr)
        return 2
    r0 = rows[0]
    step = f"{args.step_time} s (given)" if args.step_time else (
        f"{fmt_seconds(r0['t_step_s'])} = 6 x {r0['n_params'] / 1e9:.3g}B params x {args.tokens_per_step:,.0f} tokens / "
        f"({args.gpus_per_replica} x {args.gpu_tflops:g} TFLOP/s x MFU {args.mfu})")
    print(f"# plan: {args.model}, {args.replicas} replicas, {fmt_bandwidth(bw)} per replica link, "
          f"latency {args.latency * 1e3:g} ms/collective step\n\ninner step: {step}\n")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_finite(rows), f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
