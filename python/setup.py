"""Build of the `kvgate` package: the protobuf module of the engine API is generated here, at build
time, from the repository's one `gateway/proto/kvgate.proto` (or, in an sdist, the copy taken next to
the generated code), into `kvgate/_proto/kvgate_pb2.py` with its typed `kvgate_pb2.pyi`.

The code is generated with grpcio-tools (a build requirement) and the typed stub with mypy-protobuf
when it is installed (else protoc's own `--pyi_out`). The runtime `protobuf` requirement is the
version of protobuf that the generated code was made for, or newer.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE / "kvgate" / "_proto"
REPO_PROTO = HERE.parent / "gateway" / "proto" / "kvgate.proto"
SDIST_PROTO = PROTO_DIR / "kvgate.proto"
GENERATED = PROTO_DIR / "kvgate_pb2.py"
GENERATED_STUB = PROTO_DIR / "kvgate_pb2.pyi"
# Older generated code names no version; any protobuf that grpcio-tools of that age made runs on this.
FALLBACK_PROTOBUF = "protobuf>=4.21"


def proto_source() -> Path:
    if REPO_PROTO.is_file():
        return REPO_PROTO
    if SDIST_PROTO.is_file():
        return SDIST_PROTO
    raise SystemExit(f"kvgate: no kvgate.proto at {REPO_PROTO} nor {SDIST_PROTO}")


def up_to_date(source: Path) -> bool:
    if not (GENERATED.is_file() and GENERATED_STUB.is_file()):
        return False
    if source != SDIST_PROTO and (not SDIST_PROTO.is_file() or SDIST_PROTO.read_bytes() != source.read_bytes()):
        return False
    return min(GENERATED.stat().st_mtime, GENERATED_STUB.stat().st_mtime) >= source.stat().st_mtime


def mypy_plugin() -> str | None:
    """protoc-gen-mypy of the Python running this build (its scripts folder first), if installed."""
    name = "protoc-gen-mypy"
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def generate() -> None:
    source = proto_source()
    if up_to_date(source):
        return
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:
        raise SystemExit(
            "kvgate: generating kvgate/_proto/kvgate_pb2.py needs grpcio-tools (a build requirement; "
            f"with --no-build-isolation, `pip install grpcio-tools mypy-protobuf setuptools` first): {e}"
        ) from e
    PROTO_DIR.mkdir(parents=True, exist_ok=True)
    if source != SDIST_PROTO:
        shutil.copyfile(source, SDIST_PROTO)
    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        # Laid out as kvgate/_proto/kvgate.proto so that the generated module's name is its package path.
        staged = Path(tmp) / "src" / "kvgate" / "_proto"
        staged.mkdir(parents=True)
        shutil.copyfile(source, staged / "kvgate.proto")
        out = Path(tmp) / "out"
        out.mkdir()
        args = ["grpc_tools.protoc", f"-I{Path(tmp) / 'src'}", f"-I{include}", f"--python_out={out}"]
        plugin = mypy_plugin()
        if plugin:
            args += [f"--plugin=protoc-gen-mypy={plugin}", f"--mypy_out={out}"]
        else:
            args += [f"--pyi_out={out}"]
        args.append("kvgate/_proto/kvgate.proto")
        if protoc.main(args) != 0:
            raise SystemExit(f"kvgate: protoc failed on {source}")
        for name in ("kvgate_pb2.py", "kvgate_pb2.pyi"):
            shutil.copyfile(out / "kvgate" / "_proto" / name, PROTO_DIR / name)


def protobuf_requirement() -> str:
    """`protobuf>=` the version the generated code checks for at import."""
    text = GENERATED.read_text(encoding="utf-8")
    found = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", text)
    if not found:
        return FALLBACK_PROTOBUF
    return "protobuf>={}.{}.{}".format(*found.groups())


generate()
setup(install_requires=["grpcio>=1.59", protobuf_requirement()])
