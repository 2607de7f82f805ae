"""KV of SGLang requests through two real gateways, byte-exact: random pages, chunked sends, a
prefix-cache skip on the decode side, several requests at once, and the metrics."""

from __future__ import annotations

import random
from typing import Callable

from gateways import Pair
from harness import SUCCESS, Engines


def lane_connections(metrics: str) -> float:
    """Engine connections open on the gateway's fast lane (`kvgate_listener_connections{listener="engine_api_lane"}`)."""
    prefix = 'kvgate_listener_connections{listener="engine_api_lane"}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix))


def test_random_pages_land_byte_exact(engines: Engines) -> None:
    e = engines
    info = e.prefill.call("info")
    pages_total = info["pages"]
    e.prefill.call("randomize", seed=1)
    e.decode.call("zero")
    rng = random.Random(7)
    for room in range(1, 4):
        count = rng.randrange(3, 12)
        src = rng.sample(range(1, pages_total), count)
        dst = rng.sample(range(1, pages_total), count)
        aux_src, aux_dst = rng.randrange(16), rng.randrange(16)
        e.transfer(room, src, dst, aux_src, aux_dst)
        want = e.prefill.call("digest", pages=src, aux=aux_src)["digest"]
        got = e.decode.call("digest", pages=dst, aux=aux_dst)["digest"]
        assert got == want, f"room {room}: the decode pages differ from the prefill pages"
        metric = e.decode.call("metric", room=room)
        assert metric["bytes"] and metric["latency_s"] is not None
        assert e.prefill.call("metric", room=room)["bytes"] == metric["bytes"]


def test_chunked_sends_with_a_prefix_cache_skip(engines: Engines) -> None:
    """Decode already holds the first pages (its prefix cache): its metadata lists only the pages it
    needs, the prefill side learns the prefix length and sends the rest in several chunks."""
    e = engines
    page_size = e.prefill.call("info")["page_size"]
    e.prefill.call("randomize", seed=2)
    e.decode.call("zero")
    rng = random.Random(3)
    src = rng.sample(range(1, 60), 13)
    cached = 5
    dst = rng.sample(range(1, 60), len(src) - cached)
    e.transfer(10, src[cached:], dst, 3, 9, chunks=[2, 5, len(src) - cached], prefix=cached * page_size)
    assert e.decode.call("digest", pages=dst, aux=9)["digest"] == e.prefill.call("digest", pages=src[cached:], aux=3)["digest"]


def test_interleaved_requests(engines: Engines) -> None:
    """Several requests in flight at once, their chunks interleaved, each landing in its own pages."""
    e = engines
    e.prefill.call("randomize", seed=4)
    e.decode.call("zero")
    rooms = {20 + i: (list(range(1 + 8 * i, 7 + 8 * i)), list(range(60 - 6 * (i + 1), 60 - 6 * i))) for i in range(4)}
    for room, (_, dst) in rooms.items():
        e.decode.call("new_receiver", room=room)
        e.prefill.call("new_sender", room=room)
        e.decode.call("send_metadata", room=room, pages=dst, aux=room % 16, prefix=0)
    for room, (src, _) in rooms.items():
        e.prefill.wait_poll(room, {2}, 20)
        e.prefill.call("init", room=room, pages=len(src), aux=room % 16)
    for half in (slice(0, 3), slice(3, 6)):
        for room, (src, _) in rooms.items():
            e.prefill.call("send", room=room, pages=src[half])
    for room, (src, dst) in rooms.items():
        assert e.prefill.wait_poll(room, {SUCCESS, 0}, 20)[0] == SUCCESS
        assert e.decode.wait_poll(room, {SUCCESS, 0}, 20)[0] == SUCCESS
        assert e.decode.call("digest", pages=dst, aux=room % 16)["digest"] == e.prefill.call("digest", pages=src, aux=room % 16)["digest"]


def test_rooms_on_the_engine_fast_lane_land_byte_exact(start_engines: Callable[..., tuple[Pair, Engines]]) -> None:
    """`KVGATE_SGLANG_LANE=1`: both engines make every engine-API call on the gateways' fast lane."""
    pair, e = start_engines(engine_env={"KVGATE_SGLANG_LANE": "1"})
    pages_total = e.prefill.call("info")["pages"]
    e.prefill.call("randomize", seed=11)
    e.decode.call("zero")
    rng = random.Random(11)
    for room in range(60, 63):
        count = rng.randrange(3, 12)
        src = rng.sample(range(1, pages_total), count)
        dst = rng.sample(range(1, pages_total), count)
        e.transfer(room, src, dst, 1, 2)
        assert e.decode.call("digest", pages=dst, aux=2)["digest"] == e.prefill.call("digest", pages=src, aux=1)["digest"]
    for gateway in (pair.prefill, pair.decode):
        # The engine's unary calls and its Watch stream each hold a lane connection.
        assert lane_connections(gateway.metrics()) >= 2, f"{gateway.name}: the engine is not on the lane"
