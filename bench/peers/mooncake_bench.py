#!/usr/bin/env python3
"""kvgate's data-path cells through Mooncake's Transfer Engine (classic engine, TCP transport, P2P
handshake, no metadata server), DRAM to DRAM between two engines in two processes on this host: the
initiator WRITEs `blocks` adjacent slices of `block` bytes from its source pool into the target's
destination pool as one batch (`batch_transfer_sync_write`), one batch in flight, and prints one JSON
object per cell on stdout. Mooncake's listeners bind every interface, so this runner refuses to start
outside a private network namespace that has only loopback (run.sh makes one with `unshare -n`).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peer_common import (  # noqa: E402
    drive_cells, start_runner,
    Cell, Pool, PreparedCell, TransferFailed, common_arguments, log,
)

PEER = "mooncake"
TRANSPORTS = ["tcp"]
LOOPBACK_HOST = "127.0.0.1"
# No metadata server: engines exchange segment descriptors over their handshake port.
METADATA_MODE = "P2PHANDSHAKE"
MEMORY_LOCATION = "cpu:0"


def network_interfaces() -> list[str]:
    """The interfaces of this process's network namespace (/proc/net follows the namespace; /sys does not)."""
    with open("/proc/self/net/dev") as f:
        return [line.split(":", 1)[0].strip() for line in f.readlines()[2:] if ":" in line]


def new_engine(transport: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(LOOPBACK_HOST, METADATA_MODE, transport, "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize({LOOPBACK_HOST!r}, {METADATA_MODE!r}, {transport!r}) returned {rc}")
    return engine


def register(engine: Any, pool: Pool) -> None:
    rc = engine.register_memory(pool.address, pool.size_bytes, MEMORY_LOCATION)
    if rc != 0:
        raise RuntimeError(f"register_memory of {pool.size_bytes} bytes returned {rc}")


def target_main(conn: Connection, transport: str, dst: Pool) -> None:
    """The target process: registers the destination pool, hands its segment name to the initiator,
    then serves until told to stop (or the initiator is gone)."""
    try:
        engine = new_engine(transport)
        register(engine, dst)
        conn.send(("ready", f"{LOOPBACK_HOST}:{engine.get_rpc_port()}"))
    except Exception as e:
        conn.send(("error", f"target engine: {type(e).__name__}: {e}"))
        return
    try:
        conn.recv()
    except EOFError:
        pass
    engine.unregister_memory(dst.address)


class Initiator:
    def __init__(self, transport: str, src: Pool, dst: Pool, target_segment: str) -> None:
        self.engine = new_engine(transport)
        register(self.engine, src)
        self.src, self.dst, self.target_segment = src, dst, target_segment

    def prepare(self, cell: Cell) -> PreparedCell:
        """The batch's address lists built once; every transfer submits them as one synchronous batch.
        The engine's own end-to-end timeout (MC_TRANSFER_TIMEOUT, set by run.sh from
        --transfer-timeout-ms) bounds each call."""
        engine, segment, n, block = self.engine, self.target_segment, cell.blocks, cell.block_bytes
        sources = [self.src.address + i * block for i in range(n)]
        destinations = [self.dst.address + i * block for i in range(n)]
        lengths = [block] * n

        def one_transfer() -> None:
            rc = engine.batch_transfer_sync_write(segment, sources, destinations, lengths)
            if rc != 0:
                raise TransferFailed(f"batch_transfer_sync_write returned {rc} (the reason is in the engine's log on stderr)")

        return one_transfer, lambda: None

    def close(self) -> None:
        self.engine.unregister_memory(self.src.address)


def main() -> int:
    parser = common_arguments(PEER, TRANSPORTS)
    parser.add_argument("--allow-host-network", action="store_true",
                        help="run even where interfaces other than loopback exist (the engines then listen on them)")
    runner = start_runner(parser, PEER)
    args, cells, out, transport, fail_all = runner.args, runner.cells, runner.out, runner.transport, runner.fail_all
    refused = runner.refusal(TRANSPORTS)
    if refused is not None:
        return fail_all(refused)
    others = [name for name in network_interfaces() if name != "lo"]
    if others and not args.allow_host_network:
        return fail_all(f"not in a private network namespace (interfaces {', '.join(others)}): Mooncake's listeners "
                        f"bind every interface; run through run.sh (unshare -n) or pass --allow-host-network")
    # The Python wrapper's own bound on one synchronous call, in seconds (it takes no less than 5).
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, -(-args.transfer_timeout_ms // 1000))))
    pool_bytes = max(c.transfer_bytes for c in cells)
    src, dst = Pool(pool_bytes), Pool(pool_bytes)
    # The target forks before either process loads the engine.
    ctx = multiprocessing.get_context("fork")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(child_conn, transport, dst), daemon=True)
    target.start()
    def make_initiator(payload: Any) -> Initiator:
        initiator = Initiator(transport, src, dst, payload)
        log(f"engines up, transport {transport}, target segment {payload}, pools {pool_bytes} bytes")
        return initiator

    return drive_cells(PEER, transport, cells, src, dst, args, out, target, conn, make_initiator, "engine", fail_all)


if __name__ == "__main__":
    sys.exit(main())
