"""What the peer runners (nixl_bench.py, mooncake_bench.py) share: the cell list, the pools, the
cell procedure (verified warm-up, poisoned destination, timed transfers one at a time, verification
outside the timed window) and the one-JSON-object-per-cell output. Imports nothing outside the
standard library, and never talks to NIXL or Mooncake itself: a runner hands it one transfer call.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, TextIO, Union

DEFAULT_CELLS = "4K:1,64K:100,4M:1,64M:1"
DEFAULT_CELL_MS = 1000
# Every cell runs at least this many timed transfers, however long they take.
MIN_TIMED_TRANSFERS = 5
# And at most this many, however short they are (bounds the latency list of the 4 KiB cell).
MAX_TIMED_TRANSFERS_PER_CELL = 1_000_000
DEFAULT_TRANSFER_TIMEOUT_MS = 60_000
DEFAULT_SETUP_TIMEOUT_MS = 60_000
# Pool slices start on this boundary, as an engine's KV blocks would.
POOL_ALIGN_BYTES = 4096

SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
              "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def log(msg: str) -> None:
    print(f"[{os.path.basename(sys.argv[0])} {os.getpid()}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Cell:
    block_bytes: int
    blocks: int

    @property
    def transfer_bytes(self) -> int:
        return self.block_bytes * self.blocks


def parse_size(text: str) -> int:
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in SIZE_UNITS:
        raise ValueError(f"bad size {text!r} (examples: 4096, 4K, 64M)")
    return int(digits) * SIZE_UNITS[unit]


def parse_cells(text: str) -> list[Cell]:
    """`4K:1,64K:100` -> [Cell(4096, 1), Cell(65536, 100)]; block and count must be positive."""
    cells = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        block, sep, count = item.partition(":")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"bad cell {item!r} (expected BLOCK:BLOCKS, e.g. 64K:100)")
        cell = Cell(parse_size(block), int(count))
        if cell.block_bytes <= 0 or cell.blocks <= 0:
            raise ValueError(f"bad cell {item!r}: block and blocks must be positive")
        cells.append(cell)
    if not cells:
        raise ValueError("no cells given")
    return cells


def percentile_ms(latencies_ns: list[int], p: float) -> float:
    """Nearest-rank percentile, as kvgate's own bench computes it; 0 when empty."""
    if not latencies_ns:
        return 0.0
    ordered = sorted(latencies_ns)
    rank = math.ceil(p / 100.0 * len(ordered))
    return ordered[min(max(rank, 1), len(ordered)) - 1] / 1e6


def common_arguments(peer: str, transports: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=f"{peer}: kvgate's data-path cells through {peer}, one JSON object per cell on stdout")
    parser.add_argument("--cells", default=DEFAULT_CELLS, help=f"BLOCK:BLOCKS,... (default {DEFAULT_CELLS})")
    parser.add_argument("--cell-ms", type=int, default=DEFAULT_CELL_MS,
                        help=f"each cell's timed transfers run at least this long (and at least "
                             f"{MIN_TIMED_TRANSFERS} transfers); default {DEFAULT_CELL_MS}")
    parser.add_argument("--transport", default=transports[0], help=f"one of {', '.join(transports)}")
    parser.add_argument("--transfer-timeout-ms", type=int, default=DEFAULT_TRANSFER_TIMEOUT_MS,
                        help="one transfer that has not completed after this long fails its cell")
    parser.add_argument("--setup-timeout-ms", type=int, default=DEFAULT_SETUP_TIMEOUT_MS,
                        help="how long the target process may take to come up")
    parser.add_argument("--flip-destination-byte", action="store_true",
                        help="check of the verification itself: flip one destination byte after the "
                             "timed transfers; every cell must then report verified false")
    parser.add_argument("--report-unavailable", metavar="REASON",
                        help="run nothing: report every cell with this error (run.sh, when the peer cannot run)")
    return parser


@dataclass
class Runner:
    """A runner's parsed command line, its cells and its JSON output, and how it fails them all."""
    args: argparse.Namespace
    cells: list[Cell]
    out: TextIO
    peer: str

    @property
    def transport(self) -> str:
        return str(self.args.transport)

    def fail_all(self, reason: str) -> int:
        """Every cell reported with `reason` as its error; the runner's exit code."""
        log(f"error: {reason}")
        for cell in self.cells:
            emit(self.out, cell_record(self.peer, self.transport, cell, error=reason))
        return 1

    def refusal(self, transports: list[str]) -> Optional[str]:
        """Why nothing may run: `--report-unavailable`, or a transport this runner lacks."""
        if self.args.report_unavailable:
            return str(self.args.report_unavailable)
        if self.transport not in transports:
            return f"transport {self.transport!r} not supported by this runner (one of {', '.join(transports)})"
        return None


