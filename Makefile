# Two commands do all the set-up (see README):
#   make train   -> installs, then trains the tiny GPT-2 on the embedded corpus (CPU is fine)
#   make test    -> installs, then runs the fast tier of the tests (make test-all: every test, as CI)
PYTHON ?= python3
export OMP_NUM_THREADS ?= 1
# One stamp per interpreter (a hash of its sys.executable): a second virtual environment, or
# PYTHON=python3.12, installs into itself instead of trusting another interpreter's stamp.
PY_ID := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.executable.encode()).hexdigest()[:12])')
ifeq ($(PY_ID),)
$(error PYTHON=$(PYTHON) does not run; set PYTHON to a Python >= 3.10 interpreter, e.g. make PYTHON=python3)
endif
STAMP := .install-$(PY_ID).stamp

# test workers (pytest-xdist). The suite is CPU-bound, not waiting (2026-12-02: 1,946 tests in 1,489 s with 2 workers,
# 1,419 s with 3, 2,651 CPU-s in 1,422 s: 93 % of both cores; XDIST=4 took 22.8 min in an earlier fresh-clone run at
# load ~10), so more workers gain ~5 % and squeeze the fault tests' time bounds, which were set for 2. Much of the CPU
# is process start-up: the 10 heaviest files (832 s on 2 workers) start 226 processes that exit normally (more are
# killed), 854 CPU-s, 3.8 s each, mostly import torch (1.2 s), torch._dynamo (1.2 s: torch's Optimizer.step imports it
# on the first step) and DCP (0.6 s). In file order (xdist's default 'load') heavy tests mix with light ones;
# slow-first with --dist worksteal bunched the heavy ones together
XDIST ?= 2

.PHONY: install train test test-all test-gpu bench-kernels clean

install: $(STAMP)

$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu)
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	# the compiled kernels, in place (an editable install does not build them); a failed build
	# leaves the package on its pure-torch reference path, which it says once at run time
	$(PYTHON) setup.py -q build_ext --inplace
	$(PYTHON) -c 'import sys; print(sys.executable)' > $(STAMP)

train: install
	$(PYTHON) -m dilocox.cli train configs/tiny.yaml

# the fast tier: every subsystem at least once (the tests not marked slow), minutes
test: install
	$(PYTHON) -m pytest -q -n $(XDIST) -m "not slow" --durations=15 tests

# everything (CI): the fast tier + the slow tests (multi-process faults, convergence, namespaces)
test-all: install
	$(PYTHON) -m pytest -q -n $(XDIST) --durations=25 tests

# on a GPU machine (CUDA torch + nvcc; the extension dilocox._C_cuda builds at install): every CUDA path against
# its CPU reference. The other tiers hide the GPU (tests/conftest.py) and run as on CI
test-gpu: install
	DILOCOX_TEST_GPU=1 $(PYTHON) -m pytest -q -m cuda -rs tests

bench-kernels: install
	$(PYTHON) -m dilocox.cli bench kernels

clean:
	rm -rf build .install.stamp .install-*.stamp dilocox/*.so runs
