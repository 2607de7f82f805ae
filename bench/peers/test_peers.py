"""Checks of the peer runners: the cell procedure and its verification against deliberately wrong
copies (standard library only, always run), then each runner for real on a tiny cell set through
run.sh (skipped, with the reason, where the environment made by setup.sh is missing or Mooncake's
private network namespace cannot be made).

    target/peers-venv/bin/python -m pytest bench/peers/test_peers.py
    KVGATE_PEERS_VENV=/path/to/venv python -m pytest bench/peers/test_peers.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from peer_common import (  # noqa: E402
    MIN_TIMED_TRANSFERS, Cell, Pool, PreparedCell, TransferFailed, cell_record, first_difference, parse_cells,
    percentile_ms, run_cell, verify,
)

VENV = Path(os.environ.get("KVGATE_PEERS_VENV", REPO / "target" / "peers-venv"))
TINY_CELLS = "4K:1,64K:4"
TINY_CELL_MS = 50
# A tiny run takes seconds; this only keeps a wedged peer from holding the suite.
RUNNER_WAIT_S = 180
SCHEMA: dict[str, type | tuple[type, ...]] = {"peer": str, "transport": str, "block_bytes": int, "blocks": int, "transfers": int, "gbps": float,
          "p50_ms": float, "p99_ms": float, "verified": bool, "error": (str, type(None))}


# --- the procedure and its verification, without a peer -------------------------------------------------

def test_cells_parse_sizes_and_counts() -> None:
    assert parse_cells("4K:1,64K:100,4M:1,64M:1") == [Cell(4096, 1), Cell(65536, 100), Cell(4 << 20, 1), Cell(64 << 20, 1)]
    assert parse_cells("4096:2") == [Cell(4096, 2)]
    for bad in ["", "4K", "4K:0", "0:1", "4X:1", "4K:-1", "4K:x"]:
        with pytest.raises(ValueError):
            parse_cells(bad)


def test_percentiles_are_nearest_rank() -> None:
    samples = [5_000_000, 1_000_000, 3_000_000, 2_000_000, 4_000_000]
    assert percentile_ms(samples, 50) == 3.0
    assert percentile_ms(samples, 99) == 5.0
    assert percentile_ms(samples, 0) == 1.0
    assert percentile_ms([], 50) == 0.0


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 100_000, (1 << 20) - 1])
def test_first_difference_finds_a_single_corrupted_byte(offset: int) -> None:
    src = bytes(range(256)) * 4096
    dst = bytearray(src)
    dst[offset] ^= 0x01
    assert first_difference(src, dst, len(src)) == offset
    assert first_difference(src, bytes(src), len(src)) is None
    # Only the first `length` bytes count.
    assert first_difference(src, dst, offset) is None


def test_verify_reports_a_corrupted_destination_pool() -> None:
    src, dst = Pool(1 << 16), Pool(1 << 16)
    src.map[:] = os.urandom(1 << 16)
    dst.map[:] = src.map[:]
    assert verify(src, dst, 1 << 16) is None
    dst.map[40_000] ^= 0x80
    assert verify(src, dst, 1 << 16) == "destination differs from source at byte 40000 of 65536"
    assert verify(src, dst, 40_000) is None


def test_a_record_with_an_error_reports_no_throughput() -> None:
    record = cell_record("nixl", "ucx", Cell(4096, 1), transfers=9, gbps=3.0, verified=True, error="lost")
    assert record["gbps"] == 0.0 and record["verified"] is False and record["error"] == "lost"


def copier(src: Pool, dst: Pool, behaviour: Callable[[int, bytearray], None] | None = None) -> Callable[[Cell], PreparedCell]:
    """A stand-in peer that copies in this process; `behaviour(call_index, bytes)` may spoil a copy."""
    def prepare(cell: Cell) -> PreparedCell:
        calls = [0]

        def one_transfer() -> None:
            data = bytearray(src.map[:cell.transfer_bytes])
            if behaviour is not None:
                behaviour(calls[0], data)
            calls[0] += 1
            dst.map[:cell.transfer_bytes] = bytes(data)

        return one_transfer, lambda: None
    return prepare


def run_stand_in(behaviour: Callable[[int, bytearray], None] | None) -> dict[str, object]:
    src, dst = Pool(1 << 16), Pool(1 << 16)
    return run_cell("stand-in", "memory", Cell(4096, 4), src, dst, 1, copier(src, dst, behaviour))


def test_a_correct_copy_is_measured_and_verified() -> None:
    record = run_stand_in(None)
    assert record["error"] is None and record["verified"] is True
    assert isinstance(record["transfers"], int) and record["transfers"] >= MIN_TIMED_TRANSFERS
    assert isinstance(record["gbps"], float) and record["gbps"] > 0


def test_a_wrong_warm_up_copy_fails_the_cell() -> None:
    def flip_last_byte(_call: int, data: bytearray) -> None:
        data[-1] ^= 0xFF

    record = run_stand_in(flip_last_byte)
    assert record["verified"] is False and record["gbps"] == 0.0
    assert record["error"] == "warm-up transfer: destination differs from source at byte 16383 of 16384"


def test_a_timed_transfer_that_writes_wrong_bytes_fails_the_cell() -> None:
    def spoil_after_warm_up(call: int, data: bytearray) -> None:
        if call > 0:
            data[100] ^= 0x01

    record = run_stand_in(spoil_after_warm_up)
    assert record["verified"] is False and record["gbps"] == 0.0
    assert record["error"] == "after the timed transfers: destination differs from source at byte 100 of 16384"


def test_timed_transfers_that_write_nothing_fail_the_cell() -> None:
    """The destination is poisoned before the timed transfers: the warm-up's bytes cannot pass for theirs."""
    src, dst = Pool(1 << 16), Pool(1 << 16)

    def prepare(cell: Cell) -> PreparedCell:
        calls = [0]

        def one_transfer() -> None:
            if calls[0] == 0:
                dst.map[:cell.transfer_bytes] = src.map[:cell.transfer_bytes]
            calls[0] += 1

        return one_transfer, lambda: None

    record = run_cell("stand-in", "memory", Cell(4096, 4), src, dst, 1, prepare)
    assert record["verified"] is False and str(record["error"]).startswith("after the timed transfers: destination differs")


