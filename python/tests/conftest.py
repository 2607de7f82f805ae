"""Fixtures: a work folder on /dev/shm, and real gateway pairs started from `gateways.py` (killed at
teardown; their logs printed when a test fails)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Generator, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateways import Cluster, Pair, Settings, kvgate_binary  # noqa: E402


def pytest_report_header() -> list[str]:
    return [f"kvgate binary: {kvgate_binary()}"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not kvgate_binary().is_file():
        raise pytest.UsageError(f"no kvgate binary at {kvgate_binary()} (build it, or set KVGATE_BIN)")


@pytest.fixture
def workdir() -> Iterator[Path]:
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="kvgate-py-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def clusters(request: pytest.FixtureRequest) -> Iterator[list[Cluster]]:
    """Clusters a test started; killed at teardown, with their logs shown if the test failed."""
    started: list[Cluster] = []
    yield started
    failed = getattr(request.node, "rep_call", None)
    for cluster in started:
        cluster.kill()
        if failed is not None and failed.failed:
            for g in cluster.gateways.values():
                sys.stderr.write(f"\n----- log of gateway {g.name} -----\n{g.log()[-6000:]}\n")


@pytest.fixture
def start_pair(workdir: Path, clusters: list[Cluster]) -> Callable[..., Pair]:
    """`start_pair(**settings)`: a linked prefill and decode gateway."""

    def start(**kwargs: object) -> Pair:
        pair = Pair(workdir, Settings(**kwargs))  # type: ignore[arg-type]
        clusters.append(pair)
        return pair

    return start


@pytest.fixture
def pair(start_pair: Callable[..., Pair]) -> Pair:
    return start_pair()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
