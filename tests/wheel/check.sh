#!/usr/bin/env bash
# The release artefacts, checked as a user installs them (.ci/run runs this after make test; make check-wheel):
#   1. builds the sdist and, from it, the wheel (python -m build), and checks what they hold: one top-level
#      package, prefixcache, with every module and data file (the index's Lua scripts, the bind shim's C source),
#      nothing compiled (tests/wheel/checks.py contents);
#   2. installs the wheel, not editable, into a fresh virtualenv "beside the engine": its only view of the
#      development venv is a .pth file naming that venv's site-packages, so vLLM, torch and Mooncake are there but
#      prefixcache is the wheel alone (the editable install's finder does not run there: checks.py installed);
#   3. from a folder outside the repository: `prefixcache --help`; `prefixcache serve` until /v1/health answers;
#      an end-to-end connector test (the repository's tests, prefixcache imported from the wheel).
# VENV: the development virtualenv (default .venv). KEEP=1 keeps the work folder (its path is printed).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEV_PY="$(cd "$REPO" && cd "${VENV:-.venv}" && pwd)/bin/python"
E2E_TEST="tests/e2e/test_connector_e2e.py::test_a_fresh_instance_loads_every_cached_token_and_answers_the_same"
WORK="$(mktemp -d -t prefixcache-wheel.XXXXXX)"
FRESH="$WORK/venv/bin/python"
serve_pid=""
t0=$(date +%s)
unset PYTHONPATH  # only what each step sets below

step() { printf '\033[1;34m[wheel]\033[0m %s (at %d s)\n' "$*" "$(($(date +%s) - t0))"; }
die() { printf '\033[1;31mwheel check failed:\033[0m %s\n' "$*" >&2; exit 1; }
finish() {
    [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null
    if [ "${KEEP:-0}" = 1 ]; then echo "wheel check: work folder kept: $WORK"; else rm -rf "$WORK"; fi
}
trap finish EXIT

step "building the sdist and the wheel"
"$DEV_PY" -m build --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; die "build"; }
wheel=("$WORK"/dist/*.whl)
sdist=("$WORK"/dist/*.tar.gz)
"$DEV_PY" "$REPO/tests/wheel/checks.py" contents "$REPO" "${wheel[0]}" "${sdist[0]}" || die "contents"
echo "built $(basename "${sdist[0]}") and $(basename "${wheel[0]}")"

step "installing the wheel into a fresh virtualenv beside the engine"
# Without pip or setuptools of its own, so that the engine's are the ones found; the development venv's pip
# installs into it, before the engine's path is added (pip sees no other prefixcache there).
"$DEV_PY" -m venv --without-pip "$WORK/venv"
"$DEV_PY" -m pip --python "$FRESH" install -q --no-deps --no-index --disable-pip-version-check "${wheel[0]}"
site="$("$FRESH" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$FRESH" -c 'import sys; print("\n".join(sys.path))' >"$WORK/fresh-path"
"$DEV_PY" "$REPO/tests/wheel/checks.py" engine-path "$REPO" "$WORK/fresh-path" >"$site/beside_the_engine.pth"
mkdir "$WORK/outside"
cd "$WORK/outside"
"$FRESH" "$REPO/tests/wheel/checks.py" installed "$site" || die "prefixcache is not the wheel's"
"$FRESH" -c 'import vllm, torch, mooncake' || die "the engine is not visible from the fresh virtualenv"

step "prefixcache --help"
"$WORK/venv/bin/prefixcache" --help >"$WORK/help.txt" || { cat "$WORK/help.txt"; die "prefixcache --help"; }
grep -q serve "$WORK/help.txt" || die "prefixcache --help lists no serve command"

step "prefixcache serve, until /v1/health answers"
port="$("$FRESH" -c 'from prefixcache.cachestore.host.processes import free_port_block; print(free_port_block(7))')"
"$WORK/venv/bin/prefixcache" serve --data-dir "$WORK/data" --port "$port" --dram-bytes 256MiB --nvme-bytes 512MiB \
    >"$WORK/serve.log" 2>&1 &
serve_pid=$!
health="import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)"
for _ in $(seq 120); do
    kill -0 "$serve_pid" 2>/dev/null || { cat "$WORK/serve.log"; die "prefixcache serve exited"; }
    "$FRESH" -c "$health" "http://127.0.0.1:$port/v1/health" 2>/dev/null && break
    sleep 0.5
done
"$FRESH" -c "$health" "http://127.0.0.1:$port/v1/health" || { cat "$WORK/serve.log"; die "/v1/health never answered"; }
kill -TERM "$serve_pid"
status=0
wait "$serve_pid" || status=$?
serve_pid=""
[ "$status" = 0 ] || { cat "$WORK/serve.log"; die "prefixcache serve exited $status on SIGTERM"; }
echo "the daemon answered /v1/health on port $port and stopped on SIGTERM"

step "an end-to-end connector test against the installed package: $E2E_TEST"
# The repository on the path for its tests (tests.*), as its engines run too (tests/e2e/launch.py): prefixcache's
# packages must still be the wheel's.
PYTHONPATH="$REPO" "$FRESH" "$REPO/tests/wheel/checks.py" modules "$site" || die "prefixcache is not the wheel's"
PYTHONPATH="$REPO" "$FRESH" -m pytest --rootdir "$REPO" -c "$REPO/pyproject.toml" -p no:cacheprovider -q \
    "$REPO/$E2E_TEST" || die "the end-to-end test"

step "the wheel check passed"
