#!/usr/bin/env python3
"""kvgate's data-path cells through NVIDIA NIXL (UCX backend), DRAM to DRAM between two agents in two
processes on this host: the initiator WRITEs `blocks` adjacent slices of `block` bytes from its source
pool into the target's destination pool, one transfer in flight, and prints one JSON object per cell
on stdout. Run it through run.sh, which picks the virtual environment and sets UCX's environment.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peer_common import (  # noqa: E402
    drive_cells, start_runner,
    Cell, Pool, PreparedCell, TransferFailed, common_arguments, log,
)

PEER = "nixl"
# `ucx`: UCX's own choice of transports (on one host: cma for the copy, tcp for active messages).
TRANSPORT_ENVIRONMENT = {"ucx": {}, "tcp": {"UCX_TLS": "tcp"}}
TARGET_AGENT = "kvgate-peer-target"
INITIATOR_AGENT = "kvgate-peer-initiator"


def import_nixl() -> Any:
    try:
        import nixl_cu12 as nixl
    except ImportError:
        import nixl._api as nixl
    return nixl


def new_agent(nixl: Any, name: str) -> Any:
    # The progress thread makes the target's side progress without the target polling (over TCP the
    # bytes are not delivered otherwise).
    return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))


def target_main(conn: Connection, dst_address: int, dst_size: int) -> None:
    """The target process: registers the destination pool, hands its metadata to the initiator, then
    waits until told to stop (or the initiator is gone)."""
    try:
        nixl = import_nixl()
        agent = new_agent(nixl, TARGET_AGENT)
        if "UCX" not in agent.backends:
            raise RuntimeError(f"no UCX backend (plugins found: {agent.get_plugin_list()})")
        registered = agent.register_memory([(dst_address, dst_size, 0, "dst")], "DRAM")
        conn.send(("ready", agent.get_agent_metadata()))
    except Exception as e:
        conn.send(("error", f"target agent: {type(e).__name__}: {e}"))
        return
    try:
        conn.recv()
    except EOFError:
        pass
    agent.deregister_memory(registered)


class Initiator:
    def __init__(self, nixl: Any, src: Pool, dst: Pool, target_metadata: bytes, transfer_timeout_ms: int) -> None:
        self.agent = new_agent(nixl, INITIATOR_AGENT)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"no UCX backend (plugins found: {self.agent.get_plugin_list()})")
        self.src, self.dst = src, dst
        self.registered = self.agent.register_memory([(src.address, src.size_bytes, 0, "src")], "DRAM")
        self.remote = self.agent.add_remote_agent(target_metadata)
        self.transfer_timeout_ns = transfer_timeout_ms * 1_000_000

    def prepare(self, cell: Cell) -> PreparedCell:
        """Both descriptor lists prepared once and one WRITE request made; every transfer reposts it."""
        agent, n, block = self.agent, cell.blocks, cell.block_bytes
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.src.address + i * block, block, 0) for i in range(n)], "DRAM")
        remote = agent.prep_xfer_dlist(self.remote, [(self.dst.address + i * block, block, 0) for i in range(n)], "DRAM")
        handle = agent.make_prepped_xfer("WRITE", local, list(range(n)), remote, list(range(n)))
        timeout_ns = self.transfer_timeout_ns

        def one_transfer() -> None:
            deadline = time.perf_counter_ns() + timeout_ns
            state = agent.transfer(handle)
            while state == "PROC":
                if time.perf_counter_ns() > deadline:
                    raise TransferFailed(f"transfer not complete after {timeout_ns // 1_000_000} ms (transfer_timeout_ms)")
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailed(f"NIXL reported {state} for the WRITE")

        def release() -> None:
            agent.release_xfer_handle(handle)
            agent.release_dlist_handle(local)
            agent.release_dlist_handle(remote)

        return one_transfer, release

    def close(self) -> None:
        self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self.registered)


def main() -> int:
    parser = common_arguments(PEER, list(TRANSPORT_ENVIRONMENT))
    runner = start_runner(parser, PEER)
    args, cells, out, transport, fail_all = runner.args, runner.cells, runner.out, runner.transport, runner.fail_all
    refused = runner.refusal(list(TRANSPORT_ENVIRONMENT))
    if refused is not None:
        return fail_all(refused)
    os.environ.update(TRANSPORT_ENVIRONMENT[transport])
    # UCX's InfiniBand module, loaded on a host without InfiniBand, crashes the process at exit.
    os.environ.setdefault("UCX_MODULES", "^ib")
    pool_bytes = max(c.transfer_bytes for c in cells)
    src, dst = Pool(pool_bytes), Pool(pool_bytes)
    # The target forks before either process loads NIXL or UCX.
    ctx = multiprocessing.get_context("fork")
    conn, child_conn = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(child_conn, dst.address, dst.size_bytes), daemon=True)
    target.start()
    def make_initiator(payload: Any) -> Initiator:
        initiator = Initiator(import_nixl(), src, dst, payload, args.transfer_timeout_ms)
        log(f"agents up, transport {transport} (UCX_TLS={os.environ.get('UCX_TLS', 'default')}), pools {pool_bytes} bytes")
        return initiator

    return drive_cells(PEER, transport, cells, src, dst, args, out, target, conn, make_initiator, "agent", fail_all)


if __name__ == "__main__":
    sys.exit(main())
