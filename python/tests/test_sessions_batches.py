"""Batches, engine sessions and `Info`. On a gateway of engine API v2 they are the gateway's (one call
per batch; a closed session ends its live rooms `engine_lost`; a region a live room uses cannot be
unregistered); on a v1 gateway the client does the same with one call each and has no session."""

from __future__ import annotations

import asyncio

import pytest

import kvgate
from gateways import Pair
from helpers import Engine, Layout

LAYOUT = Layout(chunks=2)


def test_info_names_the_gateway(pair: Pair) -> None:
    with kvgate.Client(pair.decode.socket) as client:
        info = client.info()
        assert info.api_version in (1, 2)
        if info.api_version >= 2:
            assert (info.gateway, info.plugins) == ("decode", ("shm",))


def test_batches_apply_each_call_on_its_own(pair: Pair) -> None:
    prefill = Engine(pair.prefill.socket, LAYOUT, slots=3, name="prefill")
    decode = Engine(pair.decode.socket, LAYOUT, slots=3, name="decode")
    try:
        expects = [
            kvgate.Expectation(1001, "prefill", LAYOUT.parts_of(decode.region, decode.base(0))),
            kvgate.Expectation(1002, "prefill", [[kvgate.Slice(4242, 0, 64)]]),
            kvgate.Expectation(1003, "prefill", LAYOUT.parts_of(decode.region, decode.base(2))),
        ]
        results = decode.client.expect_batch(expects)
        assert isinstance(results[1], kvgate.RegionError) and results[1].code == "unknown_region"
        receivers = [r for r in (results[0], results[2]) if isinstance(r, kvgate.RoomHandle)]
        assert [h.key.room for h in receivers] == [1001, 1003]
        assert decode.client.handle(1002, "receiver") is None, "a refused expect leaves nothing tracked"
        for slot, room in ((0, 1001), (2, 1003)):
            prefill.fill(slot, room)
        # Both rooms' chunks in one batch, and one chunk out of order.
        sends = [
            kvgate.ChunkSend(room, c.part, c.chunk, c.slices, c.last, "decode")
            for slot, room in ((0, 1001), (2, 1003))
            for c in LAYOUT.chunks_of(prefill.region, prefill.base(slot))
        ]
        sends.append(kvgate.ChunkSend(1004, 0, 5, [prefill.region.slice(0, 64)], False, "decode"))
        sent = prefill.client.send_batch(sends)
        assert all(isinstance(r, kvgate.RoomHandle) for r in sent[:-1]), sent
        assert isinstance(sent[-1], kvgate.InvalidRequest) and sent[-1].code == "out_of_order_chunk"
        for h, slot, room in ((receivers[0], 0, 1001), (receivers[1], 2, 1003)):
            assert h.result(timeout=10).succeeded and decode.holds(slot, room)
        assert all(isinstance(r, kvgate.RoomHandle) and r.result(timeout=10).succeeded for r in sent[:-1])

        async def asyncio_batches() -> None:
            async with kvgate.AsyncClient(pair.decode.socket) as d, kvgate.AsyncClient(pair.prefill.socket) as p:
                dr = await d.register_pool(decode.pool)
                pr = await p.register_pool(prefill.pool)
                got = await d.expect_batch([kvgate.Expectation(1010 + i, "prefill", LAYOUT.parts_of(dr, LAYOUT.size * i)) for i in range(3)])
                handles = [h for h in got if isinstance(h, kvgate.AsyncRoomHandle)]
                assert len(handles) == 3
                await asyncio.gather(*(p.send_chunks(1010 + i, LAYOUT.chunks_of(pr, LAYOUT.size * i), peer="decode") for i in range(3)))
                for h in handles:
                    assert (await h.result(timeout=10)).succeeded
                    await h.reusable(timeout=10)

        asyncio.run(asyncio_batches())
    finally:
        prefill.close()
        decode.close()


def test_a_closed_session_ends_its_live_rooms(pair: Pair) -> None:
    engine = kvgate.Client(pair.decode.socket, session="decode-rank-0")
    observer = kvgate.Client(pair.decode.socket, session=False)
    pool = kvgate.SharedPool(LAYOUT.size)
    try:
        region = engine.register_pool(pool)
        room = engine.expect(1100, "prefill", LAYOUT.parts_of(region, 0))
        watched = observer.track(1100, "receiver")
        v2 = engine.info().api_version >= 2
        if v2:
            assert engine.session_id is not None
            with pytest.raises(kvgate.RegionError) as in_use:
                engine.unregister_memory(region)
            assert in_use.value.code == "region_in_use"
        else:
            assert engine.session_id is None
        engine.close()
        if v2:
            got = watched.terminal(timeout=10)
            assert (got.succeeded, got.reason) == (False, "engine_lost"), got
            assert room.poll() is None or room.poll() == got, "the closed client's own handle hears nothing more"
            # Opening the same name again makes a new session (the old one ended).
            with kvgate.Client(pair.decode.socket, session="decode-rank-0") as again:
                again.register_pool(pool)
                assert again.session_id is not None and again.session_id != engine.session_id
        else:
            assert watched.poll() is None
            assert observer.abort(1100, "v1: no session ends it")
            assert watched.terminal(timeout=10).reason == "aborted"
    finally:
        engine.close()
        observer.close()
        pool.close()


def test_refused_session_names_and_ids(pair: Pair) -> None:
    with kvgate.Client(pair.decode.socket, session="not a valid name!") as bad, kvgate.SharedPool(4096) as pool:
        if bad.info().api_version < 2:
            return  # a v1 gateway has no sessions: the name is never sent
        with pytest.raises(kvgate.InvalidRequest) as refused:
            bad.register_pool(pool)
        assert refused.value.code == "invalid_session_name"
    with kvgate.Client(pair.decode.socket, session="decode-rank-1") as first, kvgate.SharedPool(4096) as pool:
        first.register_pool(pool)
        with kvgate.Client(pair.decode.socket, session="decode-rank-1") as second:
            with pytest.raises(kvgate.SessionError) as taken:
                second.register_pool(pool)
            assert taken.value.code == "session_in_use"


def test_chunks_placed_at_their_offsets_arrive_in_any_order(pair: Pair) -> None:
    prefill = Engine(pair.prefill.socket, LAYOUT, slots=1, name="prefill")
    decode = Engine(pair.decode.socket, LAYOUT, slots=1, name="decode")
    try:
        if decode.client.info().api_version < 2:
            pytest.skip("placement at an offset needs engine API v2")
        prefill.fill(0, 1100)
        room = decode.expect(1100, 0)
        per_chunk = LAYOUT.layers * (LAYOUT.tokens // LAYOUT.chunks) * LAYOUT.token_bytes
        chunks = [
            kvgate.Chunk(c.part, c.chunk, c.slices, offset=c.chunk * per_chunk)
            for c in reversed(LAYOUT.chunks_of(prefill.region, prefill.base(0)))
        ]
        sender = prefill.client.send_chunks(1100, chunks, peer="decode")
        assert room.result(timeout=10).succeeded and sender.result(timeout=10).succeeded
        assert decode.holds(0, 1100)
        # A chunk over bytes already placed is refused with its reason.
        with pytest.raises(kvgate.KvgateError) as refused:
            prefill.client.send(1101, 0, 0, [prefill.region.slice(0, 64)], peer="decode", offset=0)
            prefill.client.send(1101, 0, 1, [prefill.region.slice(0, 64)], peer="decode", offset=32)
        assert refused.value.code in ("overlapping_chunk",)
    finally:
        prefill.close()
        decode.close()
