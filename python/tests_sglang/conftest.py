"""Fixtures: real `kvgate serve` pairs (python/tests/gateways.py) and an SGLang prefill and decode
engine process on them (`engine.py`), all killed at teardown, with logs shown when a test fails."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Generator, Iterator

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from gateways import Pair, Settings, free_port, kvgate_binary  # noqa: E402
from harness import Engine, Engines, write_tiny_model  # noqa: E402


def pytest_report_header() -> list[str]:
    try:
        import importlib.metadata as metadata

        sglang = metadata.version("sglang")
    except Exception:  # noqa: BLE001 - reported as missing
        sglang = "not installed"
    return [f"kvgate binary: {kvgate_binary()}", f"sglang: {sglang}"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not kvgate_binary().is_file():
        raise pytest.UsageError(f"no kvgate binary at {kvgate_binary()} (build it, or set KVGATE_BIN)")


@pytest.fixture
def workdir() -> Iterator[Path]:
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="kvgate-sgl-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def started(request: pytest.FixtureRequest) -> Iterator[list[object]]:
    """Gateway pairs and engines a test started: stopped at teardown, logs shown on failure."""
    items: list[object] = []
    yield items
    report = getattr(request.node, "rep_call", None)
    failed = report is not None and report.failed
    for item in reversed(items):
        if isinstance(item, Engine):
            if failed:
                sys.stderr.write(f"\n----- log of the {item.role} engine -----\n{item.log()}\n")
            item.close()
        elif isinstance(item, Pair):
            item.kill()
            if failed:
                for g in item.gateways.values():
                    sys.stderr.write(f"\n----- log of gateway {g.name} -----\n{g.log()[-4000:]}\n")


def _starter(workdir: Path, started: list[object]) -> Callable[..., tuple[Pair, Engines]]:
    def start(engine_env: dict[str, str] | None = None, **settings: object) -> tuple[Pair, Engines]:
        pair = Pair(workdir, Settings(**settings))  # type: ignore[arg-type]
        started.append(pair)
        model = write_tiny_model(workdir / "model")
        port = free_port()
        # Both start at once: the decode engine waits for the prefill engine's bootstrap server.
        prefill = Engine("prefill", pair.prefill.socket, model, port, workdir / "prefill-engine.log", engine_env)
        started.append(prefill)
        decode = Engine("decode", pair.decode.socket, model, port, workdir / "decode-engine.log", engine_env)
        started.append(decode)
        prefill.wait_ready()
        decode.wait_ready()
        return pair, Engines(prefill, decode)

    return start


@pytest.fixture
def start_engines(workdir: Path, started: list[object]) -> Callable[..., tuple[Pair, Engines]]:
    """`start_engines(engine_env=..., **settings)`: a gateway pair and a prefill and a decode engine on it,
    for this test alone (fault tests)."""
    return _starter(workdir, started)


@pytest.fixture(scope="session")
def shared() -> Iterator[tuple[Pair, Engines]]:
    """One gateway pair with a prefill and a decode engine for the tests that leave them healthy
    (distinct request ids per test). Started once: an engine takes seconds to import SGLang."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="kvgate-sgl-shared-", dir=base))
    items: list[object] = []
    try:
        yield _starter(path, items)()
    finally:
        for item in reversed(items):
            if isinstance(item, Engine):
                item.close()
            elif isinstance(item, Pair):
                item.kill()
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engines(shared: tuple[Pair, Engines], request: pytest.FixtureRequest) -> Iterator[Engines]:
    """The shared engines; their logs are shown if the test fails."""
    yield shared[1]
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for engine in (shared[1].prefill, shared[1].decode):
            sys.stderr.write(f"\n----- log of the {engine.role} engine -----\n{engine.log()}\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