def start_runner(parser: argparse.ArgumentParser, peer: str) -> Runner:
    """Parse the command line (a bad `--cells` exits 2 with the reason) and open the JSON output."""
    args = parser.parse_args()
    try:
        cells = parse_cells(args.cells)
    except ValueError as e:
        parser.error(str(e))
    return Runner(args, cells, json_stdout(), peer)


def json_stdout() -> TextIO:
    """The real stdout, for the JSON lines only; fd 1 then points at stderr, so that whatever the
    native libraries print cannot land between the JSON lines."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def cell_record(peer: str, transport: str, cell: Cell, *, transfers: int = 0, gbps: float = 0.0,
                p50_ms: float = 0.0, p99_ms: float = 0.0, verified: bool = False,
                error: Optional[str] = None) -> dict[str, object]:
    """One output object. A cell with an error reports 0 GB/s: its transfers prove nothing."""
    return {"peer": peer, "transport": transport, "block_bytes": cell.block_bytes, "blocks": cell.blocks,
            "transfers": transfers, "gbps": 0.0 if error is not None else gbps, "p50_ms": p50_ms,
            "p99_ms": p99_ms, "verified": verified and error is None, "error": error}


def emit(out: TextIO, record: dict[str, object]) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


class Pool:
    """An anonymous shared mapping made before the target process forks, so that the process that
    drives the bench sees the target's destination bytes without a transfer of its own. Its address
    is the same in both processes."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = max(POOL_ALIGN_BYTES, -(-size_bytes // POOL_ALIGN_BYTES) * POOL_ALIGN_BYTES)
        self.map = mmap.mmap(-1, self.size_bytes, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        # Touch every page now, so that no timed transfer pays for first faults.
        self.map[:] = bytes(self.size_bytes)


def fill_random(pool: Pool, length: int, seed: int) -> None:
    pool.map[:length] = random.Random(seed).randbytes(length)


COMPLEMENT_TABLE = bytes(255 - i for i in range(256))


def poison(src: Pool, dst: Pool, length: int) -> None:
    """Write the complement of the source into the destination: no earlier copy passes for new bytes."""
    dst.map[:length] = src.map[:length].translate(COMPLEMENT_TABLE)


Buffer = Union[bytes, bytearray, memoryview, mmap.mmap]


def first_difference(src: Buffer, dst: Buffer, length: int) -> Optional[int]:
    """The first offset below `length` where the destination differs from the source; None when
    the two agree over the whole length (or a buffer is shorter than `length`: offset of its end)."""
    if len(src) < length or len(dst) < length:
        return min(len(src), len(dst))
    a, b = memoryview(src)[:length], memoryview(dst)[:length]
    if bytes(a) == bytes(b):
        return None
    lo, hi = 0, length  # the first difference lies in [lo, hi)
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        if bytes(a[lo:mid]) != bytes(b[lo:mid]):
            hi = mid
        else:
            lo = mid
    return next(i for i in range(lo, hi) if a[i] != b[i])


def verify(src: Pool, dst: Pool, length: int) -> Optional[str]:
    """None when the destination holds the source's first `length` bytes, else why not."""
    offset = first_difference(src.map, dst.map, length)
    if offset is None:
        return None
    return f"destination differs from source at byte {offset} of {length}"


class TransferFailed(Exception):
    """One transfer ended in an error, or did not complete within its timeout."""


# A prepared cell: one call runs one transfer of the cell's bytes (returns when it is complete,
# raises TransferFailed otherwise); the second releases what preparing took.
PreparedCell = tuple[Callable[[], None], Callable[[], None]]


def run_cell(peer: str, transport: str, cell: Cell, src: Pool, dst: Pool, cell_ms: int,
             prepare: Callable[[Cell], PreparedCell], flip_destination_byte: bool = False,
             seed: int = 0) -> dict[str, object]:
    """One cell: a warm-up transfer into a zeroed destination, compared with the source; the
    destination poisoned; timed transfers one after the other for at least `cell_ms` (and at least
    MIN_TIMED_TRANSFERS); then, outside the timed window, the destination compared again."""
    length = cell.transfer_bytes
    if length > src.size_bytes or length > dst.size_bytes:
        return cell_record(peer, transport, cell, error=f"cell needs {length} bytes, pools hold {src.size_bytes}")
    fill_random(src, length, seed)
    try:
        one_transfer, release = prepare(cell)
    except Exception as e:  # the library's own exception types vary; its message is the reason
        return cell_record(peer, transport, cell, error=f"prepare failed: {e}")
    try:
        dst.map[:length] = bytes(length)
        one_transfer()
        mismatch = verify(src, dst, length)
        if mismatch is not None:
            return cell_record(peer, transport, cell, error=f"warm-up transfer: {mismatch}")
        poison(src, dst, length)
        latencies_ns: list[int] = []
        budget_ns = cell_ms * 1_000_000
        started = time.perf_counter_ns()
        now = started
        while len(latencies_ns) < MAX_TIMED_TRANSFERS_PER_CELL and (
                len(latencies_ns) < MIN_TIMED_TRANSFERS or now - started < budget_ns):
            t0 = time.perf_counter_ns()
            one_transfer()
            now = time.perf_counter_ns()
            latencies_ns.append(now - t0)
        wall_ns = now - started
    except Exception as e:  # TransferFailed, or the library's own exception: its message is the reason
        return cell_record(peer, transport, cell, error=f"{type(e).__name__}: {e}")
    finally:
        release()
    if flip_destination_byte:
        dst.map[length // 2] ^= 0xFF
    mismatch = verify(src, dst, length)
    transfers = len(latencies_ns)
    log(f"cell {cell.block_bytes}x{cell.blocks}: wall {wall_ns / 1e6:.1f} ms, transfers' own time "
        f"{sum(latencies_ns) / 1e6:.1f} ms, slowest {max(latencies_ns) / 1e6:.3f} ms")
    return cell_record(peer, transport, cell, transfers=transfers, gbps=length * transfers / wall_ns,
                       p50_ms=percentile_ms(latencies_ns, 50), p99_ms=percentile_ms(latencies_ns, 99),
                       verified=mismatch is None,
                       error=None if mismatch is None else f"after the timed transfers: {mismatch}")


def wait_deadline(timeout_ms: int) -> Callable[[], bool]:
    """A function that says whether `timeout_ms` has passed since this call."""
    deadline = time.monotonic() + timeout_ms / 1000
    return lambda: time.monotonic() >= deadline


# How long a runner waits for its target process to stop before it kills it.
TARGET_STOP_WAIT_S = 10.0


class Initiator(Protocol):
    """The initiating side of a runner: prepares one cell's transfer call, and lets go at the end."""

    def prepare(self, cell: Cell) -> PreparedCell: ...

    def close(self) -> None: ...


def drive_cells(peer: str, transport: str, cells: list[Cell], src: Pool, dst: Pool, args: argparse.Namespace,
                out: TextIO, target: Any, conn: Any, make_initiator: Callable[[Any], Initiator],
                side: str, fail_all: Callable[[str], int]) -> int:
    """Wait for the forked `target` to say it is ready over `conn` (its payload is what the initiator
    needs to reach it), run every cell through the initiator `make_initiator(payload)` builds, one
    JSON object each, and stop the target (killed after TARGET_STOP_WAIT_S). Returns the exit code:
    1 when a cell has an error. `side` names the library's objects in messages (`agent`, `engine`)."""
    initiator: Optional[Initiator] = None
    failed = 0
    try:
        if not conn.poll(args.setup_timeout_ms / 1000):
            return fail_all(f"target {side} not up after {args.setup_timeout_ms} ms (setup_timeout_ms)")
        kind, payload = conn.recv()
        if kind != "ready":
            return fail_all(payload)
        try:
            initiator = make_initiator(payload)
        except Exception as e:  # the library's own exception types vary; its message is the reason
            return fail_all(f"initiator {side}: {type(e).__name__}: {e}")
        for index, cell in enumerate(cells):
            record = run_cell(peer, transport, cell, src, dst, args.cell_ms, initiator.prepare,
                              args.flip_destination_byte, seed=index + 1)
            emit(out, record)
            failed += record["error"] is not None
            log(f"cell {cell.block_bytes}x{cell.blocks}: {record['transfers']} transfers, "
                f"{record['gbps']:.3f} GB/s, p50 {record['p50_ms']:.4f} ms, error {record['error']}")
    finally:
        if initiator is not None:
            initiator.close()
        try:
            conn.send("stop")
        except OSError:
            pass
        target.join(TARGET_STOP_WAIT_S)
        if target.is_alive():
            log(f"target did not stop within {TARGET_STOP_WAIT_S} s; killing it")
            target.kill()
            target.join()
        if target.exitcode not in (0, None):
            log(f"target exited with {target.exitcode}")
    return 1 if failed else 0
