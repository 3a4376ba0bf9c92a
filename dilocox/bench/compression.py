"""Compression ratio and reconstruction error of the pseudo-gradient compressors:
``python -m dilocox.bench.compression [--model gpt2-small] [--ranks 4 16 64] [--no-real] [--json PATH]``.

For every parameter shape of the model (``configs/model/<model>.yaml`` built on the meta
device; GPT-2 small shapes hard-coded if the file is missing) it builds pseudo-gradient-like
tensors and runs them through ``Compressor.allreduce_mean`` exactly as the outer optimizer
does, on a one-rank group (the compression math is the same for R replicas; only the wire
is skipped). Reported per method:

- ``ratio``: fp32 bytes of Δ ÷ bytes of this rank's compressed message per outer sync
  (``Compressor.payload_bytes``). With R = 2 this is also fp32 ring all-reduce bytes ÷
  all-gather bytes on the wire; for R replicas the all-gather sends (R−1)× the message.
- ``err@1``: ‖Ĉ(Δ) − Δ‖ / ‖Δ‖ of the first sync (cold-start Q, error feedback off).
- ``err@3``: the same at the third sync on the same Δ (warm-started Q: PowerSGD's power
  iteration has converged towards the top-r subspace, as when Δ drifts slowly).
- ``svd@r``: the error of the exact rank-r truncated SVD of the factored matrices (the rest
  exact, no quantization): the floor that any rank-r method has on this Δ.

Synthetic pseudo-gradients: for each n×m matrix, Δ = A·diag(σ)·B / √k + noise with k =
min(n, m, 256) Gaussian factor pairs, σ_j = (j + 1)^−1 (a power-law spectrum, the shape
reported for gradients and weight updates of transformers), and i.i.d. noise carrying 10 %
of the energy (the flat tail); vectors are i.i.d. Gaussian. ``real``: the difference of a
tiny GPT-2 (configs/model/gpt2-tiny.yaml) before and after 20 AdamW steps on byte-level
Python standard-library source — an actual pseudo-gradient, small matrices (d = 128).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

import torch

from dilocox.bench.runner import out_file
from dilocox.compress.compressor import Compressor
from dilocox.config import LowRankConfig, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpt2_small_shapes() -> list[tuple[str, torch.Size]]:
    """GPT-2 small (12 layers, d 768, vocab 50304, seq 1024, untied head) without the config file."""
    d, f, V, S = 768, 3072, 50304, 1024
    out = [("embed.weight", torch.Size([V, d])), ("pos_embed.weight", torch.Size([S, d]))]
    for i in range(12):
        p = f"layers.{i}."
        out += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,))]
        for n in ("q", "k", "v", "o"):
            out += [(p + f"attn.{n}_proj.weight", (d, d)), (p + f"attn.{n}_proj.bias", (d,))]
        out += [
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.up_proj.bias", (f,)),
            (p + "mlp.down_proj.weight", (d, f)),
            (p + "mlp.down_proj.bias", (d,)),
        ]
    out += [("norm_f.weight", (d,)), ("norm_f.bias", (d,)), ("head.weight", (V, d))]
    return [(n, torch.Size(s)) for n, s in out]


def model_config(model: str) -> ModelConfig | None:
    """A model config: a name of configs/model/ (gpt2-tiny) or a YAML file's path; None when there is none."""
    path = model if model.endswith((".yaml", ".yml")) else os.path.join(ROOT, "configs", "model", f"{model}.yaml")
    if not os.path.exists(path):
        return None
    from dilocox.config import load_config

    return load_config(path).model


def model_shapes(model: str) -> list[tuple[str, torch.Size]]:
    mcfg = model_config(model)
    if mcfg is None:
        if model != "gpt2-small":
            raise FileNotFoundError(
                f"no model config {model!r}: give a name of configs/model/ (e.g. gpt2-tiny) or a YAML file's path"
            )
        return gpt2_small_shapes()
    from dilocox.model.transformer import build_model

    return [(n, p.shape) for n, p in build_model(mcfg, device="meta").named_parameters()]


def synthetic_pseudo_gradients(
    shapes: list[torch.Size], seed: int = 0, k_max: int = 256, noise: float = 0.1
) -> list[torch.Tensor]:
    """Power-law-spectrum matrices plus a 10 % noise floor; Gaussian vectors (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        if len(s) < 2:
            out.append(torch.randn(s, generator=g) * 1e-3)
            continue
        n, m = s[0], math.prod(s[1:])
        k = min(n, m, k_max)
        sig = 1.0 / torch.arange(1, k + 1, dtype=torch.float32)
        low = (torch.randn(n, k, generator=g) * sig) @ torch.randn(k, m, generator=g) / math.sqrt(k)
        tail = torch.randn(n, m, generator=g)
        tail *= math.sqrt(noise / (1 - noise)) * low.norm() / tail.norm()
        out.append(((low + tail) * 1e-3).view(s))
    return out


def _corpus_tokens(n_bytes: int) -> torch.Tensor:
    """Bytes of Python standard-library source files (always present, no download)."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    buf = bytearray()
    for f in files:
        with open(f, "rb") as fh:
            buf += fh.read()
        if len(buf) >= n_bytes:
            break
    return torch.tensor(list(buf[:n_bytes]), dtype=torch.long)


