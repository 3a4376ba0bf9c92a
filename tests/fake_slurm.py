"""Run a launcher/slurm/*.sbatch script with SLURM's commands replaced by small bash stubs (no SLURM needed).

Each test module passes its stubs (``{"srun": "<bash body>", ...}``); every stub appends what it would run to
``$LOG``, which comes back as lines.
"""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fake_sbatch(
    tmp_path, script: str, stubs: dict[str, str], args: list[str], env: dict[str, str], timeout: float = 60
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Install ``stubs`` in ``tmp_path/bin`` (first on PATH), run ``bash script *args`` with ``env`` added to the
    environment (LOG, SLURM_JOB_ID=42 and DILOCOX_ROOT set), return the process and the lines the stubs logged,
    in the order written."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    full = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), SLURM_JOB_ID="42", DILOCOX_ROOT=ROOT)
    full.update({k: str(v) for k, v in env.items()})
    p = subprocess.run(
        ["bash", script, *args], env=full, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    return p, log.read_text().splitlines() if log.exists() else []
