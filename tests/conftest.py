import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _rpc_defaults_per_test():
    """A SWARM job launched in-process sets this process's RPC secret and limits (``transport.use_secret``); a
    test after it in the same worker must not inherit them."""
    from dilocox.swarm import transport

    saved = dict(transport._state)
    yield
    transport._state.clear()
    transport._state.update(saved)
