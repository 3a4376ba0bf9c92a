import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is the CPU suite (gloo ranks, fp32, bit-exact oracles): on a GPU machine it hides the GPU from every
# test and every process the tests start, so it runs there as in CI. `make test-gpu` (DILOCOX_TEST_GPU=1) keeps
# the GPU visible and runs only the tests marked `cuda` (tests/test_gpu.py, the CUDA kernels in test_kernels.py).
if os.environ.get("DILOCOX_TEST_GPU", "0") in ("", "0"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _rpc_defaults_per_test():
    """A SWARM job launched in-process sets this process's RPC secret and limits (``rpc.use_secret``); a
    test after it in the same worker must not inherit them."""
    from dilocox.net import rpc

    saved = dict(rpc._state)
    yield
    rpc._state.clear()
    rpc._state.update(saved)
