"""The engine fast lane from Python (`Client(lane=True)`): rooms through two real gateways with every
call and event on the lane, the bytes checked; refusals carry the same reason codes as on gRPC; the
client's own bounds on what it reads; and the lane's call table against the protocol."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

import kvgate
from gateways import Pair
from helpers import Engine, Layout
from kvgate import _channel, _lane, _lane_aio
from kvgate._proto import kvgate_pb2 as pb


def lane_connections(metrics: str) -> float:
    """Engine connections open on the gateway's fast lane (`kvgate_listener_connections{listener="engine_api_lane"}`)."""
    prefix = 'kvgate_listener_connections{listener="engine_api_lane"}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix))


def test_every_engine_api_method_has_its_lane_call() -> None:
    methods = [m.name for m in _channel.METHODS]
    assert _lane.check_fields(methods) == []
    assert _lane.check_fields(["NoSuchCall"]) == ["NoSuchCall"], "the check can fail"
    assert _lane.field_of("SendBatch") == "send_batch" and _lane.field_of("Info") == "info"


def test_rooms_move_on_the_lane_and_the_bytes_match(pair: Pair) -> None:
    layout = Layout(parts=2, layers=3, tokens=16, token_bytes=128, chunks=2)
    prefill = Engine(pair.prefill.socket, layout, slots=4, name="prefill", lane=True)
    decode = Engine(pair.decode.socket, layout, slots=4, name="decode", lane=True)
    try:
        rooms = []
        for i in range(4):
            room = kvgate.RoomKey(500 + i, 1)
            prefill.fill(i, room.room)
            decode.clear(i)
            rooms.append((room, decode.expect(room, i), prefill.send(room, i), i))
        for room, receiver, sender, slot in rooms:
            got = receiver.result(timeout=10)
            assert got.succeeded and got.bytes == layout.size and got.key == room
            assert sender.result(timeout=10).succeeded
            assert receiver.reusable(timeout=10) == "nothing_in_flight"
            assert decode.holds(slot, room.room), f"room {room}: bytes differ"
        # Reads on the lane too: the room's view and the listing.
        info = decode.client.room(rooms[0][0])
        assert (info.state, info.role, info.bytes_done) == ("succeeded", "receiver", layout.size)
        assert decode.client.tracking_stats.watch_opened >= 1 and decode.client.watch_up
        # Each engine's calls and its Watch stream hold lane connections: the gateways say so.
        for gateway in (pair.prefill, pair.decode):
            assert lane_connections(gateway.metrics()) >= 2, gateway.name
    finally:
        prefill.close()
        decode.close()


def test_a_refusal_on_the_lane_carries_its_reason_code(pair: Pair) -> None:
    with kvgate.Client(pair.decode.socket, lane=True) as client:
        bogus = kvgate.Slice(region=987654, offset=0, length=64)
        with pytest.raises(kvgate.KvgateError) as refused:
            client.expect(kvgate.RoomKey(77, 0), "prefill", [[bogus]])
        assert refused.value.code == "unknown_region", refused.value
        # The same call over gRPC is refused with the same code.
        with kvgate.Client(pair.decode.socket) as grpc_client:
            with pytest.raises(kvgate.KvgateError) as over_grpc:
                grpc_client.expect(kvgate.RoomKey(77, 0), "prefill", [[bogus]])
        assert over_grpc.value.code == refused.value.code


def test_a_watch_stream_on_the_lane_sees_a_room_end(pair: Pair) -> None:
    layout = Layout(parts=1, layers=1, tokens=8, token_bytes=64, chunks=1)
    prefill = Engine(pair.prefill.socket, layout, slots=1, name="prefill", lane=True)
    decode = Engine(pair.decode.socket, layout, slots=1, name="decode", lane=True)
    try:
        room = kvgate.RoomKey(900, 0)
        with decode.client.watch(room) as stream:
            decode.expect(room, 0)
            prefill.fill(0, room.room)
            prefill.send(room, 0)
            states = []
            for event in stream:
                states.append(event.kind)
                if event.kind == "terminal":
                    assert event.outcome is not None and event.outcome.succeeded
                    break
        assert "terminal" in states
    finally:
        prefill.close()
        decode.close()


def test_lane_needs_a_unix_socket() -> None:
    with pytest.raises(ValueError, match="Unix socket"):
        kvgate.Client("127.0.0.1:1", lane=True)


def test_no_lane_socket_is_unavailable_with_the_path(workdir: Path) -> None:
    client = kvgate.Client(str(workdir / "nothing.sock"), lane=True)
    try:
        with pytest.raises(kvgate.GatewayUnavailable, match="nothing.sock.lane"):
            client.wait_ready(0.5)
    finally:
        client.close()