def real_pseudo_gradients(
    model: str = "gpt2-tiny", steps: int = 20, batch: int = 8, seq: int = 128, seed: int = 0
) -> tuple[list[str], list[torch.Tensor]]:
    """θ_0 − θ_steps of a tiny model after ``steps`` AdamW steps (lr 1e-3) on byte-level text."""
    from dilocox.model.transformer import build_model

    mcfg = model_config(model)
    if mcfg is None:
        raise FileNotFoundError(
            f"no model config {model!r}: give a name of configs/model/ (e.g. gpt2-tiny) or a YAML file's path"
        )
    torch.manual_seed(seed)
    net = build_model(mcfg, seed=seed)
    theta0 = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = _corpus_tokens(400_000)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + seq] for i in idx])
        y = torch.stack([data[i + 1 : i + seq + 1] for i in idx])
        loss = net.loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    names = [n for n, _ in net.named_parameters()]
    return names, [t0 - p.detach() for t0, p in zip(theta0, net.parameters())]


def spectra(deltas: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Squared singular values (descending, float64) of every tensor with ≥ 2 dims."""
    out = []
    for d in deltas:
        if d.dim() < 2:
            out.append(None)
            continue
        m = d.reshape(d.shape[0], -1).double()
        gram = m.t() @ m if m.shape[0] >= m.shape[1] else m @ m.t()
        out.append(torch.linalg.eigvalsh(gram).clamp_min(0).flip(0))
    return out


def svd_floor(comp: Compressor, spec: list[torch.Tensor | None], norm2: float) -> float:
    """Relative error of the exact rank-r truncation of the matrices ``comp`` factors."""
    if comp.lowrank is None:
        return 0.0
    r = comp.lowrank.rank
    return math.sqrt(sum(float(spec[i][r:].sum()) for i in comp.lowrank.factored) / norm2)


def evaluate(
    deltas: list[torch.Tensor],
    quant: str,
    rank: int | None,
    group_size: int = 128,
    syncs: int = 3,
    spec: list[torch.Tensor | None] | None = None,
) -> dict:
    """Compression ratio and relative error at sync 1 and sync ``syncs`` (same Δ, no error feedback)."""
    comp = Compressor(
        [d.shape for d in deltas],
        quant=quant,
        group_size=group_size,
        error_feedback=False,
        lowrank_rank=rank,
        min_compression=LowRankConfig().min_compression,
        seed=0,
    )
    norm2 = sum(float(d.double().square().sum()) for d in deltas)
    errs, t0 = [], time.perf_counter()
    for step in range(syncs):
        out = comp.allreduce_mean(deltas, None, step)
        err2 = sum(float((o.double() - d.double()).square().sum()) for o, d in zip(out, deltas))
        errs.append(math.sqrt(err2 / norm2))
    fp32 = 4 * sum(d.numel() for d in deltas)
    payload = comp.payload_bytes()
    n_fact = len(comp.lowrank.factored) if comp.lowrank is not None else 0
    row = {
        "quant": quant,
        "rank": rank or 0,
        "factored": n_fact,
        "fp32_MB": fp32 / 1e6,
        "payload_MB": payload / 1e6,
        "ratio": fp32 / payload,
        "err@1": errs[0],
        f"err@{syncs}": errs[-1],
        "seconds": (time.perf_counter() - t0) / syncs,
    }
    if spec is not None:
        row["svd@r"] = svd_floor(comp, spec, norm2)
    return row


def run(
    model: str = "gpt2-small", ranks: tuple[int, ...] = (4, 16, 64), real: bool = True, seed: int = 0
) -> list[dict]:
    """Rows for int4 alone and low-rank r ∈ ``ranks`` + int4, on synthetic (and real) Δ."""
    rows = []
    named = model_shapes(model)
    sets = [(f"synthetic {model}", lambda: synthetic_pseudo_gradients([s for _, s in named], seed))]
    if real:
        sets.append(("real gpt2-tiny", lambda: real_pseudo_gradients(seed=seed)[1]))
    for label, make in sets:
        deltas = make()
        spec = spectra(deltas)
        rows.append({"data": label, **evaluate(deltas, "int4", None, spec=spec)})
        for r in ranks:
            rows.append({"data": label, **evaluate(deltas, "int4", r, spec=spec)})
        del deltas
    return rows


def markdown(rows: list[dict]) -> str:
    cols = ["data", "method", "factored", "fp32 MB", "payload MB", "ratio", "err@1", "err@3", "svd@r"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        method = f"low-rank r={r['rank']} + {r['quant']}" if r["rank"] else r["quant"]
        lines.append(
            f"| {r['data']} | {method} | {r['factored']} | {r['fp32_MB']:.1f} | {r['payload_MB']:.3f} | "
            f"{r['ratio']:.1f}x | {r['err@1']:.3f} | {r['err@3']:.3f} | {r.get('svd@r', float('nan')):.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox bench compression", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-small", help="a name of configs/model/ or a model YAML's path")
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--no-real", action="store_true", help="skip the real tiny-model pseudo-gradients")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=out_file, help="also write the rows to this file (its directory made if missing)")
    args = ap.parse_args(argv)
    if min(args.ranks) < 1:
        ap.error(f"--ranks {args.ranks}: each rank must be >= 1")
    if model_config(args.model) is None and args.model != "gpt2-small":
        ap.error(
            f"--model {args.model!r}: no such model config; give a name of configs/model/ (e.g. gpt2-tiny) or a path"
        )
    rows = run(args.model, tuple(args.ranks), real=not args.no_real, seed=args.seed)
    print(markdown(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
