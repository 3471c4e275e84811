#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, for a machine that has one and network:  bash tests/gpu/run.sh
#   1. a virtualenv with prefixcache[cuda,dev] (deploy/setup.sh with PREFIXCACHE_EXTRA=cuda) at PREFIXCACHE_VENV,
#      default .venv-gpu, apart from a CPU host's .venv; a second run reuses it and installs nothing;
#   2. the CUDA copy path's tests: tests/test_cuda_copies.py, tests/test_pages.py;
#   3. a real vLLM engine on the GPU, with vLLM's defaults, against a real daemon (tests/gpu/engine_check.py): a
#      producer process, then a fresh consumer, their greedy outputs against a run without the connector, the
#      store's hit and its first-token latency beside vLLM's own prefix-cache hit.
# Logs go to $OUT (a temporary folder if unset); the last line sums up, and the exit code is non-zero if a step
# failed. About 3 minutes once the packages are installed (the first install downloads vLLM and CUDA torch).
# A GPU machine without network has no vLLM to install: tests/gpu/check.sh runs the copy path's checks there.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${PREFIXCACHE_VENV:-$ROOT/.venv-gpu}"
PY="$VENV/bin/python"
OUT="${OUT:-$(mktemp -d -t prefixcache-gpu.XXXXXX)}"
t0=$(date +%s)
tests="not run"
engine="engine check: not run"

summary() {
    local verdict=$1
    echo "gpu check $verdict in $(($(date +%s) - t0)) s: CUDA tests: $tests; $engine (logs in $OUT)"
}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu check: no NVIDIA GPU answers nvidia-smi here; on a CPU host, make test runs everything else" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

echo "[gpu] installing prefixcache[cuda,dev] into $VENV (log: $OUT/setup.log)"
if ! PREFIXCACHE_EXTRA=cuda PREFIXCACHE_VENV="$VENV" bash "$ROOT/deploy/setup.sh" >"$OUT/setup.log" 2>&1; then
    tail -30 "$OUT/setup.log"
    summary FAILED
    exit 1
fi
cd "$ROOT"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else f"torch {torch.__version__} sees no GPU")'; then
    summary FAILED
    exit 1
fi

echo "[gpu] the CUDA copy path's tests"
"$PY" -m pytest -p no:cacheprovider -q -rs tests/test_cuda_copies.py tests/test_pages.py 2>&1 | tee "$OUT/pytest.log"
tests_status=${PIPESTATUS[0]}
tests="$(tail -1 "$OUT/pytest.log" | tr -d '=' | xargs)"
# Skipped tests mean the copy path went untested: here they count as a failure.
if grep -q "skipped" <<<"$tests"; then tests_status=1; fi

echo "[gpu] a real engine on the GPU against a real daemon"
"$PY" -m tests.gpu.engine_check --work "$OUT/engine" 2>&1 | tee "$OUT/engine.log"
engine_status=${PIPESTATUS[0]}
engine="$(grep "^engine check" "$OUT/engine.log" | tail -1)"
engine="${engine:-engine check failed before its summary (see $OUT/engine.log)}"

if [ "$tests_status" = 0 ] && [ "$engine_status" = 0 ]; then summary passed; else summary FAILED; exit 1; fi
