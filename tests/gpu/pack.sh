#!/usr/bin/env bash
# tests/gpu/pack.sh: build the NVLink GPU check on a machine without a GPU and pack it for one
# without a Rust toolchain (a GPU node needs only the NVIDIA driver):
#     tests/gpu/pack.sh DIR          # builds, then copies the binaries, debug info stripped, into DIR
#     tests/gpu/run.sh --prebuilt DIR   # on the GPU node, from a checkout of the same commit
# DIR receives: the plugin's test binaries (unit tests and `gpu`), its bandwidth benchmark, the
# conformance harness built with its CUDA memory provider, and the plugin library.
set -euo pipefail
DIR="${1:?usage: tests/gpu/pack.sh DIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
REL="${CARGO_TARGET_DIR:-$ROOT/target}/release"
mkdir -p "$DIR"
rm -f "$DIR"/*
cargo build --release -p kvgate-plugin-nvlink-so
# The harness with its CUDA memory provider, built on its own (with other packages in the same
# command the feature is not applied to the binary), copied before any other build replaces it.
cargo build --release -p kvgate-conformance --features cuda
objcopy --strip-debug "$REL/kvgate-conformance" "$DIR/kvgate-conformance"
if strings "$DIR/kvgate-conformance" | grep -q "this harness was built without CUDA"; then
    echo "pack: kvgate-conformance was built without its cuda feature" >&2; exit 1
fi
# The test and bench executables, as cargo names them (one JSON line per artifact).
executables() {
    cargo "$@" -p kvgate-plugin-nvlink --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}
{ executables test --release; executables bench --bench nvlink_bandwidth; } | sort -u | while read -r name exe; do
    objcopy --strip-debug "$exe" "$DIR/$name"
done
objcopy --strip-debug "$REL/libkvgate_nvlink.so" "$DIR/libkvgate_nvlink.so"
# The daemon, for the end-to-end step, when it runs without UCX (a GPU node seldom has it): build it
# so with `cargo build --release -p kvgate --no-default-features` before packing.
if ldd "$REL/kvgate" 2>/dev/null | grep -q libucp; then
    echo "pack: $REL/kvgate links UCX; the e2e step needs one built with --no-default-features (not packed)" >&2
elif [ -x "$REL/kvgate" ]; then
    objcopy --strip-debug "$REL/kvgate" "$DIR/kvgate"
fi
git rev-parse HEAD > "$DIR/commit"
ls -l "$DIR"
du -sh "$DIR"
