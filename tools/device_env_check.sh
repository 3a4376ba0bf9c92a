#!/usr/bin/env bash
# Before a GPU session, on a CPU machine: the code against the lent GPU machine's Python and torch (Python 3.12,
# torch 2.11.0+cu130, none of torchft / wandb / datasets / cryptography installed), so that the session's 15 device
# minutes are not spent on an API that torch 2.13 has and 2.11 lacks, or on an import the device image cannot serve.
#
#   bash tools/device_env_check.sh [PYTHON3.12]     # default: python3.12 on PATH
#
# It makes a venv at $VENV (default /tmp/dilocox-device-venv; ~5 GB: PyPI's torch 2.11.0 is the CUDA build, which
# runs on a CPU), copies the committed tree (git archive HEAD) to $WORK (default /tmp/dilocox-device-tree) and builds
# the CPU extension there (the repository's own in-place build, made for torch 2.13, is left alone), then runs, on
# the CPU: the tests of the paths tools/gpu_check.sh measures (compile, fp8, recompute, the fast paths, the reference
# bench, the kernels, the sparse codec, the outer step) and gpu_check.sh's reference mode as a dry run
# (REF_DEVICE=cpu), fp8_all row included. Not part of CI (it downloads the CUDA wheel). Last run 2026-12-03: every
# step passed (docs/BENCHMARKS.md 13c).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3.12}
VENV=${VENV:-/tmp/dilocox-device-venv}
WORK=${WORK:-/tmp/dilocox-device-tree}
export OMP_NUM_THREADS=1
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" || exit 2
    # the device image's set (docs: /work/.library/device/KINDS.md): torch 2.11.0, numpy, yaml, tokenizers,
    # transformers, safetensors, matplotlib, tabulate, pytest, pytest-xdist; nothing else of requirements.txt
    "$VENV/bin/pip" install -q torch==2.11.0 || exit 2
    "$VENV/bin/pip" install -q numpy pyyaml tokenizers safetensors transformers setuptools wheel ninja pybind11 \
        pytest pytest-xdist matplotlib tabulate || exit 2
fi
rm -rf "$WORK" && mkdir -p "$WORK" && git archive HEAD | tar -x -C "$WORK" || exit 2
cd "$WORK" || exit 2
export PATH="$VENV/bin:$PATH"
python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
python setup.py -q build_ext --inplace >build.log 2>&1  # (the CUDA extension fails without CUDA headers: expected)
python -c "from dilocox.compress import kernels as k; assert k.have_extension('cpu'), k._EXT_ERRORS; print('cpu extension: built')" || exit 1
rc=0
timeout 1800 python -m pytest -q -n 2 -p no:cacheprovider tests/test_hot_path.py tests/test_fp8.py \
    tests/test_recompute.py tests/test_model_fast_paths.py tests/test_gpu.py tests/test_tp_dropout.py \
    tests/test_kernels.py tests/test_compress_sparse.py tests/test_compress_sparse_rs.py tests/test_compress_rice.py \
    tests/test_model.py tests/test_outer.py tests/test_gpu_paths.py 2>&1 | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
OUT=/tmp/dilocox-device-dryrun REF_DEVICE=cpu \
    REF_ROWS="tiny:eager:150;tiny:compiled:200;tiny:dilocox preset, compiled:200;tiny:compiled, fp8_all:250" \
    timeout 900 bash tools/gpu_check.sh reference >dryrun.log 2>&1
n_ok=$(grep -c " rc 0$" dryrun.log)
echo "gpu_check.sh reference dry run: $n_ok of 4 rows rc 0 (log: $WORK/dryrun.log)"
[ "$n_ok" = 4 ] || rc=1
echo "device_env_check: $([ $rc = 0 ] && echo passed || echo FAILED)"
exit $rc
