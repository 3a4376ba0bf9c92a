"""Where a one-GPU training step spends its time: ``python -m tools.gpu_profile [dilocox train args...]``.

Runs ``dilocox train`` under ``torch.profiler`` (5 steps after 5 of warm-up, stepped by an optimizer hook) and
prints the top kernels by GPU time, the top CPU ops by self time and the wall time per profiled step (compare it
with the GPU's busy time, "Self CUDA time total" / 5: well below the wall, the step is bound by the host -
launches, Python, syncs - not by the GPU). GPT-2 small on an H200: docs/BENCHMARKS.md section 13.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

from dilocox import cli


def main(argv: list[str]) -> int:
    sched = schedule(wait=5, warmup=2, active=5, repeat=1)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=sched)
    marks: list[float] = []

    def on_step(*_):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        prof.step()

    register_optimizer_step_post_hook(on_step)
    with prof:
        rc = cli.main(["train", *argv])
    ev = prof.key_averages()
    print(ev.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    wall_ms = (marks[11] - marks[6]) * 1e3 / 5 if len(marks) > 11 else float("nan")
    # the GPU's busy time per step is the tables' "Self CUDA time total" / 5 (summing the events here would count
    # each kernel twice: under its aten op and as itself)
    print(f"profiled 5 steps: wall {wall_ms:.1f} ms/step; GPU busy per step = Self CUDA time total / 5")
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
