#!/usr/bin/env bash
# Run dilocox training on this machine with torchrun, one rank per process.
#
#   launcher/run_local.sh CONFIG [--section.key=value ...]
#
# The number of ranks is the config's parallel.replicas*data*pipeline*tensor (override with
# NPROC=N). Replicas share this host's network uncapped; for capped links between replicas use
# `dilocox launch --replicas R --nproc-per-replica N --bandwidth 100mbit CONFIG` (netns + tc).
set -euo pipefail
[[ $# -ge 1 && $1 != -* ]] || { echo "usage: launcher/run_local.sh CONFIG [--section.key=value ...]" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PYTHON=${PYTHON:-python}
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$("$PYTHON" -c 'import sys
from dilocox.config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).parallel.world_size)' "$@")
fi
# through `dilocox train --nproc`: Ctrl-C/SIGTERM reach every rank, which save a checkpoint and exit
# (the command returns after them, killing what is left after train.stop_timeout_s)
exec "$PYTHON" -m dilocox.cli train "$@" --nproc "$NPROC"
