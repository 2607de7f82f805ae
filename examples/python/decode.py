#!/usr/bin/env python3
"""A decode engine (asyncio): a KV pool in shared memory registered with its gateway, then `--rooms`
requests whose KV cache it expects from the prefill engine, `--slots` at a time; each room's bytes are
checked against what the prefill engine wrote. Start it next to `prefill.py`:

    kvgate keygen psk configs/shm-one-host/peer.key             # once: the gateways' peer-link key
    kvgate serve --config configs/shm-one-host/decode.toml      # terminal 1
    kvgate serve --config configs/shm-one-host/prefill.toml     # terminal 2
    python examples/python/decode.py                            # terminal 3
    python examples/python/prefill.py                           # terminal 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvgate  # noqa: E402
from kvgate.aio import AsyncClient  # noqa: E402
from kvlayout import DEFAULT_RENDEZVOUS, KvShape, Progress, announce, await_announcement, checksum, connect_error, pattern, results_line, shape_dict  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", default="/tmp/kvgate/decode-0.sock", help="the decode gateway's engine socket (or host:port)")
    p.add_argument("--token-file", default=None, help="bearer token file, for a TCP engine API")
    p.add_argument("--peer", default="prefill-0", help="the prefill gateway's name")
    p.add_argument("--rooms", type=int, default=64)
    p.add_argument("--slots", type=int, default=8, help="rooms in flight at once (slots of the pool)")
    p.add_argument("--layers", type=int, default=KvShape.layers)
    p.add_argument("--tokens", type=int, default=KvShape.tokens)
    p.add_argument("--token-bytes", type=int, default=KvShape.token_bytes)
    p.add_argument("--parts", type=int, default=KvShape.parts)
    p.add_argument("--chunks", type=int, default=KvShape.chunks)
    p.add_argument("--memfd", action="store_true", help="a memfd pool instead of a /dev/shm file")
    p.add_argument("--rendezvous", default=DEFAULT_RENDEZVOUS, help="file through which the two engines agree on room ids")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the prefill engine")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line on stdout")
    return p.parse_args()


async def run(args: argparse.Namespace) -> int:
    shape = KvShape(args.layers, args.tokens, args.token_bytes, args.parts, args.chunks)
    size = shape.request_bytes
    async with AsyncClient(args.socket, token_file=args.token_file) as client:
        try:
            await client.wait_ready(timeout=5)
        except kvgate.GatewayUnavailable as e:
            raise connect_error("decode", args.socket, e) from None
        with kvgate.SharedPool(args.slots * size, memfd=args.memfd, name="kvgate-decode-example") as pool:
            region = await client.register_pool(pool, label="decode example pool")
            first_room = time.time_ns() // 1000
            started_at = time.time()
            announce(args.rendezvous, {"pid": os.getpid(), "at": started_at, "first_room": first_room, "rooms": args.rooms, "slots": args.slots, "shape": shape_dict(shape)})
            await asyncio.to_thread(await_announcement, args.rendezvous + ".prefill", "the prefill engine", args.wait, started_at)

            free: asyncio.Queue[int] = asyncio.Queue()
            for slot in range(args.slots):
                free.put_nowait(slot)
            progress = Progress(args.rooms, "decode")
            results = {"ok": 0, "failed": 0, "corrupt": 0}
            reasons: dict[str, int] = {}
            checksums: dict[str, str] = {}

            async def one_room(room: int, slot: int) -> None:
                view = pool.numpy()[slot * size : (slot + 1) * size]
                view[:] = 0  # a transfer that did not happen cannot pass the check
                parts = [shape.part_slices(region, slot * size, p) for p in range(shape.parts)]
                ok = False
                try:
                    handle = await client.expect(room, args.peer, parts)
                    outcome = await handle.terminal(timeout=120)
                    if outcome.succeeded:
                        if np.array_equal(view, pattern(room, size)):
                            ok = True
                            checksums[str(room)] = checksum(view)
                        else:
                            results["corrupt"] += 1
                    else:
                        reasons[outcome.reason] = reasons.get(outcome.reason, 0) + 1
                    await handle.reusable(timeout=120)
                except kvgate.KvgateError as e:
                    reasons[e.code] = reasons.get(e.code, 0) + 1
                except TimeoutError:
                    reasons["no_outcome"] = reasons.get("no_outcome", 0) + 1
                results["ok" if ok else "failed"] += 1
                progress.update(ok)
                free.put_nowait(slot)

            t0 = time.monotonic()
            tasks = []
            for i in range(args.rooms):
                slot = await free.get()
                tasks.append(asyncio.create_task(one_room(first_room + i, slot)))
            await asyncio.gather(*tasks)
            seconds = time.monotonic() - t0
            progress.close()
            await client.unregister_memory(region)

    failed = results["failed"] - results["corrupt"]
    print(results_line("decode", args.rooms, results["ok"], failed, results["corrupt"], results["ok"] * size, seconds) + (f" (reasons: {reasons})" if reasons else ""))
    if args.json:
        print(json.dumps({"role": "decode", "rooms": args.rooms, **results, "reasons": reasons, "bytes": results["ok"] * size, "seconds": seconds, "checksums": checksums}))
    return 0 if results["ok"] == args.rooms else 1


def main() -> int:
    return asyncio.run(run(parse_args()))


if __name__ == "__main__":
    sys.exit(main())
