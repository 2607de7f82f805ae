#!/usr/bin/env bash
# The SGLang backend's checks (`kvgate.sglang`), against SGLang's own code: a virtual environment
# cached per machine outside the clone (made once, reused by later runs), holding PyTorch (the
# registry's wheel, used on the CPU), the few light packages that SGLang's disaggregation modules
# import, and SGLang itself without its dependencies (`--no-deps`: its GPU kernels are not needed to
# import the transfer-backend interface and the scheduler's queue logic). The `kvgate` package is
# installed into it on every run; then `mypy --strict` on `python/kvgate/sglang` and the pytest suite
# `python/tests_sglang` against the release binary (real `kvgate serve` processes).
#
#   KVGATE_SGLANG_VENV   where the environment lives (default ~/.cache/kvgate/sglang-venv-<sglang version>)
#   KVGATE_SGLANG_PYTHON the Python that makes it (default python3; SGLang needs 3.11 or newer)
#   KVGATE_BIN           the gateway binary (default target/release/kvgate)
#
# The first run downloads about 3 GB and fills about 6 GB of disk (about 2 minutes on the development
# machine); later runs reuse it. The environment is made again when the pinned versions below change.
set -euo pipefail
cd "$(dirname "$0")/.."

# The SGLang release the backend is pinned to (python/kvgate/sglang/__init__.py, SUPPORTED_SGLANG),
# and the PyTorch that release requires.
sglang_version="0.5.23"
torch_version="2.14.1"
# What `sglang.srt.disaggregation.{prefill,decode}` import at module level, beside torch (versions
# where SGLang pins them), and the test tools.
light_packages=(
  numpy orjson psutil pybase64 requests packaging Pillow starlette msgspec pyzmq tqdm aiohttp dill
  IPython einops "transformers==5.19.0" "tokenizers==0.23.2" "apache-tvm-ffi==0.1.11"
  "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf "openai==2.8.0" partial_json_parser
)
tools=(setuptools wheel grpcio grpcio-tools mypy-protobuf "mypy>=1.8" types-protobuf "grpc-stubs>=1.53" "pytest>=7" "pytest-timeout>=2")

target_dir="${CARGO_TARGET_DIR:-target}"
export KVGATE_BIN="${KVGATE_BIN:-$(realpath "$target_dir")/release/kvgate}"
if [ ! -x "$KVGATE_BIN" ]; then
  echo "sglang-tests: no kvgate binary at $KVGATE_BIN (cargo build --release first, or set KVGATE_BIN)" >&2
  exit 1
fi

venv="${KVGATE_SGLANG_VENV:-$HOME/.cache/kvgate/sglang-venv-$sglang_version}"
python="${KVGATE_SGLANG_PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "sglang-tests: SGLang $sglang_version needs Python 3.11 or newer; $python is $("$python" --version 2>&1) (set KVGATE_SGLANG_PYTHON)" >&2
  exit 1
fi

pip_flags=(--quiet --disable-pip-version-check --no-input)
wanted="$(printf '%s\n' "$sglang_version" "$torch_version" "${light_packages[@]}" "${tools[@]}" "$("$python" --version 2>&1)" | sha256sum | cut -d' ' -f1)"
stamp="$venv/.kvgate-sglang-env"

setup_start=$(date +%s)
mkdir -p "$(dirname "$venv")"
# One setup at a time per environment (a CI run and a developer's run may share the machine).
exec 9>"$venv.lock"
flock 9
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$wanted" ]; then
  how="created"
  echo "sglang-tests: making the environment $venv (SGLang $sglang_version, PyTorch $torch_version; about 3 GB to download, once)"
  rm -rf "$venv"
  "$python" -m venv "$venv" || { echo "sglang-tests: $python -m venv failed (on Debian: apt-get install python3-venv)" >&2; exit 1; }
  py="$venv/bin/python"
  "$py" -m pip install "${pip_flags[@]}" --upgrade pip
  # torchvision is resolved to the release made for this torch.
  "$py" -m pip install "${pip_flags[@]}" "torch==$torch_version" torchvision
  "$py" -m pip install "${pip_flags[@]}" "torch==$torch_version" "${light_packages[@]}" "${tools[@]}"
  "$py" -m pip install "${pip_flags[@]}" --no-deps "sglang==$sglang_version"
  echo "$wanted" > "$stamp"
else
  how="reused"
fi
flock -u 9
py="$venv/bin/python"
# The package under test, from this clone, every run (no download).
"$py" -m pip install "${pip_flags[@]}" --no-build-isolation --no-deps --force-reinstall ./python
setup_end=$(date +%s)
echo "sglang-tests: environment $how in $((setup_end - setup_start)) s ($venv, $(du -sh "$venv" 2>/dev/null | cut -f1))"

# The tests import the package from this clone (python/), so that they test this tree's kvgate.sglang
# whether or not the installed distribution lists the subpackage.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
if ! (cd / && env -u PYTHONPATH "$py" -c 'import kvgate.sglang' 2>/dev/null); then
  echo "sglang-tests: note: the installed kvgate lacks kvgate.sglang (the packages listed in python/pyproject.toml); testing python/ directly"
fi

echo "sglang-tests: mypy --strict python/kvgate/sglang python/tests_sglang"
"$py" -m mypy --cache-dir "$venv/.mypy_cache" --config-file python/tests_sglang/mypy.ini python/kvgate/sglang python/tests_sglang

echo "sglang-tests: pytest python/tests_sglang (SGLang $("$py" -c 'import importlib.metadata as m; print(m.version("sglang"))'), kvgate: $KVGATE_BIN)"
"$py" -m pytest python/tests_sglang -q -rs -p no:cacheprovider
