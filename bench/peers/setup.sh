#!/usr/bin/env bash
# Creates, or reuses when already complete, the virtual environment the peer runners
# (nixl_bench.py, mooncake_bench.py) run in, with pinned versions of NIXL and Mooncake's
# Transfer Engine. Never installs torch: nixl-cu12 declares it, but only imports it on demand.
#
#   bench/peers/setup.sh VENV_DIR
#
# Exit codes: 0 ready; 2 bad usage or disk too full; 3 package registry unreachable;
# 4 install failed; 5 installed but an import check failed.
set -euo pipefail

readonly NIXL_VERSION="1.5.1"
readonly NUMPY_VERSION="2.2.6"
readonly MOONCAKE_VERSION="0.3.13.post1"
# Only for bench/peers/test_peers.py.
readonly PYTEST_VERSION="8.4.2"
readonly MIN_FREE_DISK_MB=1024
readonly PIP_TIMEOUT_S=60

log() { echo "peers-setup: $*" >&2; }
die() { local code=$1; shift; log "error: $*"; exit "$code"; }

[[ $# -eq 1 ]] || die 2 "usage: $0 VENV_DIR"
venv=$1
python=${PYTHON:-python3}
pins_file="$venv/kvgate-peer-pins.txt"
expected_pins="nixl-cu12==$NIXL_VERSION
numpy==$NUMPY_VERSION
mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION
pytest==$PYTEST_VERSION"

imports_work() {
    "$venv/bin/python" - <<'PY' >/dev/null 2>&1
import numpy
import pytest
from nixl_cu12 import nixl_agent
from mooncake.engine import TransferEngine
PY
}

if [[ -x "$venv/bin/python" && -f "$pins_file" && "$(cat "$pins_file")" == "$expected_pins" ]] && imports_work; then
    log "reusing $venv (complete: $(tr '\n' ' ' <"$pins_file"))"
    exit 0
fi

parent=$(dirname "$venv")
mkdir -p "$parent"
free_mb=$(df -Pm "$parent" | awk 'NR==2 {print $4}')
(( free_mb >= MIN_FREE_DISK_MB )) || die 2 "only ${free_mb} MB free under $parent; need ${MIN_FREE_DISK_MB} MB"

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating virtual environment at $venv with $($python --version 2>&1)"
    "$python" -m venv "$venv" || die 4 "python -m venv failed"
else
    log "completing existing virtual environment at $venv"
fi
rm -f "$pins_file"

pip=("$venv/bin/python" -m pip --disable-pip-version-check --timeout "$PIP_TIMEOUT_S" --retries 1)

registry_reachable() { "${pip[@]}" index versions numpy >/dev/null 2>&1; }

install() {
    log "pip install $*"
    if ! "${pip[@]}" install --progress-bar off "$@" >&2; then
        registry_reachable || die 3 "the Python package registry is unreachable (pip could not list numpy); check the network or pip's index settings"
        die 4 "pip install $* failed (see pip's output above)"
    fi
}

install "numpy==$NUMPY_VERSION"
# --no-deps: nixl-cu12 requires torch in its metadata, several GB of wheels this bench never uses.
install --no-deps "nixl-cu12==$NIXL_VERSION"
install "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
install "pytest==$PYTEST_VERSION"

imports_work || die 5 "installed, but importing nixl_cu12, mooncake.engine, numpy or pytest fails in $venv"
printf '%s\n' "$expected_pins" >"$pins_file"
log "ready: $venv ($(du -sm "$venv" | cut -f1) MB); pins in $pins_file"
