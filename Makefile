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

bench: setup
	$(PY) -m benchmarks.lookup
