#!/usr/bin/env bash
# The runtime lane against vLLM 0.33 (make test-vllm033): a virtualenv of its own (VLLM033_VENV, default
# .venv-vllm033) with prefixcache[cuda,dev], vLLM 0.33.0 and its torch 2.14, then, with that vLLM imported, the
# connector against its API (tests/test_vllm_api.py) and the scheduler side driven with its config, request, block
# and output classes against a real daemon (tests/test_scheduler_side.py: on a GPU host with sleep mode on and off).
# Not in CI: the install downloads about 4.5 GB and takes minutes, and vLLM's CUDA build finds no platform on a host
# without a GPU (docs/decisions.md, "The runtime lane against vLLM 0.33 is a make target, not in CI"). A second run
# reuses the virtualenv. Prints the install's and the tests' times.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM033_VENV:-$ROOT/.venv-vllm033}"
t0=$(date +%s)
PREFIXCACHE_EXTRA=cuda PREFIXCACHE_VENV="$VENV" bash "$ROOT/deploy/setup.sh"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm==0.33.0"
t1=$(date +%s)
echo "[vllm033] installed in $((t1 - t0)) s: $(du -sh "$VENV" | cut -f1) in $VENV"
cd "$ROOT"
"$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/test_vllm_api.py tests/test_scheduler_side.py
echo "[vllm033] tests passed in $(($(date +%s) - t1)) s"
