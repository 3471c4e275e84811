#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, for a machine that has one and network:  bash tests/gpu/run.sh
#   1. a virtualenv with prefixcache[cuda,dev] (deploy/setup.sh with PREFIXCACHE_EXTRA=cuda) at PREFIXCACHE_VENV,
#      default .venv-gpu, apart from a CPU host's .venv; it takes the newest vLLM the extra allows (0.33), or
#      VLLM_VERSION (say 0.32.0); a second run reuses it and installs nothing;
#   2. the CUDA copy kernels' tests (tests/test_cuda_copies.py, tests/test_pages.py) and the connector against the
#      installed vLLM's API (tests/test_vllm_api.py);
#   3. real vLLM engines on the GPU with vLLM's own choices (CUDA graphs, asynchronous scheduling, the V2 model runner
#      where vLLM picks it) against a real daemon (tests/gpu/engine_check.py): a producer, then a fresh consumer that
#      sleeps and wakes up while it holds cached KV and loads again; greedy outputs against a run without the
#      connector, the store's hit and its first-token latency beside vLLM's own prefix-cache hit.
# Logs go to $OUT (a temporary folder if unset); the last line sums up, and the exit code is non-zero if a step
# failed. Each step has a time limit: the whole fits 8 minutes once the packages are installed (the first install
# downloads about 4.5 GB: vLLM, CUDA torch and its libraries).
# A GPU machine without network has no vLLM to install: tests/gpu/check.sh runs the copy path's checks there.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${PREFIXCACHE_VENV:-$ROOT/.venv-gpu}"
PY="$VENV/bin/python"
OUT="${OUT:-$(mktemp -d -t prefixcache-gpu.XXXXXX)}"
TESTS_LIMIT_S=150
ENGINES_LIMIT_S=330
t0=$(date +%s)
gpu="no GPU"
vllm="vLLM not installed"
tests="not run"
engine="engine check: not run"

summary() {
    echo "gpu check $1 in $(($(date +%s) - t0)) s on $gpu with $vllm: CUDA tests: $tests; $engine (logs in $OUT)"
}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu check: no NVIDIA GPU answers nvidia-smi here; on a CPU host, make test runs everything else" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

echo "[gpu] installing prefixcache[cuda,dev] into $VENV (log: $OUT/setup.log)"
if ! PREFIXCACHE_EXTRA=cuda PREFIXCACHE_VENV="$VENV" bash "$ROOT/deploy/setup.sh" >"$OUT/setup.log" 2>&1; then
    tail -30 "$OUT/setup.log"
    summary FAILED
    exit 1
fi
if [ -n "${VLLM_VERSION:-}" ] && ! "$PY" -m pip install -q "vllm==$VLLM_VERSION" >>"$OUT/setup.log" 2>&1; then
    tail -30 "$OUT/setup.log"
    summary FAILED
    exit 1
fi
cd "$ROOT" || exit 1
vllm="vLLM $("$PY" -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null || echo '?')"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else f"torch {torch.__version__} sees no GPU")'; then
    summary FAILED
    exit 1
fi
echo "[gpu] installed in $(($(date +%s) - t0)) s: $vllm"

echo "[gpu] the CUDA copy kernels' tests and the connector against vLLM's API (at most $TESTS_LIMIT_S s)"
timeout "$TESTS_LIMIT_S" "$PY" -m pytest -p no:cacheprovider -q -rs \
    tests/test_cuda_copies.py tests/test_pages.py tests/test_vllm_api.py 2>&1 | tee "$OUT/pytest.log"
tests_status=${PIPESTATUS[0]}
tests="$(tail -1 "$OUT/pytest.log" | tr -d '=' | xargs)"
[ "$tests_status" = 124 ] && tests="timed out after $TESTS_LIMIT_S s"
# Skipped tests mean the copy path went untested: here they count as a failure.
if grep -q "skipped" <<<"$tests"; then tests_status=1; fi

echo "[gpu] real engines on the GPU against a real daemon, sleep and wake-up included (at most $ENGINES_LIMIT_S s)"
timeout "$ENGINES_LIMIT_S" "$PY" -m tests.gpu.engine_check --work "$OUT/engine" 2>&1 | tee "$OUT/engine.log"
engine_status=${PIPESTATUS[0]}
engine="$(grep "^engine check" "$OUT/engine.log" | tail -1)"
[ "$engine_status" = 124 ] && engine="engine check timed out after $ENGINES_LIMIT_S s (see $OUT/engine)"
engine="${engine:-engine check failed before its summary (see $OUT/engine.log)}"

if [ "$tests_status" = 0 ] && [ "$engine_status" = 0 ]; then summary passed; else summary FAILED; exit 1; fi