def _serve_once(path: str, reply: bytes) -> tuple[socket.socket, threading.Thread]:
    """A stand-in lane socket at `path` that answers the first frame it reads with `reply` (raw bytes)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(reply)
        threading.Event().wait(1.0)
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return server, thread


def _info_over(transport: str, engine_socket: str) -> str:
    """One `Info` call over the lane at `engine_socket` with the blocking or the asyncio client."""
    if transport == "blocking":
        lane = _lane.Lane(engine_socket, 2.0)
        try:
            return str(lane.unary("Info")(pb.InfoRequest(), timeout=5).gateway)
        finally:
            lane.close()

    async def info() -> str:
        aio = _lane_aio.AioLane(engine_socket, 2.0)
        try:
            reply = await aio.unary("Info")(pb.InfoRequest(), timeout=5)
            return str(reply.gateway)
        finally:
            await aio.close()

    return asyncio.run(info())


@pytest.mark.parametrize("transport", ["blocking", "asyncio"])
@pytest.mark.parametrize("past", [0, 1], ids=["at-the-bound", "one-past"])
def test_a_reply_frame_past_the_clients_bound_ends_the_call_with_a_reason(transport: str, past: int, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = pb.LaneReply(id=1, info=pb.InfoReply(gateway="g")).SerializeToString()
    monkeypatch.setattr(_lane, "MAX_REPLY_FRAME_BYTES", len(body) - past)
    engine_socket = str(workdir / "stand-in.sock")
    server, thread = _serve_once(_lane.lane_path(engine_socket), struct.pack("<I", len(body)) + body)
    try:
        if past == 0:
            assert _info_over(transport, engine_socket) == "g"
        else:
            with pytest.raises(grpc.RpcError) as failed:
                _info_over(transport, engine_socket)
            assert kvgate.errors.from_rpc_error(failed.value).code == "frame_too_large"
    finally:
        server.close()
        thread.join(timeout=3)


def test_many_threads_share_the_lane_and_each_gets_its_own_reply(pair: Pair) -> None:
    """The calling threads take turns reading the shared connection: every call gets the reply to it."""
    with kvgate.Client(pair.decode.socket, lane=True, session=False) as client:
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                for i in range(150):
                    key = kvgate.RoomKey(10_000 + n * 1000 + i, 0)
                    # A refused lookup names its own room: a reply handed to the wrong call shows.
                    with pytest.raises(kvgate.RoomError, match=str(key.room)):
                        client.room(key)
                    assert client.info(refresh=True).gateway == "decode"
            except BaseException as e:  # noqa: BLE001 (collected and re-raised below)
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[:3]


def test_a_call_without_a_reply_ends_at_its_deadline(workdir: Path) -> None:
    engine_socket = str(workdir / "silent.sock")
    server, thread = _serve_once(_lane.lane_path(engine_socket), b"")
    try:
        lane = _lane.Lane(engine_socket, 2.0)
        with pytest.raises(grpc.RpcError) as failed:
            lane.unary("Info")(pb.InfoRequest(), timeout=0.3)
        assert kvgate.errors.from_rpc_error(failed.value).code == "deadline_exceeded"
        lane.close()
    finally:
        server.close()
        thread.join(timeout=3)


def test_the_asyncio_client_moves_rooms_on_the_lane(pair: Pair) -> None:
    layout = Layout(parts=2, layers=2, tokens=16, token_bytes=64, chunks=2)

    async def scenario() -> None:
        async with kvgate.AsyncClient(pair.prefill.socket, lane=True) as p, kvgate.AsyncClient(pair.decode.socket, lane=True) as d:
            with kvgate.SharedPool(8 * layout.size) as ppool, kvgate.SharedPool(8 * layout.size) as dpool:
                pr = await p.register_pool(ppool, label="prefill")
                dr = await d.register_pool(dpool, label="decode")
                stream = await d.watch(kvgate.RoomKey(700, 0))

                async def one(i: int) -> None:
                    room, base = 700 + i, i * layout.size
                    ppool.numpy()[base : base + layout.size] = np.random.default_rng(room).integers(0, 256, layout.size, dtype=np.uint8)
                    receiver, sender = await asyncio.gather(
                        d.expect(room, "prefill", layout.parts_of(dr, base)),
                        p.send_chunks(room, layout.chunks_of(pr, base), peer="decode"),
                    )
                    assert (await receiver.result(timeout=10)).succeeded
                    assert (await sender.result(timeout=10)).succeeded
                    await asyncio.gather(receiver.reusable(timeout=10), sender.reusable(timeout=10))
                    assert np.array_equal(dpool.numpy()[base : base + layout.size], ppool.numpy()[base : base + layout.size])

                await asyncio.gather(*(one(i) for i in range(8)))
                # The room-scoped stream on the lane saw room 700 end.
                kinds = []
                async for event in stream:
                    kinds.append(event.kind)
                    if event.kind == "terminal":
                        break
                stream.close()
                assert "terminal" in kinds
                with pytest.raises(kvgate.RegionError) as refused:
                    await d.expect(799, "prefill", [[kvgate.Slice(region=987654, offset=0, length=8)]])
                assert refused.value.code == "unknown_region"
                for gateway in (pair.prefill, pair.decode):
                    assert lane_connections(gateway.metrics()) >= 2, gateway.name

    asyncio.run(scenario())
