#!/bin/bash
# The checks that need CUDA, for a GPU machine without network or vLLM (run from the repository root, with
# .whl/ and .deb/ from tests/gpu/fetch_packages.sh beside it): the CUDA copy path's tests and the worker side's,
# against the real daemon stack, then benchmarks.cuda_copies and benchmarks.windows --device cuda. The
# connector's modules import two vLLM base classes; tests/gpu/vllm_stub stands in for them, so no vLLM engine
# runs here. Logs and results go to $OUT (a temporary folder if unset). `bash tests/gpu/check.sh tests` stops
# after the tests. A GPU machine with network runs tests/gpu/run.sh: the copy path's tests, then a real engine.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
source tests/gpu/env.sh
python3 -m pytest -p no:cacheprovider -q -rs tests/test_cuda_copies.py tests/test_pages.py tests/test_worker_side.py \
    2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
echo "tests done at $(( $(date +%s) - t0 )) s"
[ "${1:-}" = tests ] && exit "$status"
python3 -m benchmarks.cuda_copies 2>&1 | tee "$OUT/cuda_copies.log"
cp benchmarks/results/cuda_copies.json "$OUT/"
timeout 300 python3 -m benchmarks.windows --device cuda 2>&1 | grep -v "^[IEW]1" | tee "$OUT/windows.log"
cp benchmarks/results/windows_cuda.json "$OUT/"
echo "all done at $(( $(date +%s) - t0 )) s; results in $OUT"
exit "$status"
