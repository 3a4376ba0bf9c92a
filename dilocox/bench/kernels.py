"""Micro-benchmark of the compression kernels: ``dilocox bench kernels`` /
``python -m dilocox.bench.kernels [--sizes 1M 16M] [--threads 1 2] [--device cuda] [--json PATH]``.

Bytes convention (the same for every row): bytes MOVED between memory and the cores, a store
to a buffer that is not read first counting twice (write-allocate: the line is read, then
written back), a read-modify-write of a buffer counting read + write. Effective bandwidth =
bytes moved / time, compared with two references of the same fp32 buffer timed in the same run:

* ``add_ (in-place, roofline)``: ``a.add_(b)``: read a, b; write a -> 12 bytes/element. The
  roofline reference: the same traffic pattern as the fused send kernel (two streams in, one
  updated in place), no write-allocate;
* ``copy (fp32)``: ``dst.copy_(src)``: read src; write-allocate + write dst -> 12 bytes/element;

and the kernels:

* ``ef_quantize_pack_int4``: read x, e; write e in place; write-allocate + write the payload
  -> 12 + 2 (0.5 + 2/G) bytes/element (fused error feedback + int4 quantize + pack, the send side);
* ``ef_quantize_pack_sr_int4``: same with stochastic rounding;
* ``dequantize_accumulate_int4``: read payload, out; write out in place -> 8 + 0.5 + 2/G
  bytes/element (receive side of a quantized all-reduce).

(Before this convention a copy was counted at 8 bytes/element and the kernels at 12.5, so
"% of copy" over 100 was an artifact of the counting.) CPU times are the median of ``repeats``
wall-clock runs after a warm-up, the ops run round-robin; CUDA times use CUDA events. The
1-minute load average is read after every size and printed beside its rows; above the core
count the machine is oversubscribed and a warning is printed (the timings are then
upper bounds). Thread count = ``torch.set_num_threads`` (the compiled CPU kernels follow it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from dilocox.bench.runner import machine_line, out_file, out_path_problem
from dilocox.compress import kernels
from dilocox.compress.quant import payload_nbytes
from dilocox.compress.sparse import encode as sparse_encode
from dilocox.compress.sparse import tensor_payload_bytes

DEFAULT_SIZES = [1 << 16, 1 << 20, 1 << 22, 1 << 24]


def parse_size(text: str) -> int:
    """An element count: 65536, 64K, 1M, 1.5G, 2^24 (> 0)."""
    t = text.strip().upper()
    try:
        if "^" in t:
            base, exp = t.split("^")
            n = int(base) ** int(exp)
        else:
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
            n = int(float(t[:-1] if mult > 1 else t) * mult)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an element count (e.g. 65536, 64K, 1M, 2^24)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an element count must be >= 1")
    return n


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return n


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


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def overloaded(load: float | None, cores: int | None = None) -> bool:
    """True when more runnable processes than cores competed for the machine."""
    cores = cores or os.cpu_count() or 1
    return load is not None and load > cores


def _kernel_ops(x, e, out, payload, group_size: int, n: int) -> list[tuple]:
    """(name, kernel call, pure-torch reference call, bytes moved) of each timed kernel on one size's buffers."""
    pbytes = payload.numel()

    def quant(sr, use_kernel):
        return lambda: kernels.ef_quantize_pack(x, e, payload, group_size, 4, sr, 1, 2, use_kernel=use_kernel)

    def deq(use_kernel):
        return lambda: kernels.dequantize_into(payload, out, group_size, 4, True, use_kernel=use_kernel)

    def sparse(use_kernel):  # compress.sparse's preset: top 1/64 of each 4096-chunk, 2-bit values
        return lambda: sparse_encode(x, 4096, 1 / 64, 2, use_kernel=use_kernel)

    sbytes = tensor_payload_bytes(n, 4096, 1 / 64, 2)
    return [
        ("ef_quantize_pack_int4", quant(False, True), quant(False, False), 12.0 * n + 2 * pbytes),
        ("ef_quantize_pack_sr_int4", quant(True, True), quant(True, False), 12.0 * n + 2 * pbytes),
        ("dequantize_accumulate_int4", deq(True), deq(False), 8.0 * n + pbytes),
        ("sparse_encode (top 1/64, 2-bit)", sparse(True), sparse(False), 4.0 * n + 2 * sbytes),
    ]


def _row(base: dict, name: str, t: float, nbytes: float, bw_add: float, t_ref: float | None, compiled) -> dict:
    """One row: ``name`` took ``t`` s moving ``nbytes``; ``bw_add``: the in-place add's bytes/s of the same size."""
    return dict(
        base,
        op=name,
        ms=t * 1e3,
        bytes_moved=nbytes,
        gbps=nbytes / t / 1e9,
        pct_of_roofline=100.0 * (nbytes / t) / bw_add,
        ref_ms=None if t_ref is None else t_ref * 1e3,
        speedup_vs_ref=None if t_ref is None else t_ref / t,
        compiled=compiled,
    )


