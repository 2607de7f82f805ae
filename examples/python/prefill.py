#!/usr/bin/env python3
"""A prefill engine (blocking client): a KV pool in shared memory registered with its gateway; for each
room the decode engine announced, it writes the room's KV cache into a free slot and hands it over in
chunks (every part's chunk 0, then chunk 1, ...), `slots` rooms at a time; a slot is reused once its
room is terminal and its memory reusable. Start `decode.py` too (see its help); either may go first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvgate  # noqa: E402
from kvlayout import DEFAULT_RENDEZVOUS, Progress, announce, await_announcement, checksum, connect_error, pattern, results_line, shape_of  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", default="/tmp/kvgate/prefill-0.sock", help="the prefill gateway's engine socket (or host:port)")
    p.add_argument("--token-file", default=None, help="bearer token file, for a TCP engine API")
    p.add_argument("--peer", default="decode-0", help="the decode gateway's name")
    p.add_argument("--memfd", action="store_true", help="a memfd pool instead of a /dev/shm file")
    p.add_argument("--rendezvous", default=DEFAULT_RENDEZVOUS, help="file through which the two engines agree on room ids")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the decode engine")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line on stdout")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    with kvgate.Client(args.socket, token_file=args.token_file) as client:
        try:
            client.wait_ready(timeout=5)
        except kvgate.GatewayUnavailable as e:
            raise connect_error("prefill", args.socket, e) from None
        return run(args, client)


def run(args: argparse.Namespace, client: kvgate.Client) -> int:
    announced = await_announcement(args.rendezvous, "the decode engine", args.wait)
    shape = shape_of(announced)
    size = shape.request_bytes
    rooms, slots, first_room = int(announced["rooms"]), int(announced["slots"]), int(announced["first_room"])
    with kvgate.SharedPool(slots * size, memfd=args.memfd, name="kvgate-prefill-example") as pool:
        region = client.register_pool(pool, label="prefill example pool")
        announce(args.rendezvous + ".prefill", {"pid": os.getpid(), "at": time.time(), "first_room": first_room})
        progress = Progress(rooms, "prefill")
        ok = failed = 0
        reasons: dict[str, int] = {}
        checksums: dict[str, str] = {}
        in_flight: deque[tuple[kvgate.RoomHandle | None, int]] = deque()
        free = list(range(slots))

        def finish_oldest() -> None:
            nonlocal ok, failed
            handle, slot = in_flight.popleft()
            success = False
            if handle is not None:
                try:
                    outcome = handle.terminal(timeout=120)
                    success = outcome.succeeded
                    if not success:
                        reasons[outcome.reason] = reasons.get(outcome.reason, 0) + 1
                    handle.reusable(timeout=120)
                except TimeoutError:
                    reasons["no_outcome"] = reasons.get("no_outcome", 0) + 1
            ok += success
            failed += not success
            progress.update(success)
            free.append(slot)

        t0 = time.monotonic()
        for i in range(rooms):
            if not free:
                finish_oldest()
            slot = free.pop()
            room = first_room + i
            view = pool.numpy()[slot * size : (slot + 1) * size]
            view[:] = pattern(room, size)
            checksums[str(room)] = checksum(view)
            try:
                handle: kvgate.RoomHandle | None = client.send_chunks(room, shape.chunks_of(region, slot * size), peer=args.peer)
            except kvgate.KvgateError as e:
                reasons[e.code] = reasons.get(e.code, 0) + 1
                handle = None
            in_flight.append((handle, slot))
        while in_flight:
            finish_oldest()
        seconds = time.monotonic() - t0
        progress.close()
        client.unregister_memory(region)

    print(results_line("prefill", rooms, ok, failed, 0, ok * size, seconds) + (f" (reasons: {reasons})" if reasons else ""))
    if args.json:
        print(json.dumps({"role": "prefill", "rooms": rooms, "ok": ok, "failed": failed, "reasons": reasons, "bytes": ok * size, "seconds": seconds, "checksums": checksums}))
    return 0 if ok == rooms else 1


if __name__ == "__main__":
    sys.exit(main())
