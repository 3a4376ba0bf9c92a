"""``dilocox bench train --reference``: ``dilocox train``'s step next to a plain PyTorch loop of the same model.

In one call, on one device, for each case (a model shape) and mode (eager | compiled; a mode naming ``fused qkv``, e.g.
``"compiled, fused qkv"``, runs dilocox with ``model.fused_qkv=true``, one naming ``torch loss`` with
``model.loss_backend=torch``, one naming ``fp8_all`` or ``fp8`` with that ``model.linear_backend``, against the same
bf16 reference; a ``dilocox preset`` mode naming ``comm stream`` runs the preset with ``outer.comm_stream=true``): the
loop of ``dilocox train``
(``Trainer.loop_step``: sampler, engine, clipping, inner AdamW, records, step-boundary decisions; one process,
TP = PP = 1) and a plain loop written from first principles (:mod:`dilocox.bench.reference_loop`), with no dilocox
module on its hot path: a nanoGPT-shaped model (fused QKV, SDPA, F.cross_entropy inside the compiled forward), AdamW
(fused on CUDA, foreach on CPU), foreach clipping, ``torch.compile`` of the whole model, the loss read every
``log_every`` steps. Reported for each side: steady tokens/s (after the warm-up steps, compilation included in those),
dilocox ÷ reference, MFU by dilocox's rule (``model_flops_per_token`` x tokens/s / the device's peak; CUDA only), host
syncs per step (:class:`SyncCounter`; on CUDA also torch's sync debug mode), kernel launches per step (CUDA,
torch.profiler) and the graph breaks under compile (``torch._dynamo`` counters).

    dilocox bench train --reference [--device cpu|cuda] [--cases tiny qwen-tiny] [--modes eager compiled]
                        [--steps 30] [--warmup 5] [--out docs/bench/gpu-train]

Rows go to ``OUT/results.json`` (one per case and mode: gpu, model, mode, dilocox_tokens_per_s,
reference_tokens_per_s, ratio, mfu, ...). A CPU run writes the CPU rows (``gpu: "none (CPU: <name>)"``) and keeps the
GPU rows of the file as they are (``unmeasured`` until a GPU run measures them); nothing is ever filled in by hand.
The weights of both sides are the same (``reference_loop.load_dilocox_weights``), so a test checks that the two
losses agree before any number is compared (tests/test_hot_path.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import shutil
import statistics
import tempfile
import time

import torch

from dilocox.bench.reference_loop import (  # the plain loop and the counters (re-exported: tests use R.SyncCounter)
    SYNC_WINDOW,
    ReferenceLoop,
    SyncCounter,
    _graph_break_count,
    _kernel_launches,
    _reset_dynamo,
    _sync,
    optimizer_step_tensors,
    ref_shape,
)
from dilocox.bench.runner import out_path_problem
from dilocox.bench.wan_report import _json_safe  # results.json: NaN/inf as null

# --------------------------------------------------------------------------- the cases
# model shapes; seq/batch per device (small on CPU so that a test runs them in seconds)
CASES: dict[str, dict] = {
    "tiny": dict(model="configs/model/gpt2-tiny.yaml", shape={}, cpu=(8, 128), cuda=(16, 256)),
    "qwen-tiny": dict(model="configs/model/qwen-tiny.yaml", shape={}, cpu=(8, 128), cuda=(16, 256)),
    "gpt2-small": dict(model="configs/model/gpt2-small.yaml", shape={}, cpu=(1, 128), cuda=(16, 1024)),
    "400m": dict(
        model="configs/model/gpt2-small.yaml",
        shape=dict(n_layers=24, n_heads=16, d_model=1024),
        cpu=(1, 128),
        cuda=(16, 1024),
    ),
    # ~1.4B (1.21B in the blocks): issue 39's fp8 target is set at >= 1B. 4 x 1,024 tokens a step: both sides hold
    # their weights and AdamW state at once (2 x 1.4B x 16 bytes = 45 GB), which leaves an 80 GB GPU ~30 GB for one
    # side's activations
    "1b": dict(
        model="configs/model/gpt2-small.yaml",
        shape=dict(n_layers=24, n_heads=16, d_model=2048),
        cpu=(1, 64),
        cuda=(4, 1024),
    ),
}
GPU_TABLE = [  # the rows issue 39 asks for on a GPU: (case, mode); the preset row compares dilocox with itself
    ("gpt2-small", "compiled"),
    ("gpt2-small", "eager"),
    ("400m", "compiled"),
    ("gpt2-small", "dilocox preset, compiled"),
    ("gpt2-small", "dilocox preset, compiled, comm stream"),  # outer.comm_stream=true (tools/gpu_check.sh stream)
    ("1b", "compiled"),  # fp8 against bf16 at >= 1B: the two rows' dilocox tokens/s (tools/gpu_check.sh fp8)
    ("1b", "compiled, fp8_all"),
]
PRESET_ARGS = [  # the `dilocox` preset on one replica and one stage (tools/gpu_check.sh's gpt2s-dilocox-preset)
    "--parallel.replicas=1",
    "--parallel.pipeline=1",
    "--parallel.microbatches=1",
]


def dilocox_config(case: str, device: str, mode: str, steps: int, run_dir: str, extra=(), log_every: int = 10):
    """The ``dilocox train`` config of a case: configs/tiny.yaml with the case's model and the bench's settings."""
    from dilocox.bench.runner import CONFIGS
    from dilocox.config import load_config

    c = CASES[case]
    batch, seq = c[device]
    base = os.path.join(CONFIGS, "tiny-dilocox.yaml" if "preset" in mode else "tiny.yaml")
    over = _model_overrides(c) + [
        f"--train.seq_len={seq}",
        f"--train.batch_size={batch}",
        f"--train.steps={steps}",
        f"--train.device={device}",
        f"--train.compile={'true' if 'compiled' in mode else 'false'}",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        f"--log.every={log_every}",
        f"--log.run_dir={run_dir}",
        "--log.progress=false",
        "--log.tensorboard=false",
        "--checkpoint.resume=none",
        "--checkpoint.every=0",
        "--checkpoint.check_space=false",
        "--data.max_bytes=1000000",
        *(PRESET_ARGS if "preset" in mode else ()),
        *(["--model.fused_qkv=true"] if "fused qkv" in mode else ()),
        *(["--model.loss_backend=torch"] if "torch loss" in mode else ()),
        *(["--outer.comm_stream=true"] if "comm stream" in mode else ()),
        *([f"--model.linear_backend={linear_backend(mode)}"] if "fp8" in mode else ()),
        *extra,
    ]
    return load_config(base, over)


DEFAULT_OUT = "docs/bench/gpu-train"
DEFAULT_MD = "docs/bench/gpu-train-reference/results.md"
MODE_WORDS = {"eager", "compiled", "fused qkv", "torch loss", "fp8", "fp8_all", "dilocox preset", "comm stream"}


def mode_problem(mode: str) -> str | None:
    """What is wrong with a ``--modes`` entry (comma-separated words of ``MODE_WORDS``, one of eager | compiled), or
    None."""
    words = [w.strip() for w in mode.split(",")]
    unknown = [w for w in words if w not in MODE_WORDS]
    if unknown:
        return f"unknown word(s) {unknown}; a mode is comma-separated words of {sorted(MODE_WORDS)}"
    if sum(w in ("eager", "compiled") for w in words) != 1:
        return "name exactly one of eager or compiled"
    if "comm stream" in words and "dilocox preset" not in words:
        return "comm stream is a setting of the dilocox preset: add 'dilocox preset'"
    return None


def linear_backend(mode: str) -> str:
    """The ``model.linear_backend`` a mode names: ``fp8_all``, ``fp8`` or ``torch``."""
    words = {w.strip() for w in mode.split(",")}
    if "fp8" in mode and not words & {"fp8", "fp8_all"}:
        raise ValueError(f"mode {mode!r}: name the fp8 backend as a word of its own, 'fp8' or 'fp8_all'")
    return "fp8_all" if "fp8_all" in words else "fp8" if "fp8" in words else "torch"


def _model_overrides(c: dict) -> list[str]:
    import yaml

    from dilocox.bench.runner import ROOT

    with open(os.path.join(ROOT, c["model"])) as f:
        fields = dict(yaml.safe_load(f)["model"])
    fields.update(c["shape"])
    return [f"--model.{k}={v}" for k, v in fields.items()]


class DilocoxSide:
    """``dilocox train``'s loop body (``Trainer.loop_step``: sampler, engine, clipping, inner AdamW, records,
    step-boundary decisions), one process, with run()'s deferred host syncs."""

    name = "dilocox"

    def __init__(self, cfg):
        from dilocox.train import Trainer

        with contextlib.redirect_stdout(io.StringIO()):
            self.tr = Trainer(cfg)
        self.tr.defer_sync = True  # as run() does
        self.t0 = time.time()
        self.tr.start_clock(self.t0)
        self.device, self.due = self.tr.device, False

    def step(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.due = self.tr.loop_step(0, self.t0, self.due)

    def exempt(self) -> list[torch.Tensor]:
        return optimizer_step_tensors(self.tr.optimizer)

    def losses(self) -> dict[int, float]:
        with contextlib.redirect_stdout(io.StringIO()):
            self.tr._flush_logs()
        return {r["step"]: r["loss"] for r in self.tr.history}

    def close(self) -> None:
        tr = self.tr
        if tr.outer is not None:
            tr.outer.close(timeout=10)
        if tr.run_lock is not None:
            tr.run_lock.release()
        tr.logger.close()


class ReferenceSide:
    """The plain loop on the same shape, device, batches (a sampler of its own, same seed), learning-rate schedule and
    optimizer settings, from the same initial weights; the loss is read (a host sync) every ``log_every`` steps."""

    name = "reference"

    def __init__(self, cfg, weights=None, log_every: int = 10, device=None):
        from dilocox.data import TokenSampler, prepare  # the data only
        from dilocox.optim import lr_at  # the same schedule, as a list of numbers made here (off the hot path)

        want = cfg.train.device if cfg.train.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device or want)
        o, t = cfg.optim, cfg.train
        self.loop = ReferenceLoop(
            ref_shape(cfg.model),
            self.device,
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            grad_clip=o.grad_clip,
            compile=t.compile,
            autocast=torch.bfloat16 if self.device.type == "cuda" else None,
            weights=weights,
        )
        self.sampler = TokenSampler(prepare(cfg.data).train_tokens(), t.seq_len, t.batch_size, t.seed, 0, 1)
        self.lrs = [lr_at(i, cfg) for i in range(t.steps + 1)]
        self.log_every, self._losses = log_every, {}

    def step(self) -> None:
        x, y = self.sampler.next_batch()
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        lr = self.lrs[min(self.loop.step_count, len(self.lrs) - 1)]
        loss = self.loop.step(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), lr)
        if self.loop.step_count % self.log_every == 0:
            self._losses[self.loop.step_count] = loss.item()

    def exempt(self) -> list[torch.Tensor]:
        return optimizer_step_tensors(self.loop.opt)

    def losses(self) -> dict[int, float]:
        return self._losses

    def close(self) -> None:
        pass


