# Two set-up commands for a fresh machine: `make demo` and `make test`.
# Each creates or reuses .venv and installs what it needs (system packages too, when
# missing and when running as root: Java 17 for Spark, tshark for wire checks).

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= --quiet --disable-pip-version-check
PYTEST_ARGS ?=
# Two workers (the 2-core CI machine): e2e tests mostly wait on their nodes, and one
# worker took 16 min on a slow day against the 15-min budget. `loadfile` keeps a
# module's tests (and its module-scoped node fixtures) in one worker.
PYTEST_WORKERS ?= -n 2 --dist loadfile
# A path-based editable install: Spark finds the `upr` data source by listing top-level
# `pyspark_*` modules (pkgutil), which cannot see setuptools' import-hook editables.
EDITABLE := --config-settings editable_mode=compat

.PHONY: demo test test-slow lint typecheck bench system-deps clean

$(VENV)/.base-stamp: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) $(EDITABLE) -e .
	@touch $@

$(VENV)/.spark-stamp: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) $(EDITABLE) -e '.[spark]'
	@touch $@ $(VENV)/.base-stamp

$(VENV)/.dev-stamp: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) $(EDITABLE) -e '.[dev,spark]'
	@touch $@ $(VENV)/.base-stamp $(VENV)/.spark-stamp

# Java 17 (Spark) and tshark (independent wire decoder), installed only when missing.
system-deps:
	@need=""; \
	command -v java >/dev/null 2>&1 || need="$$need openjdk-17-jre-headless"; \
	command -v tshark >/dev/null 2>&1 || need="$$need tshark"; \
	if [ -n "$$need" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$need"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	  else echo "warning: missing$$need (run as root to install); dependent tests will skip"; fi; \
	fi

# The demo also installs Spark (the spark extra, Java 17), so examples/spark-export.py
# runs right after it.
demo: system-deps $(VENV)/.spark-stamp
	$(PY) examples/demo.py

lint: $(VENV)/.dev-stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.dev-stamp
	$(VENV)/bin/mypy

test: system-deps $(VENV)/.dev-stamp lint typecheck
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-slow: system-deps $(VENV)/.dev-stamp
	$(VENV)/bin/pytest -m slow $(PYTEST_ARGS)

bench: $(VENV)/.base-stamp
	$(PY) bench/codec.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