def test_a_failed_transfer_fails_the_cell_with_its_reason() -> None:
    src, dst = Pool(1 << 16), Pool(1 << 16)

    def prepare(cell: Cell) -> PreparedCell:
        def one_transfer() -> None:
            raise TransferFailed("peer gone")
        return one_transfer, lambda: None

    record = run_cell("stand-in", "memory", Cell(4096, 1), src, dst, 1, prepare)
    assert record == cell_record("stand-in", "memory", Cell(4096, 1), error="TransferFailed: peer gone")


# --- the runners, for real ---------------------------------------------------------------------------------

def run_peer(venv: Path, peer: str, *extra: str) -> tuple[int, list[dict[str, object]], str]:
    done = subprocess.run([str(HERE / "run.sh"), str(venv), peer, "--cells", TINY_CELLS, "--cell-ms", str(TINY_CELL_MS), *extra],
                          capture_output=True, text=True, timeout=RUNNER_WAIT_S)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()], done.stderr


def assert_shape(records: list[dict[str, object]], peer: str, transport: str) -> None:
    assert [(r["block_bytes"], r["blocks"]) for r in records] == [(c.block_bytes, c.blocks) for c in parse_cells(TINY_CELLS)]
    for r in records:
        assert set(r) == set(SCHEMA), r
        for key, kind in SCHEMA.items():
            assert isinstance(r[key], kind), (key, r)
        assert r["peer"] == peer and r["transport"] == transport


def need_venv() -> None:
    if not (VENV / "kvgate-peer-pins.txt").is_file():
        pytest.skip(f"no complete peer environment at {VENV}: make it with bench/peers/setup.sh {VENV} "
                    f"(or point KVGATE_PEERS_VENV at one)")


def need_private_network_namespace() -> None:
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a private network namespace here (unshare -n needs root or CAP_SYS_ADMIN); "
                    "Mooncake's listeners would bind every interface")


def test_run_sh_reports_every_cell_when_the_environment_is_missing(tmp_path: Path) -> None:
    rc, records, stderr = run_peer(tmp_path / "no-venv", "nixl")
    assert rc == 1, stderr
    assert_shape(records, "nixl", "ucx")
    assert all(r["error"] and "no complete peer environment" in str(r["error"]) and r["gbps"] == 0.0 for r in records)


@pytest.mark.parametrize("peer,transport", [("nixl", "ucx"), ("nixl", "tcp"), ("mooncake", "tcp")])
def test_runner_moves_verified_bytes(peer: str, transport: str) -> None:
    need_venv()
    if peer == "mooncake":
        need_private_network_namespace()
    rc, records, stderr = run_peer(VENV, peer, "--transport", transport)
    assert_shape(records, peer, transport)
    for r in records:
        assert r["error"] is None and r["verified"] is True, (r, stderr[-4000:])
        assert isinstance(r["transfers"], int) and r["transfers"] >= MIN_TIMED_TRANSFERS
        assert isinstance(r["gbps"], float) and r["gbps"] > 0
        assert 0 < float(r["p50_ms"]) <= float(r["p99_ms"])  # type: ignore[arg-type]
    assert rc == 0, stderr[-4000:]


@pytest.mark.parametrize("peer", ["nixl", "mooncake"])
def test_runner_fails_a_cell_whose_destination_is_wrong(peer: str) -> None:
    need_venv()
    if peer == "mooncake":
        need_private_network_namespace()
    rc, records, stderr = run_peer(VENV, peer, "--flip-destination-byte")
    assert rc == 1, stderr[-4000:]
    assert_shape(records, peer, "tcp" if peer == "mooncake" else "ucx")
    for r in records:
        assert r["verified"] is False and r["gbps"] == 0.0
        assert str(r["error"]).startswith("after the timed transfers: destination differs from source at byte"), r


def test_runner_reports_an_unknown_transport_per_cell() -> None:
    need_venv()
    rc, records, _ = run_peer(VENV, "nixl", "--transport", "rdma")
    assert rc == 1
    assert_shape(records, "nixl", "rdma")
    assert all("transport 'rdma' not supported" in str(r["error"]) for r in records)
