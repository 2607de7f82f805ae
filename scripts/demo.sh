#!/usr/bin/env bash
# kvgate's main job on built-in defaults, from a fresh clone: installs the Debian packages the build
# needs when any is missing, then runs `kvgate demo` (a prefill and a decode gateway on this machine,
# synthetic engines moving KV caches between them, a results table, a short fault act). Arguments go
# to `kvgate demo` (see `cargo run --release -p kvgate -- demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
exec cargo run --release -p kvgate -- demo "$@"
