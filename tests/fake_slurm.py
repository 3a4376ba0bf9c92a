"""Run a launcher/slurm/*.sbatch script with SLURM's commands replaced by small bash stubs (no SLURM needed).

Each test module passes its stubs (``{"srun": "<bash body>", ...}``); every stub appends what it would run to
``$LOG``, which comes back as lines.

The scripts end their background services (store, lighthouses) with SIGTERM once the other steps are done. A fake
service that has not yet logged its line by then would be lost, however the stub tries to guard itself: a stub's
``trap "" TERM`` comes too late when the TERM arrives between the script's fork and the trap (a loaded machine: the
fake peers are done in milliseconds). So by default the script runs with SIGTERM ignored from the start, inherited by
every step it starts: each fake task logs its line and exits whatever the script sends. A run of real services
(``fake_tasks=False``) keeps SIGTERM, which is how they stop.
"""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fake_sbatch(
    tmp_path,
    script: str,
    stubs: dict[str, str],
    args: list[str],
    env: dict[str, str],
    timeout: float = 60,
    fake_tasks: bool = True,
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Install ``stubs`` in ``tmp_path/bin`` (first on PATH), run ``bash script *args`` with ``env`` added to the
    environment (LOG, SLURM_JOB_ID=42 and DILOCOX_ROOT set; the DILOCOX_* variables the script reads, its ports and
    timeouts, come from ``env`` only, never from the caller's environment), return the process and the lines the
    stubs logged, in the order written. ``fake_tasks``: every task is a stub that logs and exits; the script and all
    it starts ignore SIGTERM (see the module doc). False: real services, which the script's SIGTERM stops."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    with open(script) as f:
        knobs = set(re.findall(r"\bDILOCOX_[A-Z0-9_]+", f.read()))
    full = {k: v for k, v in os.environ.items() if k not in knobs}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), SLURM_JOB_ID="42", DILOCOX_ROOT=ROOT)
    full.update({k: str(v) for k, v in env.items()})
    # an ignored signal stays ignored across fork and exec (and bash cannot trap a signal ignored at its start)
    argv = ["bash", "-c", 'trap "" TERM; exec bash "$@"', "bash"] if fake_tasks else ["bash"]
    p = subprocess.run(
        [*argv, script, *args], env=full, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    return p, log.read_text().splitlines() if log.exists() else []