def measure(sides: list, warmup: int, steps: int, rounds: int = 5) -> list[dict]:
    """Warm each side up (compilation happens there; its graph breaks counted), then time ``steps`` steps of each in
    ``rounds`` alternating blocks (a shared machine's load falls on both alike), then count host syncs over
    :data:`SYNC_WINDOW` steps and kernel launches (CUDA) over 3 steps, apart from the timed steps."""
    from torch._dynamo.utils import counters

    out = [{} for _ in sides]
    for side, o in zip(sides, out):
        before, graphs = _graph_break_count(), int(counters["stats"].get("unique_graphs", 0))
        for _ in range(warmup):
            side.step()
        _sync(side.device)
        o["graph_breaks"] = _graph_break_count() - before
        o["graphs"] = int(counters["stats"].get("unique_graphs", 0)) - graphs
        o["walls"] = []
    per = [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]
    for n in per:
        for side, o in zip(sides, out):
            t = time.perf_counter()
            for _ in range(n):
                side.step()
            _sync(side.device)
            o["walls"].append(time.perf_counter() - t)
    for side, o in zip(sides, out):
        with SyncCounter(side.exempt()) as sc:
            for _ in range(SYNC_WINDOW):
                side.step()
        o["syncs_per_step"] = sc.count / SYNC_WINDOW
        o["cuda_syncs_per_step"] = sc.cuda / SYNC_WINDOW if side.device.type == "cuda" else None
        o["sync_calls"] = sc.calls
        o["launches_per_step"] = _kernel_launches(side.device, side.step, 3)
        o["losses"] = side.losses()
    common = sorted(set(out[0].pop("losses")) & set(out[1].pop("losses")))
    for side, o in zip(sides, out):  # same weights, batches and schedule: the losses agree (a fair comparison)
        o["loss_at_step"] = [common[-1], side.losses()[common[-1]]] if common else None
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_label(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"none (CPU: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def run_case(case: str, mode: str, device: str, steps: int, warmup: int, work: str) -> dict:
    """One row: the case's dilocox step and the reference (or, for the preset, dilocox's plain step) side by side,
    timed in alternating blocks in one process."""
    from dilocox.metrics import peak_flops
    from dilocox.model.transformer import model_flops_per_token

    run_dir = os.path.join(work, f"{case}-{mode}".replace(" ", "_").replace(",", ""))
    total = warmup + steps + SYNC_WINDOW + 3  # + the sync window and the profiled steps
    cfg = dilocox_config(case, device, mode, total + 10, run_dir)
    _reset_dynamo()
    sides = [DilocoxSide(cfg)]
    try:
        if "preset" in mode:  # the preset vs dilocox's own plain run (issue 39's target: >= 0.97)
            plain = "compiled" if "compiled" in mode else "eager"
            sides.append(DilocoxSide(dilocox_config(case, device, plain, total + 10, run_dir + "-plain")))
        else:
            sides.append(ReferenceSide(cfg, weights=sides[0].tr.model.state_dict(), device=sides[0].device))
        # blocks: of one step each on a CPU (no sync to pay: the finest pairing in time against the load of a shared
        # machine); of >= 10 steps on a GPU, where each block ends with a sync that would hide the host syncs' cost
        d, r = measure(sides, warmup, steps, rounds=steps if device == "cpu" else max(1, steps // 10))
    finally:
        for side in sides:
            side.close()
    tokens = cfg.train.batch_size * cfg.train.seq_len * steps
    d_tps, r_tps = tokens / sum(d["walls"]), tokens / sum(r["walls"])
    # the ratio: the median over the rounds of (reference time / dilocox time) of the same round, side by side in
    # time, so that a burst of load on a shared machine falls on one round's pair, not on one side
    ratio = statistics.median(rw / dw for dw, rw in zip(d["walls"], r["walls"]))
    peak = peak_flops(torch.device(device))
    fpt = model_flops_per_token(cfg.model, cfg.train.seq_len)
    return {
        "gpu": device_label(device),
        "model": case,
        "mode": mode,
        "dilocox_tokens_per_s": round(d_tps, 1),
        "reference_tokens_per_s": round(r_tps, 1),
        "ratio": round(ratio, 3),
        "mfu": round(d_tps * fpt / peak, 4) if peak else None,
        "reference_mfu": round(r_tps * fpt / peak, 4) if peak else None,
        "reference": "dilocox plain (no outer method)" if "preset" in mode else "plain PyTorch loop",
        "params_m": round(cfg.model.num_params() / 1e6, 1),
        "batch": cfg.train.batch_size,
        "seq_len": cfg.train.seq_len,
        "steps": steps,
        "warmup": warmup,
        "dilocox": d,
        "reference_side": r,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def profile_case(case: str, mode: str, device: str, steps: int, rows: int = 30) -> str:
    """torch.profiler of both sides, one step of each in turn (``steps`` pairs): per op, the self time per step on
    each side and the calls per step, the ops dilocox spends more on first. What ``--profile`` prints and writes."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    cfg = dilocox_config(case, device, mode, 10 * steps + 50, tempfile.mkdtemp(prefix="dilocox-prof-"))
    _reset_dynamo()
    d = DilocoxSide(cfg)
    r = ReferenceSide(cfg, weights=d.tr.model.state_dict(), device=d.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
    sides = (d, r)
    ms = {x.name: collections.Counter() for x in sides}
    calls = {x.name: collections.Counter() for x in sides}
    wall = collections.Counter()
    try:
        for x in sides:
            for _ in range(3):
                x.step()
        for _ in range(steps):
            for x in sides:
                with profile(activities=acts) as prof:
                    t = time.perf_counter()
                    x.step()
                    _sync(x.device)
                    wall[x.name] += (time.perf_counter() - t) / steps
                for e in prof.key_averages():
                    ms[x.name][e.key] += e.self_cpu_time_total / 1e3 / steps
                    if d.device.type == "cuda":
                        ms[x.name][e.key] += getattr(e, "self_device_time_total", 0) / 1e3 / steps
                    calls[x.name][e.key] += e.count / steps
    finally:
        for x in sides:
            x.close()
    keys = sorted(set(ms["dilocox"]) | set(ms["reference"]), key=lambda k: ms["reference"][k] - ms["dilocox"][k])
    out = [
        f"{case} / {mode} on {device_label(device)}: {steps} profiled steps per side, one of each in turn; "
        f"wall per step (profiled) dilocox {wall['dilocox'] * 1e3:.1f} ms, reference {wall['reference'] * 1e3:.1f} ms",
        f"{'op':62s} {'dilocox ms':>10s} {'ref ms':>8s} {'diff':>8s} {'calls dil':>9s} {'calls ref':>9s}",
    ]
    for k in keys[:rows]:
        a, b = ms["dilocox"][k], ms["reference"][k]
        out.append(
            f"{k[:62]:62s} {a:10.2f} {b:8.2f} {a - b:8.2f} {calls['dilocox'][k]:9.0f} {calls['reference'][k]:9.0f}"
        )
    extra = sorted(
        set(calls["dilocox"]) | set(calls["reference"]), key=lambda k: calls["reference"][k] - calls["dilocox"][k]
    )
    more = [(k, calls["dilocox"][k] - calls["reference"][k]) for k in extra[:12]]
    out.append("ops called more often per step by dilocox: " + ", ".join(f"{k} +{n:.0f}" for k, n in more if n > 0))
    tot = {n: sum(v.values()) for n, v in ms.items()}
    ops = {n: sum(v.values()) for n, v in calls.items()}
    out.append(f"total self time per step: dilocox {tot['dilocox']:.1f} ms, reference {tot['reference']:.1f} ms; "
               f"ops per step: dilocox {ops['dilocox']:.0f}, reference {ops['reference']:.0f}")  # fmt: skip
    return "\n".join(out)


# --------------------------------------------------------------------------- results
def merge_rows(old: list[dict], new: list[dict], device: str) -> list[dict]:
    """The new rows replace the old ones of the same case and mode measured on the same kind of device (CPU or GPU);
    every other row stays. The GPU table's rows that no GPU run measured are kept, marked unmeasured."""
    on_cpu = device == "cpu"
    done = {(r["model"], r["mode"]) for r in new}
    keep = [r for r in old if r["gpu"].startswith("none") != on_cpu or (r["model"], r["mode"]) not in done]
    rows = keep + new
    measured = {(r["model"], r["mode"]) for r in rows if not r["gpu"].startswith(("none", "unmeasured"))}
    rows = [r for r in rows if not (r["gpu"].startswith("unmeasured") and (r["model"], r["mode"]) in measured)]
    have = {(r["model"], r["mode"]) for r in rows if not r["gpu"].startswith("none")}
    for case, mode in GPU_TABLE:
        if (case, mode) not in have:
            # tools/gpu_check.sh's mode that measures the row
            call = "fp8" if case == "1b" else "stream" if "comm stream" in mode else "reference"
            rows.append(
                {"gpu": f"unmeasured (no GPU run yet: bash tools/gpu_check.sh {call})", "model": case, "mode": mode,
                 "dilocox_tokens_per_s": None, "reference_tokens_per_s": None, "ratio": None, "mfu": None}
            )  # fmt: skip
    return sorted(rows, key=lambda r: (r["gpu"].startswith("none"), r["gpu"].startswith("unmeasured")))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| device | model | mode | dilocox tok/s | reference tok/s | dilocox ÷ ref | MFU (dilocox / ref) "
        "| host syncs/step (dilocox / ref) | launches/step | graph breaks (dilocox / ref) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt="{:,.0f}"):
        return "–" if v is None else fmt.format(v)

    for r in rows:
        d, ref = r.get("dilocox", {}), r.get("reference_side", {})
        mfu = f"{f(r.get('mfu'), '{:.3f}')} / {f(r.get('reference_mfu'), '{:.3f}')}"
        syncs = f"{f(d.get('syncs_per_step'), '{:.2f}')} / {f(ref.get('syncs_per_step'), '{:.2f}')}"
        launches = f"{f(d.get('launches_per_step'))} / {f(ref.get('launches_per_step'))}"
        breaks = "–"
        if "compiled" in r["mode"] and d:
            breaks = f"{d.get('graph_breaks')} / {ref.get('graph_breaks')}"
        where = f"{r['gpu']}, {r['date']}" if r.get("date") else r["gpu"]
        lines.append(
            f"| {where} | {r['model']} | {r['mode']} | {f(r['dilocox_tokens_per_s'])} | "
            f"{f(r['reference_tokens_per_s'])} | {f(r['ratio'], '{:.2f}')} | {mfu} | {syncs} | {launches} | {breaks} |"
        )
    return "\n".join(lines)


def _checked(ap: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """The arguments checked before anything runs (one line, exit 2), and the table's default path."""
    if a.md is None:  # (a run written elsewhere leaves the docs' table as it is)
        a.md = (
            DEFAULT_MD if os.path.abspath(a.out) == os.path.abspath(DEFAULT_OUT) else os.path.join(a.out, "results.md")
        )
    for case in a.cases or ():
        if case not in CASES:
            ap.error(f"--cases {case!r}: not a case; choose from {', '.join(CASES)}")
    for mode in a.modes:
        problem = mode_problem(mode)
        if problem:
            ap.error(f"--modes {mode!r}: {problem}")
    if a.steps < 1 or a.warmup < 0:
        ap.error(f"--steps {a.steps} --warmup {a.warmup}: steps must be >= 1 and warmup >= 0")
    outputs = [] if a.no_write else [("--out", a.out, True)] + ([] if a.profile else [("--md", a.md, False)])
    for flag, path, directory in outputs:  # (before minutes of measuring; --profile writes no table)
        if problem := out_path_problem(path, directory, example="results.md"):
            ap.error(f"argument {flag}: {problem}")
    return a


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dilocox bench train --reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cases", nargs="+", default=None, help=f"of {list(CASES)}; default: tiny qwen-tiny on CPU, "
                    "the GPU table on CUDA")  # fmt: skip
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=DEFAULT_OUT, help="results.json goes here")
    ap.add_argument("--md", default=None, help="the table (default: the docs' with the default --out, else OUT's)")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads (1: steady on a shared machine)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="instead: torch.profiler of N steps per side")
    a = _checked(ap, ap.parse_args(argv))
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    if a.profile:
        for case in a.cases or ["tiny"]:
            for mode in a.modes:
                text = profile_case(case, mode, a.device, a.profile)
                print(text, flush=True)
                if not a.no_write:
                    os.makedirs(a.out, exist_ok=True)
                    name = f"profile-{a.device}-{case}-{mode}.txt".replace(" ", "_").replace(",", "")
                    with open(os.path.join(a.out, name), "w") as f:
                        f.write(f"dilocox bench train --reference {shlex.join(argv or [])}\n{text}\n")
        return 0
    if a.device == "cuda" and a.cases is None:
        todo = list(GPU_TABLE)
    else:
        todo = [(c, m) for c in (a.cases or ["tiny", "qwen-tiny"]) for m in a.modes]
    work = tempfile.mkdtemp(prefix="dilocox-bench-ref-")
    rows, failed = [], 0
    try:
        for case, mode in todo:
            t0 = time.time()
            try:
                rows.append(run_case(case, mode, a.device, a.steps, a.warmup, work))
            except Exception as e:  # noqa: BLE001 - one failed case must not lose the others (one GPU call)
                print(f"{case} / {mode}: failed: {type(e).__name__}: {e}", flush=True)
                failed += 1
                continue
            r = rows[-1]
            print(
                f"{case} / {mode}: dilocox {r['dilocox_tokens_per_s']:,.0f} tok/s, reference "
                f"{r['reference_tokens_per_s']:,.0f}, ratio {r['ratio']:.2f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = os.path.join(a.out, "results.json")
    if not a.no_write:
        os.makedirs(a.out, exist_ok=True)
        old = json.load(open(path)) if os.path.exists(path) else []
        rows_all = merge_rows(old, rows, a.device)
        with open(path, "w") as f:
            json.dump(_json_safe(rows_all), f, indent=1)  # NaN/inf -> null
        stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        md = [
            f"The rows of `{path}` as `dilocox bench train --reference` wrote them (each names its device and date; "
            "rows marked unmeasured: no GPU has run them). Last written by "
            f"`dilocox bench train --reference {shlex.join(argv or [])}`".rstrip()
            + f" on {device_label(a.device)}, torch {torch.__version__}, {stamp} UTC"
            f"; {a.steps} timed steps per side after {a.warmup} warm-up steps (compilation in those), in alternating "
            "blocks (1 step each on a CPU, >= 10 on a GPU), the ratio the median over the blocks; host syncs "
            "counted over 20 further steps (log.every=10), kernel launches over 3 (CUDA). In the "
            "`dilocox preset` rows the reference is dilocox's own plain run (no outer method).",
            "",
            markdown(rows_all),
        ]
        os.makedirs(os.path.dirname(a.md) or ".", exist_ok=True)
        with open(a.md, "w") as f:
            f.write("\n".join(md) + "\n")
    print(markdown(rows))
    return 1 if failed else 0  # (the rows that ran are written either way)


if __name__ == "__main__":
    raise SystemExit(main())
