#!/usr/bin/env bash
# Installs the Debian packages kvgate's build, demo and tests need, when any is missing (Debian 12 or
# later, as root or through sudo). Used by `scripts/demo.sh` and `.ci/run`; safe to run again.
set -euo pipefail

packages=(
  libucx-dev         # UCX headers and libraries for plugins/ucx (kvgate-ucx-sys binds them with bindgen)
  ucx-utils          # ucx_perftest: the reference the UCX benchmark compares against
  libclang-dev       # bindgen needs libclang
  pkg-config         # kvgate-ucx-sys finds UCX through pkg-config
  protobuf-compiler  # protoc, for the engine-API and peer-link .proto
  libprotobuf-dev    # google/protobuf/*.proto, which etcd-client's protos import (only recommended by protobuf-compiler)
  iperf3             # TCP reference for the QUIC benchmark
  etcd-server        # etcd: the discovery tests run the gateway against a real one
  prometheus         # prometheus + promtool: deploy/'s alert rules and dashboard are checked against a real one
)
missing=()
# Installed means "install ok installed": `dpkg -s` also succeeds for a package removed but not purged.
for p in "${packages[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "kvgate: installing ${missing[*]}" >&2
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
# The prometheus package enables its own service (port 9090); kvgate's check runs its own instance.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  $sudo systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
