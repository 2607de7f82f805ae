#!/usr/bin/env bash
# The Python client's checks: a virtual environment under the build directory (made once, reused), the
# `kvgate` package (python/) installed into it with its test tools, `mypy --strict` on the package and
# its tests, then its pytest suite against the release binary (real `kvgate serve` processes). Needs the
# binary built first (`cargo build --release`). Skips only what needs a CUDA GPU, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
venv="$target_dir/python-venv"
export KVGATE_BIN="${KVGATE_BIN:-$(realpath "$target_dir")/release/kvgate}"
if [ ! -x "$KVGATE_BIN" ]; then
  echo "python-tests: no kvgate binary at $KVGATE_BIN (cargo build --release first, or set KVGATE_BIN)" >&2
  exit 1
fi

pip_flags=(--quiet --disable-pip-version-check --no-input)
if [ ! -x "$venv/bin/python" ]; then
  echo "python-tests: creating $venv"
  python3 -m venv "$venv" || { echo "python-tests: python3 -m venv failed (on Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
py="$venv/bin/python"

# The test tools and the package's build requirements are installed when the package's build files
# change (or on the first run); otherwise only the package is reinstalled, without build isolation, so
# a second run needs no download.
stamp="$venv/.kvgate-requirements"
wanted="$(cat python/pyproject.toml python/setup.py | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$wanted" ]; then
  echo "python-tests: installing build requirements and test tools"
  "$py" -m pip install "${pip_flags[@]}" --upgrade pip setuptools wheel grpcio-tools mypy-protobuf
  "$py" -m pip install "${pip_flags[@]}" --no-build-isolation "./python[test]"
  echo "$wanted" > "$stamp"
else
  "$py" -m pip install "${pip_flags[@]}" --no-build-isolation --no-deps --force-reinstall ./python
fi

echo "python-tests: mypy --strict python/kvgate python/tests examples/python"
"$py" -m mypy --config-file python/pyproject.toml python/kvgate python/tests examples/python

echo "python-tests: pytest python/tests (kvgate: $KVGATE_BIN)"
# -rs: the reason of every skipped test is printed (only the CUDA test may skip, without a GPU).
"$py" -m pytest python/tests -q -rs
