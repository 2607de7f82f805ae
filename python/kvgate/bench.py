"""Per-call overhead of the Python client, blocking and asyncio, beside the raw gRPC round trip of the
same call on the same channel, against running gateways:

    python -m kvgate.bench --socket /tmp/kvgate/decode-0.sock
    python -m kvgate.bench --prefill /tmp/kvgate/prefill-0.sock --decode /tmp/kvgate/decode-0.sock \\
        --prefill-name prefill-0 --decode-name decode-0          # + minimal rooms through both

Figures: `ListRooms` of an idle gateway (the cheapest call that reaches the gateway's driver) through
raw gRPC (no message encoding), the blocking `Client`, and `AsyncClient` one at a time and
`--concurrency` at once; a refused call (`GetRoom` of an unknown room: the error path, exception
included); with two gateways, minimal rooms (8 bytes: `Expect` + `Send` + both outcomes through the
Watch streams) one at a time (blocking) and `--concurrency` at once (asyncio). Where the gateway
has its engine fast lane (`<socket>.lane`), the blocking figures are also taken with `Client(lane=True)`,
in the same rounds. Each figure is the median of 5 rounds. Measures only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable

import grpc
import grpc.aio

from . import _channel, _lane
from .aio import AsyncClient
from .client import Client
from .errors import KvgateError
from .memory import SharedPool
from .rooms import AsyncRoomHandle

#: Bytes of a minimal room (the smallest slice the gateway accepts is 1 byte; 8 keeps it aligned).
MINIMAL_ROOM_BYTES = 8


@dataclass
class Figure:
    name: str
    calls: int
    seconds: float
    concurrency: int = 1

    @property
    def us_per_call(self) -> float:
        return self.seconds * 1e6 / max(self.calls, 1)

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else 0.0

    def row(self) -> str:
        per = f"{self.us_per_call:9.1f} us/call" if self.concurrency == 1 else f"{'':9} {self.concurrency:>2} at once"
        return f"{self.name:<58} {self.calls:>7} {per}  {self.calls_per_s:>9.0f} /s"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "us_per_call": self.us_per_call, "calls_per_s": self.calls_per_s}


#: Each figure is the median of this many rounds (a burst of other work on the machine moves one round).
ROUNDS = 5


def median_round(name: str, rounds: list[tuple[int, float]], concurrency: int = 1) -> Figure:
    """The round with the median time per call, and the calls of all rounds."""
    per_call = sorted(rounds, key=lambda r: r[1] / max(r[0], 1))
    calls, seconds = per_call[len(per_call) // 2]
    total = sum(c for c, _ in rounds)
    return Figure(name, total, seconds * total / max(calls, 1), concurrency)


def timed(named: list[tuple[str, Callable[[], object]]], calls: int, warmup: int = 20) -> list[Figure]:
    """Each function `calls` times in all, the functions taking turns round by round (so that a burst of
    other work on the machine falls on all of them alike); the median round of each."""
    for _, fn in named:
        for _ in range(min(warmup, calls)):
            fn()
    per_round = max(calls // ROUNDS, 1)
    rounds: list[list[tuple[int, float]]] = [[] for _ in named]
    for _ in range(ROUNDS):
        for i, (_, fn) in enumerate(named):
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            rounds[i].append((per_round, time.perf_counter() - t0))
    return [median_round(name, r) for (name, _), r in zip(named, rounds)]


async def timed_async(
    named: list[tuple[str, Callable[[], Awaitable[object]], int]], calls: int, warmup: int = 20
) -> list[Figure]:
    """As `timed`, for coroutines; each entry's third field is how many calls are in flight at once."""
    for _, fn, _ in named:
        for _ in range(min(warmup, calls)):
            await fn()
    rounds: list[list[tuple[int, float]]] = [[] for _ in named]
    for _ in range(ROUNDS):
        for i, (_, fn, concurrency) in enumerate(named):
            per_worker = max(calls // ROUNDS // concurrency, 1)

            async def worker(f: Callable[[], Awaitable[object]] = fn, n: int = per_worker) -> None:
                for _ in range(n):
                    await f()

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            rounds[i].append((per_worker * concurrency, time.perf_counter() - t0))
    return [median_round(name, r, concurrency) for (name, _, concurrency), r in zip(named, rounds)]


def has_lane(target: str | None) -> bool:
    """Whether the gateway at `target` has its engine fast lane (a Unix socket beside the engine socket)."""
    parsed = _channel.parse_target(target)
    return parsed.is_unix and os.path.exists(_lane.lane_path(parsed.unix_path))


def call_figures(target: str | None, token: str | None, calls: int, concurrency: int) -> list[Figure]:
    parsed = _channel.parse_target(target)
    metadata = _channel.call_metadata(token)
    out: list[Figure] = []
    list_rooms = _channel.METHOD["ListRooms"].path
    raw_request = b""  # ListRoomsRequest{} encodes to nothing

    channel = grpc.insecure_channel(parsed.grpc_target, options=_channel.channel_options(parsed))
    raw = channel.unary_unary(list_rooms, request_serializer=None, response_deserializer=None)
    with Client(target, token=token, session=False) as client:

        def refused() -> None:
            try:
                client.room((2**63, 0))
            except KvgateError:
                pass

        named: list[tuple[str, Callable[[], object]]] = [
            ("raw gRPC round trip, blocking (ListRooms, bytes in/out)", lambda: raw(raw_request, metadata=metadata)),
            ("kvgate.Client.rooms() (ListRooms)", client.rooms),
            ("kvgate.Client.room(unknown) -> RoomError (refused call)", refused),
        ]
        lane_client = Client(target, session=False, lane=True) if has_lane(target) else None
        if lane_client is not None:
            named.append(("kvgate.Client(lane=True).rooms() (ListRooms)", lane_client.rooms))
        out += timed(named, calls)
        if lane_client is not None:
            lane_client.close()
    channel.close()

    async def aio_figures() -> None:
        achannel = grpc.aio.insecure_channel(parsed.grpc_target, options=_channel.channel_options(parsed))
        araw = achannel.unary_unary(list_rooms, request_serializer=None, response_deserializer=None)

        async def raw_call() -> object:
            return await araw(raw_request, metadata=metadata)

        async with AsyncClient(target, token=token, session=False) as aclient:
            out.extend(
                await timed_async(
                    [
                        ("raw gRPC round trip, asyncio (ListRooms, bytes in/out)", raw_call, 1),
                        ("kvgate.AsyncClient.rooms() (ListRooms)", aclient.rooms, 1),
                        ("raw gRPC round trip, asyncio, concurrent", raw_call, concurrency),
                        ("kvgate.AsyncClient.rooms(), concurrent", aclient.rooms, concurrency),
                    ],
                    calls,
                )
            )
        await achannel.close(None)

    asyncio.run(aio_figures())
    return out


def room_figures(prefill: str, decode: str, prefill_name: str, decode_name: str, rooms: int, concurrency: int) -> list[Figure]:
    out: list[Figure] = []
    base = secrets.randbits(40) << 20
    slot_bytes = MINIMAL_ROOM_BYTES
    with SharedPool(slot_bytes * concurrency, name="kvgate-bench-p") as ppool, SharedPool(slot_bytes * concurrency, name="kvgate-bench-d") as dpool:
        counter = [0]
        transports = [False, True] if has_lane(prefill) and has_lane(decode) else [False]
        clients = [(Client(prefill, lane=lane), Client(decode, lane=lane)) for lane in transports]
        named: list[tuple[str, Callable[[], object]]] = []
        # The pools' first slot, registered by each transport's clients (a room at a time uses it).
        for lane, (p, d) in zip(transports, clients):
            pr, dr = p.register_pool(ppool, label="bench"), d.register_pool(dpool, label="bench")

            def one_room(p: Client = p, d: Client = d, pr: Any = pr, dr: Any = dr) -> None:
                room = base + counter[0]
                counter[0] += 1
                receiver = d.expect(room, prefill_name, [[dr.slice(0, slot_bytes)]])
                sender = p.send(room, 0, 0, [pr.slice(0, slot_bytes)], last=True, peer=decode_name)
                for h in (receiver, sender):
                    h.result(timeout=30)
                    h.reusable(timeout=30)

            on = " on the fast lane" if lane else ""
            named.append((f"minimal room, blocking{on}: expect + send + both outcomes", one_room))
        out += timed(named, rooms, warmup=5)
        for p, d in clients:
            p.close()
            d.close()

        async def aio_rooms() -> None:
            async with AsyncClient(prefill) as ap, AsyncClient(decode) as ad:
                apr, adr = await ap.register_pool(ppool, label="bench"), await ad.register_pool(dpool, label="bench")
                free: asyncio.Queue[int] = asyncio.Queue()
                for slot in range(concurrency):
                    free.put_nowait(slot)
                next_room = [base + (1 << 19)]

                async def one() -> None:
                    slot = await free.get()
                    room = next_room[0]
                    next_room[0] += 1
                    off = slot * slot_bytes
                    handles: list[AsyncRoomHandle] = list(
                        await asyncio.gather(
                            ad.expect(room, prefill_name, [[adr.slice(off, slot_bytes)]]),
                            ap.send(room, 0, 0, [apr.slice(off, slot_bytes)], last=True, peer=decode_name),
                        )
                    )
                    for h in handles:
                        await h.result(timeout=30)
                        await h.reusable(timeout=30)
                    free.put_nowait(slot)

                out.extend(await timed_async([("minimal room, asyncio: expect + send + both outcomes", one, concurrency)], rooms, warmup=5))
                await ap.unregister_memory(apr)
                await ad.unregister_memory(adr)

        asyncio.run(aio_rooms())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvgate.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", default=None, help="gateway for the per-call figures (default: --decode, else the default socket)")
    p.add_argument("--token", default=None, help="bearer token (TCP engine API)")
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prefill", default=None, help="prefill gateway socket: with --decode, also time minimal rooms")
    p.add_argument("--decode", default=None, help="decode gateway socket")
    p.add_argument("--prefill-name", default="prefill-0")
    p.add_argument("--decode-name", default="decode-0")
    p.add_argument("--rooms", type=int, default=2000)
    p.add_argument("--json", default=None, help="write the figures as JSON to this file ('-': stdout)")
    args = p.parse_args(argv)

    target = args.socket or args.decode or None
    figures = call_figures(target, args.token, args.calls, args.concurrency)
    if args.prefill and args.decode:
        figures += room_figures(args.prefill, args.decode, args.prefill_name, args.decode_name, args.rooms, args.concurrency)
    print(f"{'figure':<58} {'calls':>7} {'':>17}  {'rate':>11}")
    for f in figures:
        print(f.row())
    if args.json:
        text = json.dumps({"figures": [f.as_dict() for f in figures]}, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as out:
                out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
