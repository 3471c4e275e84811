#!/usr/bin/env bash
# The runtime lane against vLLM 0.33 (make test-vllm033): a virtualenv of its own (VLLM033_VENV, default
# .venv-vllm033) with prefixcache, vLLM 0.33.0 and its torch 2.14, then, with that vLLM imported, the connector against
# its API (tests/test_vllm_api.py) and the scheduler side driven with its config, request, block and output classes
# against a real daemon (tests/test_scheduler_side.py). On a GPU host the virtualenv takes prefixcache[cuda] and the
# config validation runs with sleep mode on too; elsewhere vLLM's CUDA build runs on its CPU platform
# (VLLM_TARGET_DEVICE=cpu) and Mooncake's non-CUDA build stands in for the CUDA one, which needs libcuda.
# Not in CI: the install downloads about 4.5 GB and took 31 minutes on a busy 2-core machine (docs/decisions.md, "The
# runtime lane against vLLM 0.33 is a make target, not in CI"). A second run reuses the virtualenv and installs
# nothing new. Prints the install's and the tests' times.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM033_VENV:-$ROOT/.venv-vllm033}"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
t0=$(date +%s)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    PREFIXCACHE_EXTRA=cuda PREFIXCACHE_VENV="$VENV" bash "$ROOT/deploy/setup.sh"
    "${PIP[@]}" install "vllm==0.33.0"
else
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "${PIP[@]}" install "vllm==0.33.0" -e "${ROOT}[dev]" "mooncake-transfer-engine-non-cuda>=0.3.13"
    "${PIP[@]}" uninstall -y mooncake-transfer-engine >/dev/null 2>&1 || true
    export VLLM_TARGET_DEVICE=cpu
fi
t1=$(date +%s)
echo "[vllm033] installed in $((t1 - t0)) s: $(du -sh "$VENV" | cut -f1) in $VENV"
cd "$ROOT"
"$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/test_vllm_api.py tests/test_scheduler_side.py
echo "[vllm033] tests passed in $(($(date +%s) - t1)) s"
