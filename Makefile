# Two commands do all the set-up (see README):
#   make train   -> installs, then trains the tiny GPT-2 on the embedded corpus (CPU is fine)
#   make test    -> installs, then runs the test suite
PYTHON ?= python3
export OMP_NUM_THREADS ?= 1
# One stamp per interpreter (a hash of its sys.executable): a second virtual environment, or
# PYTHON=python3.12, installs into itself instead of trusting another interpreter's stamp.
PY_ID := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.executable.encode()).hexdigest()[:12])')
ifeq ($(PY_ID),)
$(error PYTHON=$(PYTHON) does not run; set PYTHON to a Python >= 3.10 interpreter, e.g. make PYTHON=python3)
endif
STAMP := .install-$(PY_ID).stamp

.PHONY: install train test bench-kernels clean

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

test: install
	$(PYTHON) -m pytest -q --durations=25 tests

bench-kernels: install
	$(PYTHON) -m dilocox.cli bench kernels

clean:
	rm -rf build .install.stamp .install-*.stamp dilocox/*.so runs
