"""``log.profile_start`` / ``log.profile_steps``: a ``torch.profiler`` trace of a few training steps, per rank.

With ``log.profile_start = S > 0`` every rank records steps ``S .. S + log.profile_steps - 1`` (1-based, as logged;
the CPU side, and the CUDA kernels on a GPU), each step marked ``train_step#N``, and when the window ends writes
under ``RUN_DIR/profile/``:

- ``rank<r>_steps<S>-<E>.json``: the Chrome trace (open in https://ui.perfetto.dev or chrome://tracing);
- ``rank<r>_steps<S>-<E>.txt``: the ops by self time, the 40 largest (device time first on a GPU).

torchtitan's ``profiling.enable_profiling`` and Megatron's ``--profile`` do the same for a window of steps. Outside
the window the step pays nothing but a comparison; a resume past ``S`` records nothing.
"""

from __future__ import annotations

import contextlib
import os

import torch


class StepProfiler:
    def __init__(self, start: int, steps: int, run_dir: str, rank: int, device: torch.device):
        self.start, self.end = start, start + steps - 1
        self.dir, self.rank, self.device = os.path.join(run_dir, "profile"), rank, device
        self.prof: torch.profiler.profile | None = None
        self.written: list[str] = []

    def around(self, step: int):
        """The context of training step ``step`` (1-based): recorded when it is in the window."""
        if not self.start or not self.start <= step <= self.end:
            return contextlib.nullcontext()
        if self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
        return self._step(step)

    @contextlib.contextmanager
    def _step(self, step: int):
        with torch.profiler.record_function(f"train_step#{step}"):
            yield
        if step == self.end:
            self.finish(step)

    def finish(self, last: int) -> None:
        """Stop and write the trace and the table (at the window's end, or early when the run stops inside it)."""
        if self.prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self.prof = self.prof, None
        prof.stop()
        os.makedirs(self.dir, exist_ok=True)
        base = os.path.join(self.dir, f"rank{self.rank}_steps{self.start}-{last}")
        prof.export_chrome_trace(base + ".json")
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        with open(base + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        self.written = [base + ".json", base + ".txt"]
        if self.rank == 0:
            print(f"profile: steps {self.start}-{last} written to {self.dir}/ (rank<r>_steps{self.start}-{last}.json: "
                  "open in https://ui.perfetto.dev)", flush=True)  # fmt: skip
