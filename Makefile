# Two set-up commands for a fresh machine: `make demo` and `make test`.
# Each creates or reuses .venv and installs what it needs (system packages too, when
# missing and when running as root: Java 17 for Spark, tshark for wire checks, man).

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

.PHONY: demo test test-slow test-latest lock lint typecheck bench system-deps man-pages clean

# Installs come from the lock files (requirements/*.lock: every dependency, direct and
# transitive, pinned with hashes), so a new machine gets exactly what CI tested. The
# version ranges in pyproject.toml are for the package's users; `make lock` refreshes
# the locks from them, and `make test-latest` tries the newest releases before a refresh
# lands. The project itself installs without dependencies on top of the lock.
LOCK_DEV := requirements/dev.lock
LOCK_DEMO := requirements/demo.lock
UV_VERSION := 0.13.9
TOOLS_VENV := .venv-tools
LOCK_FLAGS := --generate-hashes --python-version 3.11 --universal --quiet

define install_lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --require-hashes -r $(1)
	$(PY) -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation $(EDITABLE) -e .
endef

$(VENV)/.base-stamp: pyproject.toml $(LOCK_DEMO)
	$(call install_lock,$(LOCK_DEMO))
	@touch $@

$(VENV)/.spark-stamp: pyproject.toml $(LOCK_DEMO)
	$(call install_lock,$(LOCK_DEMO))
	@touch $@ $(VENV)/.base-stamp

$(VENV)/.dev-stamp: pyproject.toml $(LOCK_DEV)
	$(call install_lock,$(LOCK_DEV))
	@touch $@ $(VENV)/.base-stamp $(VENV)/.spark-stamp

# Refresh both locks from pyproject.toml's ranges (the demo lock is constrained by the
# dev lock, so the two agree on every shared package). Then run `make test-latest` or
# `make test` before committing the new locks.
lock:
	@test -x $(TOOLS_VENV)/bin/uv || { $(PYTHON) -m venv $(TOOLS_VENV) && \
	  $(TOOLS_VENV)/bin/pip install $(PIP_FLAGS) uv==$(UV_VERSION); }
	$(TOOLS_VENV)/bin/uv pip compile pyproject.toml requirements/build.in --extra dev --extra spark $(LOCK_FLAGS) \
	  --upgrade -o $(LOCK_DEV)
	$(TOOLS_VENV)/bin/uv pip compile pyproject.toml requirements/build.in --extra spark $(LOCK_FLAGS) \
	  -c $(LOCK_DEV) -o $(LOCK_DEMO)

# The suite against the newest releases that pyproject.toml allows, in a venv of its own
# (outside CI): how a refresh of the lock is tried before it lands.
test-latest: system-deps
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/pip install $(PIP_FLAGS) --upgrade $(EDITABLE) -e '.[dev,spark]'
	.venv-latest/bin/ruff check . && .venv-latest/bin/ruff format --check .
	.venv-latest/bin/mypy
	.venv-latest/bin/pytest -m "not slow" $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Java 17 (Spark), tshark (independent wire decoder), promtool (Debian's prometheus:
# checks examples/prometheus/alerts.yml), man (man-db: `man upr`) and the shells whose
# completion the tests run (zsh, fish; bash is there), installed only when missing.
system-deps:
	@need=""; \
	command -v java >/dev/null 2>&1 || need="$$need openjdk-17-jre-headless"; \
	command -v man >/dev/null 2>&1 || need="$$need man-db"; \
	command -v tshark >/dev/null 2>&1 || need="$$need tshark"; \
	command -v promtool >/dev/null 2>&1 || need="$$need prometheus"; \
	command -v zsh >/dev/null 2>&1 || need="$$need zsh"; \
	command -v fish >/dev/null 2>&1 || need="$$need fish"; \
	if [ -n "$$need" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$need"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	  else echo "warning: missing$$need (run as root to install); dependent tests will skip"; fi; \
	fi

# The man pages into the venv's share/man: man finds them there for every shell whose
# PATH has $(VENV)/bin (`. .venv/bin/activate`), as it derives MANPATH from PATH. The
# editable install leaves the package's data files (pyproject.toml) out; a `pip install`
# of the package puts the same pages in its prefix's share/man/man1.
MAN_DIR := $(VENV)/share/man/man1

man-pages:
	@install -d $(MAN_DIR)
	@install -m 644 man/*.1 $(MAN_DIR)/

# The demo also installs Spark (the spark extra, Java 17), so examples/spark-export.py
# runs right after it.
demo: system-deps $(VENV)/.spark-stamp man-pages
	$(PY) examples/demo.py

lint: $(VENV)/.dev-stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.dev-stamp
	$(VENV)/bin/mypy

test: system-deps $(VENV)/.dev-stamp man-pages lint typecheck
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-slow: system-deps $(VENV)/.dev-stamp
	$(VENV)/bin/pytest -m slow $(PYTEST_ARGS)

bench: $(VENV)/.base-stamp
	$(PY) bench/codec.py

clean:
	rm -rf $(VENV) .venv-latest $(TOOLS_VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
