"""Micro-benchmark of the compression kernels: ``dilocox bench kernels`` /
``python -m dilocox.bench.kernels [--sizes 1M 16M] [--threads 1 2] [--device cuda] [--json PATH]``.

Effective bandwidth = (bytes read + bytes written) / time, next to a plain copy
(``dst.copy_(src)``) of the same fp32 buffer measured in the same run (8 bytes/element)
and the pure-torch reference of the same op:

* ``ef_quantize_pack_int4``: read x, e; write e, payload -> 12 + 0.5 + 2/G bytes/element
  (fused error feedback + int4 quantize + pack, the worker's send side);
* ``ef_quantize_pack_sr_int4``: same with stochastic rounding;
* ``dequantize_accumulate_int4``: read payload, out; write out -> 8 + 0.5 + 2/G bytes/element
  (receive side of a quantized all-reduce).

CPU times are the median of ``repeats`` wall-clock runs after a warm-up; CUDA times use
CUDA events around each run. Thread count = ``torch.set_num_threads`` (the compiled CPU
kernels follow it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dilocox.compress import kernels
from dilocox.compress.quant import payload_nbytes

DEFAULT_SIZES = [1 << 16, 1 << 20, 1 << 22, 1 << 24]


def parse_size(text: str) -> int:
    t = text.strip().upper()
    if "^" in t:
        base, exp = t.split("^")
        return int(base) ** int(exp)
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _time_once(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timeit(fns, repeats: int, device: torch.device) -> list[float]:
    """Median seconds per call of each fn, after one warm-up call each. The fns are run
    round-robin so that a noisy machine slows all of them alike (ratios stay meaningful)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(max(1, repeats)):
        for i, fn in enumerate(fns):
            times[i].append(_time_once(fn, device))
    return [statistics.median(t) for t in times]


def run(sizes=None, group_size: int = 128, repeats: int = 10, device="cpu", threads: int | None = None,
        reference: bool = True, ref_repeats: int = 3) -> list[dict]:
    """Benchmark rows (one dict per op and size); see the module docstring."""
    dev = torch.device(device)
    sizes = list(sizes or DEFAULT_SIZES)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    compiled = kernels.have_extension(dev)
    rows = []
    try:
        for n in sizes:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(n, generator=g).to(dev)
            e = (torch.randn(n, generator=g) * 1e-3).to(dev)
            dst = torch.empty_like(x)
            out = torch.zeros_like(x)
            payload = torch.empty(payload_nbytes("int4", n, group_size), dtype=torch.uint8, device=dev)
            pbytes = payload.numel()

            def quant(sr, use_kernel):
                return lambda: kernels.ef_quantize_pack(x, e, payload, group_size, 4, sr, 1, 2, use_kernel=use_kernel)

            def deq(use_kernel):
                return lambda: kernels.dequantize_into(payload, out, group_size, 4, True, use_kernel=use_kernel)

            ops = [("ef_quantize_pack_int4", quant(False, True), quant(False, False), 12.0 * n + pbytes),
                   ("ef_quantize_pack_sr_int4", quant(True, True), quant(True, False), 12.0 * n + pbytes),
                   ("dequantize_accumulate_int4", deq(True), deq(False), 8.0 * n + pbytes)]
            t_copy, *t_ops = _timeit([lambda: dst.copy_(x)] + [op[1] for op in ops], repeats, dev)
            bw_copy = 8.0 * n / t_copy / 1e9
            base = dict(numel=n, device=str(dev), threads=torch.get_num_threads(), group_size=group_size)
            rows.append(dict(base, op="copy (fp32)", ms=t_copy * 1e3, gbps=bw_copy, pct_of_copy=100.0,
                             ref_ms=None, speedup_vs_ref=None, compiled=None))
            for (name, _, ref_fn, nbytes), t in zip(ops, t_ops):
                t_ref = _timeit([ref_fn], ref_repeats, dev)[0] if reference else None
                rows.append(dict(base, op=name, ms=t * 1e3, gbps=nbytes / t / 1e9,
                                 pct_of_copy=100.0 * (nbytes / t) / (8.0 * n / t_copy),
                                 ref_ms=None if t_ref is None else t_ref * 1e3,
                                 speedup_vs_ref=None if t_ref is None else t_ref / t, compiled=compiled))
    finally:
        torch.set_num_threads(old_threads)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| op | numel | threads | ms | GB/s | % of copy | reference ms | speedup vs reference |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = "" if r["ref_ms"] is None else f"{r['ref_ms']:.2f}"
        sp = "" if r["speedup_vs_ref"] is None else f"{r['speedup_vs_ref']:.1f}x"
        lines.append(f"| {r['op']} | {r['numel']:,} | {r['threads']} | {r['ms']:.3f} | {r['gbps']:.1f} | "
                     f"{r['pct_of_copy']:.0f} | {ref} | {sp} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=DEFAULT_SIZES,
                    help="element counts, e.g. 65536 1M 16M 2^24 (default: 64K 1M 4M 16M)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--ref-repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", nargs="+", type=int, default=None,
                    help="torch/OpenMP thread counts to run (default: current)")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the pure-torch reference")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    if not kernels.have_extension(dev):
        print(f"note: compiled kernels not available for {dev.type}; 'kernel' rows time the reference")
    rows = []
    for t in args.threads or [None]:
        rows += run(args.sizes, args.group_size, args.repeats, dev, t, not args.no_reference, args.ref_repeats)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
