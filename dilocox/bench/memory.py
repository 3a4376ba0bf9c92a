"""``dilocox bench memory``: what ``train.recompute`` saves in memory and costs in time, on ``dilocox train``'s step.

For each case (a model shape with the batch and sequence length of its device, as in ``bench train --reference``)
one process builds the Trainer and, for each mode (``none``, ``full``, ``selective``; the mode is a switch on the
model, so every mode runs the same weights and batches):

* **held bytes**: what the forward (the trainer's model and loss, eager) leaves for the backward: the activations
  and the loss's saved tensors, the memory recomputation is about; **peak bytes**: the most held at once over that
  forward and its backward (recomputed activations and gradients included). Both counted exactly, per storage, by
  ``ActivationMeter`` (a ``TorchDispatchMode``), so on a CPU as on a GPU. On a GPU also
  ``torch.cuda.max_memory_allocated`` of a whole trainer step (weights, optimizer state and its update included),
  in the mode asked for (compiled or eager).
* **step seconds**: the median over timed steps taken in alternating blocks of the modes (one step each on a CPU,
  10 on a GPU, each block ending with a sync), after warm-up steps of every mode (compilation happens there).

Results: ``--out``/results.json and results.md (``python -m dilocox.bench.report`` pastes it into
docs/BENCHMARKS.md). ``tests/test_recompute.py`` checks that the modes train bit-identically; this measures what
they trade.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dilocox.bench.runner import machine_line, out_dir
from dilocox.model.recompute import MODES


class ActivationMeter(TorchDispatchMode):
    """Counts the bytes of the storages that the ops run inside it create, while they live: ``current`` now,
    ``peak`` the most at once. A storage is counted once (views and in-place results share it) and uncounted when it
    is freed (a weakref finalizer), so what autograd keeps for the backward stays counted until the backward drops
    it. Storages made before the meter was entered (weights, optimizer state) are not counted, nor views of them.

    Storages are told apart by their ``StorageImpl`` (``_cdata``), not by ``data_ptr()``: an op that grows a
    storage in place (an ``out=`` or ``resize_`` output) moves its data and frees its old block while the storage
    lives on, and a new storage may then get that address; keyed by address, the new one was not counted and the
    old one's finalizer later dropped the new one's entry. A storage counted here that an op resized is recounted
    at its new size."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # StorageImpl (``UntypedStorage._cdata``) -> bytes counted for it
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: not new memory (a weight's transpose is the weight)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                st = t.untyped_storage()
                key, n = st._cdata, st.nbytes()
                if key in self.live:  # one of ours, maybe resized in place (out=, resize_)
                    self.current += n - self.live[key]
                    self.live[key] = n
                elif key not in inputs:  # new (zero bytes too: an out= op may grow it later)
                    self.live[key] = n
                    self.current += n
                    weakref.finalize(st, self._freed, key)
                else:
                    continue
                self.peak = max(self.peak, self.current)
        return out

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _held_and_peak(model, x, y, engine) -> tuple[int, int]:
    """Bytes the forward leaves for the backward (activations and the loss's saved tensors), and the most held at
    once over forward + backward (the gradients included): the model and loss of the trainer's step, eager."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    autocast = engine.runner.autocast_dtype
    with torch.compiler.set_stance("force_eager"), ActivationMeter() as meter:
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            loss = model.loss(model(x), y)
        held = meter.current
        loss.backward()
    model.zero_grad(set_to_none=True)
    return held, meter.peak


def run_case(case: str, device: str, compiled: bool, modes: list[str], warmup: int, steps: int, work: str) -> list:
    from dilocox.bench.reference import DilocoxSide, dilocox_config

    mode_name = "compiled" if compiled else "eager"
    total = warmup * len(modes) + steps * len(modes) + 2 * len(modes) + 10
    cfg = dilocox_config(case, device, mode_name, total, os.path.join(work, f"{case}-{mode_name}"))
    side = DilocoxSide(cfg)
    model, dev = side.tr.model, side.device
    rows = {m: {"step_s": []} for m in modes}
    try:
        for m in modes:  # warm-up (compilation of each mode's graph happens here)
            model.recompute = m
            for _ in range(warmup):
                side.step()
        x, y = (t.to(dev) for t in side.tr.sampler.batch_at(0))
        for m in modes:  # one eager forward + backward of the model under the meter
            model.recompute = m
            rows[m]["held_bytes"], rows[m]["peak_bytes"] = _held_and_peak(model, x, y, side.tr.engine)
        if dev.type == "cuda":  # the whole allocation, in the asked mode
            for m in modes:
                model.recompute = m
                _sync(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                side.step()
                _sync(dev)
                rows[m]["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        block = 1 if dev.type == "cpu" else 10
        for _ in range(max(1, steps // block)):
            for m in modes:
                model.recompute = m
                _sync(dev)
                t0 = time.perf_counter()
                for _ in range(block):
                    side.step()
                _sync(dev)
                rows[m]["step_s"].append((time.perf_counter() - t0) / block)
    finally:
        side.close()
    tokens = cfg.train.batch_size * cfg.train.seq_len
    base = rows.get("none")
    out = []
    for m in modes:
        r = rows[m]
        med = statistics.median(r["step_s"])
        out.append({
            "model": case, "mode": mode_name, "recompute": m, "device": device, "batch": cfg.train.batch_size,
            "seq_len": cfg.train.seq_len, "params_m": round(cfg.model.num_params() / 1e6, 1),
            "held_bytes": r["held_bytes"], "peak_bytes": r["peak_bytes"],
            "cuda_max_allocated_bytes": r.get("cuda_max_allocated_bytes"),
            "step_s": round(med, 5), "tokens_per_s": round(tokens / med, 1),
            "held_vs_none": round(r["held_bytes"] / base["held_bytes"], 3) if base else None,
            "peak_vs_none": round(r["peak_bytes"] / base["peak_bytes"], 3) if base else None,
            "time_vs_none": round(med / statistics.median(base["step_s"]), 3) if base else None,
            "timed_steps": len(r["step_s"]), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        })  # fmt: skip
    return out


def markdown(rows: list[dict], command: str) -> str:
    def mb(v):
        return "-" if v is None else f"{v / 1e6:,.1f}"

    lines = [
        f"Machine: {machine_line()}; {time.strftime('%Y-%m-%d')}; `{command}`. Held: the bytes the forward leaves "
        "for the backward (activations, the loss's saved tensors); peak: the most held at once over forward + "
        "backward, gradients included (eager, counted per storage; weights and optimizer state not included); CUDA "
        "max allocated: a whole training step's, everything included; step time: the trainer's step, the median over "
        "alternating blocks of the modes.",
        "",
        "| model | batch x seq | mode | recompute | held MB | vs none | peak MB | vs none | CUDA max allocated MB "
        "| step s | vs none | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['params_m']}M) | {r['batch']} x {r['seq_len']} | {r['mode']} | {r['recompute']} "
            f"| {mb(r['held_bytes'])} | {r['held_vs_none']}x | {mb(r['peak_bytes'])} | {r['peak_vs_none']}x "
            f"| {mb(r['cuda_max_allocated_bytes'])} | {r['step_s']:.4f} | {r['time_vs_none']}x "
            f"| {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from dilocox.bench.reference import CASES

    ap = argparse.ArgumentParser(
        prog="dilocox bench memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cases", nargs="+", default=["tiny", "gpt2-small"], choices=list(CASES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="recompute modes")
    ap.add_argument("--compiled", action="store_true", help="train.compile=true (the meter's step stays eager)")
    ap.add_argument("--warmup", type=int, default=2, help="steps per mode before measuring")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    ap.add_argument("--out", type=out_dir, default="docs/bench/memory", help="where results.json / results.md go")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    work = tempfile.mkdtemp(prefix="dilocox-bench-memory-")
    rows = []
    for case in a.cases:
        rows += run_case(case, a.device, a.compiled, a.modes, a.warmup, a.steps, work)
    command = "dilocox bench memory " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(rows, command.strip())
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