def _size_rows(
    n: int, group_size: int, repeats: int, dev: torch.device, reference: bool, ref_repeats: int, compiled
) -> list[dict]:
    """The rows of one size: the two fp32 references (in-place add, copy), then the kernels."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).to(dev)
    e = (torch.randn(n, generator=g) * 1e-3).to(dev)
    dst = torch.empty_like(x)
    out = torch.zeros_like(x)
    payload = torch.empty(payload_nbytes("int4", n, group_size), dtype=torch.uint8, device=dev)
    ops = _kernel_ops(x, e, out, payload, group_size, n)
    a, b = torch.randn(n, generator=g).to(dev), torch.randn(n, generator=g).to(dev)
    t_add, t_copy, *t_ops = _timeit([lambda: a.add_(b), lambda: dst.copy_(x)] + [op[1] for op in ops], repeats, dev)
    bw_add = 12.0 * n / t_add
    load = load_average()
    base = dict(
        numel=n,
        device=str(dev),
        threads=torch.get_num_threads(),
        group_size=group_size,
        load_avg=load,
        cores=os.cpu_count(),
    )
    refs = [("add_ (in-place, roofline)", t_add, 12.0 * n), ("copy (fp32)", t_copy, 12.0 * n)]
    rows = [_row(base, name, t, nbytes, bw_add, None, None) for name, t, nbytes in refs]
    for (name, _, ref_fn, nbytes), t in zip(ops, t_ops):
        t_ref = _timeit([ref_fn], ref_repeats, dev)[0] if reference else None
        rows.append(_row(base, name, t, nbytes, bw_add, t_ref, compiled))
    if overloaded(load):
        print(
            f"warning: load average {load:.2f} > {os.cpu_count()} cores while timing numel={n:,}: "
            "the machine is oversubscribed, these timings are upper bounds",
            file=sys.stderr,
        )
    return rows


def run(
    sizes=None,
    group_size: int = 128,
    repeats: int = 10,
    device="cpu",
    threads: int | None = None,
    reference: bool = True,
    ref_repeats: int = 3,
) -> list[dict]:
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
            rows += _size_rows(n, group_size, repeats, dev, reference, ref_repeats, compiled)
    finally:
        torch.set_num_threads(old_threads)
    return rows


CONVENTION = (
    "Bytes moved per element: `add_` (roofline) 12 = read a, b + write a in place; copy 12 = read src + "
    "write-allocate and write dst; ef_quantize_pack 12 + 2(0.5 + 2/G) = read x, e + write e in place + "
    "write-allocate and write the payload; dequantize_accumulate 8 + 0.5 + 2/G = read payload, out + write "
    "out in place; sparse_encode 4 + 2 x 0.020 = read x + write-allocate and write the payload (Rice-coded "
    "indices since 2026-11-30, 0.028 with fixed-width ones before; its reference is the vectorised torch encoder, "
    "itself checked against plain loops). GB/s = bytes moved / time; % of "
    "roofline = GB/s / the in-place add's GB/s of the same size and thread count; load = 1-minute load average "
    "after the size's timings (cores: {cores}; a load above the core count marks an oversubscribed machine, its "
    "timings are upper bounds)."
)


def format_table(rows: list[dict]) -> str:
    cores = rows[0].get("cores") if rows else os.cpu_count()
    lines = [
        CONVENTION.format(cores=cores),
        "",
        "| op | numel | threads | ms | bytes/elem | GB/s | % of roofline | reference ms | speedup vs reference "
        "| load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = "" if r["ref_ms"] is None else f"{r['ref_ms']:.2f}"
        sp = "" if r["speedup_vs_ref"] is None else f"{r['speedup_vs_ref']:.1f}x"
        load = r.get("load_avg")
        ld = "?" if load is None else f"{load:.2f}" + (" (> cores)" if overloaded(load, r.get("cores")) else "")
        lines.append(
            f"| {r['op']} | {r['numel']:,} | {r['threads']} | {r['ms']:.3f} | "
            f"{r['bytes_moved'] / r['numel']:.2f} | {r['gbps']:.1f} | {r['pct_of_roofline']:.0f} | {ref} | "
            f"{sp} | {ld} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=DEFAULT_SIZES,
        help="element counts, e.g. 65536 1M 16M 2^24 (default: 64K 1M 4M 16M)",
    )
    ap.add_argument("--group-size", type=_positive_int, default=128)
    ap.add_argument("--repeats", type=_positive_int, default=10)
    ap.add_argument("--ref-repeats", type=_positive_int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--threads",
        nargs="+",
        type=_positive_int,
        default=None,
        help="torch/OpenMP thread counts to run (default: current)",
    )
    ap.add_argument("--no-reference", action="store_true", help="skip timing the pure-torch reference")
    ap.add_argument(
        "--json", metavar="PATH", type=out_file, help="also write the rows as JSON (and results.md next to it)"
    )
    args = ap.parse_args(argv)
    md = os.path.join(os.path.dirname(os.path.abspath(args.json)), "results.md") if args.json else None
    if md and out_path_problem(md, directory=False):  # (the JSON's own path: checked by out_file)
        ap.error(f"argument --json: the table goes next to it, to {md}: a directory or not writable; give another")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA GPU (torch.cuda.is_available() is False); use --device cpu")
    if args.group_size % 2:  # (int4 packs two values a byte, and a group never shares a byte with the next)
        ap.error(f"--group-size {args.group_size}: must be even (int4 packs two values a byte), e.g. 128")
    if not kernels.have_extension(dev):
        print(f"note: compiled kernels not available for {dev.type}; 'kernel' rows time the reference")
    rows = []
    for t in args.threads or [None]:
        rows += run(args.sizes, args.group_size, args.repeats, dev, t, not args.no_reference, args.ref_repeats)
    table = format_table(rows)
    print(table)
    loads = [r["load_avg"] for r in rows if r.get("load_avg") is not None]
    if loads and max(loads) > (os.cpu_count() or 1):
        print(
            f"warning: the load average reached {max(loads):.2f} on {os.cpu_count()} cores during this run",
            file=sys.stderr,
        )
    if args.json:
        os.makedirs(os.path.dirname(md), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        with open(md, "w") as f:  # the table docs/BENCHMARKS.md pastes (python -m dilocox.bench.report)
            f.write(
                f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine_line()}; "
                f"`dilocox bench kernels {' '.join(argv if argv is not None else sys.argv[1:])}`.\n\n{table}\n"
            )
        print(f"wrote {args.json} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
