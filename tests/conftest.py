import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort): with ``-n`` workers and ``--dist worksteal`` (pytest-xdist; the
    Makefile's) the long ones start at once and idle workers take the rest of a busy one's queue, so no
    worker runs a 60 s test alone at the end."""
    items.sort(key=lambda it: 0 if it.get_closest_marker("slow") else 1)
