"""SWARM planner: bytes per step of pipeline traffic vs stage-sync traffic (``dilocox plan --swarm``).

A SWARM of n stages with m_j peers in stage j trains on ``m_0 * batch_size`` sequences per step
(each stage-0 peer draws ``batch_size`` sequences of ``seq_len`` tokens from its shard, split in
microbatches of ``microbatch_size``). Two kinds of traffic (paper 000, Fig. "square-cube law"):

* pipeline (PP): every microbatch crosses each of the n-1 stage boundaries twice, its
  activations forward and their gradients backward, each ``[mb, seq_len, d_model]`` through the
  activation codec (``dilocox.swarm.activations``): per link per step
  ``sum_microbatches 2 * wire_bytes(mb * seq_len * d_model, codec, block)``; PP = (n-1) x that.
* stage sync (DP): the peers of stage j all-reduce over their group of m_j:
  SWARM every step the fp32 gradients of the stage plus one microbatch counter
  (``[sum of grads | count]``, the runtime's message), DiLoCo-SWARM every H steps the
  pseudo-gradient through the compressor its config selects (``configs/methods/<preset>.yaml``'s
  ``compress`` section: quant, low-rank, streaming fragments). The bytes are those the code
  counts: ``build_compressor(...).wire_bytes(m_j)`` per peer, summed over the stage's peers.
  DiLoCo-SWARM's per-step figure is one sync / H.

The parameters are those ``build_stage_model`` builds for each stage (meta device, via
``dilocox.plan.rank_shards``). PP traffic grows with d_model (times tokens); the stage's
parameters with n_layers * d_model^2: the sync share grows with model size (the square-cube
law of SWARM §3.1, the trend of paper 000's Figure "Communication Cost Scaling").

``plan_config(cfg)`` (``dilocox plan --swarm --config run.yaml``) plans a run's own settings: its
``swarm`` section, ``train.batch_size``/``seq_len``, ``outer.sync_every`` and ``compress``.

The GPT-2 family is read from ``configs/model/gpt2-*.yaml`` where present; shapes missing there
(GPT-2 XL: 48 layers, 25 heads, d 1600; Radford et al. 2019) are built in, with the same
vocabulary padding (50304) and untied head as the configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from dilocox.compress.compressor import build_compressor
from dilocox.config import CompressConfig, Config, ConfigError, ModelConfig, load_config
from dilocox.metrics import fmt_bytes
from dilocox.model.transformer import param_layer_id
from dilocox.outer.fragments import assign_fragments
from dilocox.plan import Method, configs_dir, load_method, rank_shards
from dilocox.swarm.activations import CODECS, DEFAULT_BLOCK, ActCodec, colk_columns, ids_dtype, split_codec

# name -> (n_layers, n_heads, d_model); the rest as configs/model/gpt2-small.yaml
GPT2_SHAPES = {
    "gpt2-small": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


def gpt2_model(name: str, cdir: str | None = None) -> ModelConfig:
    """``configs/model/<name>.yaml`` if it exists, else the built-in GPT-2 shape."""
    if name not in GPT2_SHAPES:
        raise ValueError(f"unknown GPT-2 size {name!r}; choose from {list(GPT2_SHAPES)}")
    try:
        path = os.path.join(cdir or configs_dir(), "model", f"{name}.yaml")
    except FileNotFoundError:
        path = ""
    if path and os.path.exists(path):
        return load_config(path).model
    L, h, d = GPT2_SHAPES[name]
    return ModelConfig(arch="gpt2", n_layers=L, n_heads=h, d_model=d, vocab_size=50304, max_seq_len=1024, bias=True)


def _peers(peers, stages: int) -> list[int]:
    m = [int(peers)] * stages if isinstance(peers, int) else [int(p) for p in peers]
    if stages < 2:
        raise ValueError(f"stages={stages}: a SWARM pipeline needs >= 2 stages")
    if len(m) != stages:
        raise ValueError(f"peers={list(m)}: need one peer count per stage ({stages} stages)")
    if any(p < 1 for p in m):
        raise ValueError(f"peers={list(m)}: every stage needs >= 1 peer")
    return m


def stage_sync_wire(
    shard: list[tuple[str, tuple[int, ...]]],
    ccfg: CompressConfig,
    peers: int,
    *,
    fragments: int = 1,
    pattern: str = "sequential",
    extra: tuple[tuple[int, ...], ...] = (),
) -> int:
    """Bytes ONE peer of a stage sends in one full stage sync among ``peers`` (every fragment once).

    ``extra``: shapes appended to the message (SWARM's microbatch counter)."""
    names = [n for n, _ in shard]
    shapes = [torch.Size(s) for _, s in shard]
    frags = assign_fragments(names, param_layer_id, fragments, pattern)
    total = 0
    for p, idx in enumerate(frags):
        parts = [shapes[i] for i in idx] + ([torch.Size(s) for s in extra] if p == 0 else [])
        with torch.device("meta"):  # PowerSGD draws its Q matrices: shapes only, no memory
            comp = build_compressor(ccfg, parts, seed=p)
        total += comp.wire_bytes(peers)
    return total


def _act_codec(model: ModelConfig, act: str, block: int, cols: float) -> ActCodec:
    """The activation codec ``act`` at the stage boundaries of ``model`` (``cols``: colk's fraction)."""
    structure, _ = split_codec(act)
    return ActCodec(
        act,
        model.d_model,
        block,
        k=model.subspace_rank if structure == "subspace" else 0,
        cols=colk_columns(model.d_model, cols) if structure == "colk" else 0,
    )


def _check_sizes(model: ModelConfig, batch_size: int, microbatch_size: int, seq_len: int, H: int) -> None:
    for k, v in (("batch_size", batch_size), ("microbatch_size", microbatch_size), ("seq_len", seq_len), ("H", H)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}={v!r} must be a positive int")
    if seq_len > model.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={model.max_seq_len}")


def _diloco_method(preset: str | Method) -> Method:
    """The method preset (a name or a loaded ``Method``) of DiLoCo-SWARM's outer sync: a DiLoCo-family one."""
    method = load_method(preset) if isinstance(preset, str) else preset
    if method.per_step:
        raise ValueError(f"preset={method.name!r} syncs every step; DiLoCo-SWARM needs a DiLoCo-family preset")
    return method


def _stage_sync_bytes(shards: list, m: list[int], method: Method) -> tuple[list[int], list[int]]:
    """Stage sync bytes per stage (summed over its peers): SWARM's (fp32 grads + the microbatch counter, every
    step) and DiLoCo-SWARM's (one outer sync through ``method``'s compressor and fragments)."""
    swarm_stage = [mj * stage_sync_wire(sh, CompressConfig(), mj, extra=((1,),)) for sh, mj in zip(shards, m)]
    K, pattern = method.fragments, method.outer.streaming.pattern
    diloco_stage = [
        mj * stage_sync_wire(sh, method.compress, mj, fragments=K, pattern=pattern) for sh, mj in zip(shards, m)
    ]
    return swarm_stage, diloco_stage


def swarm_plan(
    model: ModelConfig,
    *,
    stages: int = 2,
    peers: int | list[int] = 4,
    batch_size: int = 512,
    microbatch_size: int = 8,
    seq_len: int = 1024,
    act: str = "none",
    block: int = DEFAULT_BLOCK,
    cols: float = 0.125,
    H: int = 50,
    preset: str | Method = "diloco",
    name: str = "",
) -> dict:
    """Bytes per training step of one SWARM (see the module docstring). ``preset``: the method preset
    (or a loaded ``Method``) whose ``compress`` (and streaming fragments) DiLoCo-SWARM's outer sync uses. ``act``:
    any ``swarm.activations`` codec; a ``subspace`` one needs ``model.subspace_rank``; ``cols``: colk's fraction."""
    m = _peers(peers, stages)
    codec = _act_codec(model, act, block, cols)
    ids_item = torch.empty(0, dtype=ids_dtype(model.vocab_size)).element_size()
    _check_sizes(model, batch_size, microbatch_size, seq_len, H)
    method = _diloco_method(preset)
    shards = rank_shards(model, stages, 1)
    stage_params = [sum(torch.Size(s).numel() for _, s in sh) for sh in shards]

    # pipeline: per stage-0 peer, batch_size // mb full microbatches and one remainder
    full, rest = divmod(batch_size, microbatch_size)
    sizes = [microbatch_size] * full + ([rest] if rest else [])
    # each way the codec's bytes; forward also the microbatch's ids (input ids and targets, 2 per token)
    act_link = m[0] * sum(2 * codec.wire_bytes(b * seq_len) for b in sizes)
    ids_link = m[0] * sum(2 * b * seq_len * ids_item for b in sizes)
    link = act_link + ids_link
    pp = (stages - 1) * link
    fp32 = ActCodec("none", model.d_model)
    pp_fp32 = (stages - 1) * m[0] * sum(2 * fp32.wire_bytes(b * seq_len) + 2 * b * seq_len * ids_item for b in sizes)

    swarm_stage, diloco_stage = _stage_sync_bytes(shards, m, method)
    swarm_sync = sum(swarm_stage)
    diloco_sync = sum(diloco_stage)
    diloco_per_step = diloco_sync / H
    return {
        "model": name,
        "n_params": sum(stage_params),
        "stage_params": stage_params,
        "stages": stages,
        "peers": m,
        "batch_size": batch_size,
        "microbatch_size": microbatch_size,
        "microbatches_per_step": m[0] * len(sizes),
        "seq_len": seq_len,
        "tokens_per_step": m[0] * batch_size * seq_len,
        "act": act,
        "block": block,
        "act_values_per_token": codec.width,
        "subspace_rank": model.subspace_rank,
        "H": H,
        "preset": method.name,
        "pipeline_bytes_per_link": link,
        "act_bytes_per_link": act_link,  # of which activations and their gradients (the rest: the ids)
        "ids_bytes_per_link": ids_link,
        "pipeline_bytes": pp,
        "pipeline_bytes_fp32": pp_fp32,
        "act_reduction": pp_fp32 / pp,
        "swarm_sync_bytes_per_stage": swarm_stage,
        "swarm_sync_bytes": swarm_sync,
        "swarm_sync_share": swarm_sync / (swarm_sync + pp),
        "diloco_sync_bytes_per_stage": diloco_stage,
        "diloco_sync_bytes_per_sync": diloco_sync,
        "diloco_sync_bytes_per_step": diloco_per_step,
        "diloco_sync_share": diloco_per_step / (diloco_per_step + pp),
        "diloco_total_reduction": (swarm_sync + pp) / (diloco_per_step + pp),
        # DiLoCo-SWARM with this codec against SWARM with fp32 activations (of the same model)
        "total_reduction_vs_fp32_swarm": (swarm_sync + pp_fp32) / (diloco_per_step + pp),
    }


def plan_config(cfg: Config, name: str = "config") -> dict:
    """The plan of a run's config: ``swarm`` (peers_per_stage, microbatch_size, activations),
    ``train.batch_size``/``seq_len``, and for DiLoCo-SWARM ``outer.sync_every``, ``compress`` and
    ``outer.streaming`` (the runtime's stage sync streams its fragments: ``SwarmPeer._build_outer``; a fragment
    count the stages' layers cannot hold is the same ``ConfigError`` as a peer's)."""
    s = cfg.swarm
    outer = dataclasses.replace(cfg.outer, method="diloco")
    return swarm_plan(
        cfg.model,
        stages=len(s.peers_per_stage),
        peers=list(s.peers_per_stage),
        batch_size=cfg.train.batch_size,
        microbatch_size=s.microbatch_size,
        seq_len=cfg.train.seq_len,
        act=s.activations,
        block=s.activation_block,
        cols=s.activation_cols,
        H=cfg.outer.sync_every,
        preset=Method(name, outer, cfg.compress),
        name=name,
    )


def format_table(rows: list[dict]) -> str:
    head = [
        "model",
        "params",
        "PP/link/step",
        "PP/step",
        "SWARM sync/step",
        "SWARM sync share",
        "DiLoCo-SWARM sync/step",
        "DiLoCo-SWARM sync share",
        "total saved",
        "activation saving",
        "saved vs fp32 SWARM",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["model"],
            f"{r['n_params'] / 1e6:,.0f}M",
            fmt_bytes(r["pipeline_bytes_per_link"]),
            fmt_bytes(r["pipeline_bytes"]),
            fmt_bytes(r["swarm_sync_bytes"]),
            f"{r['swarm_sync_share']:.1%}",
            fmt_bytes(r["diloco_sync_bytes_per_step"]),
            f"{r['diloco_sync_share']:.1%}",
            f"{r['diloco_total_reduction']:.2f}x",
            f"{r['act_reduction']:.1f}x",
            f"{r['total_reduction_vs_fp32_swarm']:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dilocox plan --swarm",
        description="SWARM / DiLoCo-SWARM: pipeline bytes vs stage-sync bytes per step (GPT-2 family by default)",
    )
    ap.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"a configs/model YAML or a GPT-2 size {list(GPT2_SHAPES)}; repeatable (default: the four GPT-2 sizes)",
    )
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages n")
    ap.add_argument("--peers", default="4", help="peers per stage: one number, or a comma list (one per stage)")
    ap.add_argument("--batch-size", type=int, default=512, help="sequences per stage-0 peer per step")
    ap.add_argument("--microbatch-size", type=int, default=8, help="sequences per microbatch")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--act", default="none", choices=list(CODECS), help="activation codec between stages")
    ap.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="values per int8/int4 scale")
    ap.add_argument(
        "--subspace-rank",
        type=int,
        default=0,
        help="model.subspace_rank k of the planned models (a subspace codec sends k values per token; needs k > 0)",
    )
    ap.add_argument("--cols", type=float, default=0.125, help="colk: fraction of the d_model columns kept")
    ap.add_argument("--H", type=int, default=50, help="DiLoCo-SWARM inner steps per outer sync")
    ap.add_argument("--preset", default="diloco", help="configs/methods preset for DiLoCo-SWARM's outer compression")
    ap.add_argument(
        "--config",
        default=None,
        help="plan a run config instead (its swarm, train, outer.sync_every and compress sections; "
        "the other options are ignored)",
    )
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    try:
        if args.config:
            if not os.path.isfile(args.config):
                raise ValueError(f"--config {args.config!r}: no such file")
            rows = [plan_config(load_config(args.config), os.path.basename(args.config).removesuffix(".yaml"))]
            return _print(rows, args.json)
        peers: int | list[int]
        parts = [p.strip() for p in str(args.peers).split(",")]  # (an empty item, "1,,2", is an error too)
        if not parts or not all(p.isdigit() for p in parts):
            raise ValueError(f"--peers {args.peers!r}: write one count (4) or one per stage (4,2)")
        peers = int(parts[0]) if len(parts) == 1 else [int(p) for p in parts]
        rows = []
        for spec in args.model or list(GPT2_SHAPES):
            if spec in GPT2_SHAPES:
                mcfg, label = gpt2_model(spec), spec
            else:
                if not os.path.exists(spec):
                    raise ValueError(f"--model {spec!r}: no such file and not one of {list(GPT2_SHAPES)}")
                mcfg, label = load_config(spec).model, os.path.basename(spec).removesuffix(".yaml")
            if args.subspace_rank:
                if not 0 < args.subspace_rank < mcfg.d_model:
                    raise ValueError(f"--subspace-rank {args.subspace_rank} must be in [1, d_model={mcfg.d_model})")
                mcfg = dataclasses.replace(mcfg, subspace_rank=args.subspace_rank)
            rows.append(
                swarm_plan(
                    mcfg,
                    stages=args.stages,
                    peers=peers,
                    batch_size=args.batch_size,
                    microbatch_size=args.microbatch_size,
                    seq_len=args.seq_len,
                    act=args.act,
                    block=args.block,
                    cols=args.cols,
                    H=args.H,
                    preset=args.preset,
                    name=label,
                )
            )
    except (ValueError, OSError, ConfigError) as e:
        print(f"dilocox plan --swarm: error: {e}", file=sys.stderr)
        return 2
    return _print(rows, args.json)


def _print(rows: list[dict], json_path: str | None) -> int:
    r0 = rows[0]
    print(
        f"# SWARM plan: {r0['stages']} stages x peers {r0['peers']}, {r0['batch_size']} sequences of "
        f"{r0['seq_len']} per stage-0 peer per step ({r0['microbatches_per_step']} microbatches of "
        f"{r0['microbatch_size']}), activations {r0['act']}"
        + (f"/block {r0['block']}" if "int" in r0["act"] else "")
        + (
            f" ({r0['act_values_per_token']} values per token, model.subspace_rank {r0['subspace_rank']})"
            if r0["act"].startswith("subspace")
            else ""
        )
        + f"; DiLoCo-SWARM H={r0['H']} ({r0['preset']} compression)\n"
        "# bytes summed over all peers; SWARM sync: fp32 gradients every step; "
        "DiLoCo-SWARM: one outer sync / H\n"
    )
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
