"""KV caches moved between engines through two real gateways, the bytes checked: two engine processes
(the examples), the blocking and the asyncio client in process, TCP with a bearer token; refusals carry
their reason codes; room views and the raw Watch stream."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import kvgate
from gateways import Pair
from helpers import EXAMPLES, Engine, Layout, python_script


def run_examples(pair: Pair, workdir: Path, extra: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    rendezvous = str(workdir / "rooms.json")
    decode = python_script(
        [str(EXAMPLES / "decode.py"), "--socket", pair.decode.socket, "--peer", "prefill", "--rendezvous", rendezvous, "--json",
         "--rooms", "12", "--slots", "4", "--layers", "4", "--tokens", "32", "--token-bytes", "512", "--chunks", "3", "--wait", "60", *extra]
    )
    prefill = python_script(
        [str(EXAMPLES / "prefill.py"), "--socket", pair.prefill.socket, "--peer", "decode", "--rendezvous", rendezvous, "--json", "--wait", "60", *extra]
    )
    try:
        p_out, p_err = prefill.communicate(timeout=90)
        d_out, d_err = decode.communicate(timeout=90)
    finally:
        for proc in (prefill, decode):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert prefill.returncode == 0, f"prefill:\n{p_out}\n{p_err}"
    assert decode.returncode == 0, f"decode:\n{d_out}\n{d_err}"
    p_lines, d_lines = p_out.strip().splitlines(), d_out.strip().splitlines()
    assert p_lines[0].startswith("prefill: 12 rooms: 12 ok, 0 failed"), p_out
    assert d_lines[0].startswith("decode: 12 rooms: 12 ok, 0 failed, 0 corrupt"), d_out
    assert "GB/s" in d_lines[0]
    p_result: dict[str, Any] = json.loads(p_lines[-1])
    d_result: dict[str, Any] = json.loads(d_lines[-1])
    return p_result, d_result


@pytest.mark.parametrize("memfd", [False, True], ids=["dev-shm-pools", "memfd-pools"])
def test_two_engine_processes_move_kv_and_the_bytes_match(pair: Pair, workdir: Path, memfd: bool) -> None:
    p, d = run_examples(pair, workdir, ["--memfd"] if memfd else [])
    assert d["ok"] == 12 and d["corrupt"] == 0 and p["ok"] == 12
    # Each side hashed its own memory: what the decode process holds is what the prefill process wrote.
    assert d["checksums"] == p["checksums"] and len(d["checksums"]) == 12
    assert pair.decode.wait_rooms_empty(5) == [] and pair.prefill.wait_rooms_empty(5) == []


def test_blocking_client_moves_scatter_gather_chunks(pair: Pair) -> None:
    layout = Layout(parts=3, layers=5, tokens=24, token_bytes=128, chunks=3)
    prefill = Engine(pair.prefill.socket, layout, slots=4, name="prefill")
    decode = Engine(pair.decode.socket, layout, slots=4, name="decode")
    try:
        assert prefill.region.plugins == ("shm",)
        rooms = []
        for i in range(4):
            room = kvgate.RoomKey(100 + i, 3)
            prefill.fill(i, room.room)
            decode.clear(3 - i)
            receiver = decode.expect(room, 3 - i)
            sender = prefill.send(room, i)
            rooms.append((room, receiver, sender, 3 - i))
        for room, receiver, sender, slot in rooms:
            got = receiver.result(timeout=10)
            assert got.succeeded and got.bytes == layout.size and got.key == room and got.role == "receiver"
            assert sender.result(timeout=10).bytes == layout.size
            assert receiver.reusable(timeout=10) == "nothing_in_flight"
            assert decode.holds(slot, room.room), f"room {room}: bytes differ"
        info = decode.client.room(rooms[0][0])
        assert (info.state, info.role, info.peer, info.plugin, info.bytes_done) == ("succeeded", "receiver", "prefill", "shm", layout.size)
        assert info.terminal and info.reusable
        assert decode.client.rooms() == []
        assert {r.key for r in decode.client.rooms(include_terminal=True)} >= {r[0] for r in rooms}
    finally:
        prefill.close()
        decode.close()


def test_a_cuda_vmm_descriptor_is_refused_by_a_gateway_without_a_cuda_plugin_saying_why(pair: Pair) -> None:
    decode = kvgate.Client(pair.decode.socket)
    fd = os.memfd_create("kvgate-py-vmm-stand-in")  # no plugin of this gateway gets as far as the driver
    try:
        with pytest.raises(kvgate.RegionError) as raised:
            decode.register_cuda_vmm_fd(fd, device=0, offset=0, length=1 << 20, allocation_size=2 << 20, label="vmm")
        assert raised.value.code == "unsupported_memory"
        assert "shm: memory kind cuda_device not served" in str(raised.value), str(raised.value)
        with pytest.raises(kvgate.RegionError) as raised:
            decode.register_cuda_vmm_fd(fd, device=0, offset=1, length=2 << 20, allocation_size=2 << 20)
        assert raised.value.code == "slice_out_of_range"
    finally:
        os.close(fd)
        decode.close()


def test_a_memfd_registered_by_descriptor_receives_kv_after_the_engine_closes_its_copy(pair: Pair) -> None:
    import mmap

    layout = Layout(parts=2, layers=2, tokens=16, token_bytes=128, chunks=2)
    prefill = Engine(pair.prefill.socket, layout, slots=1, name="prefill")
    decode = kvgate.Client(pair.decode.socket)
    fd = os.memfd_create("kvgate-py-passed")
    try:
        os.ftruncate(fd, layout.size)
        view = mmap.mmap(fd, layout.size)
        region = decode.register_fd(fd, length=layout.size, label="passed memfd")
        os.close(fd)
        fd = -1
        assert region.plugins == ("shm",)
        prefill.fill(0, 77)
        receiver = decode.expect(77, "prefill", layout.parts_of(region, 0))
        assert prefill.send(77, 0).result(timeout=10).succeeded
        assert receiver.result(timeout=10).succeeded
        assert bytes(view[:]) == prefill.slot(0).tobytes(), "every byte landed in the engine's memfd"
        with pytest.raises(kvgate.RegionError) as raised:
            decode._call(decode._register, kvgate.client._register_fd_request(12345, 0, 64, "x"))
        assert raised.value.code == "unknown_fd_token"
        receiver.reusable(timeout=10)
        decode.unregister_memory(region)
        view.close()
    finally:
        if fd >= 0:
            os.close(fd)
        decode.close()
        prefill.close()


def test_asyncio_client_moves_kv_with_parts_side_by_side(pair: Pair) -> None:
    layout = Layout(parts=4, layers=4, tokens=32, token_bytes=256, chunks=4)

    async def scenario() -> None:
        async with kvgate.AsyncClient(pair.prefill.socket) as p, kvgate.AsyncClient(pair.decode.socket) as d:
            with kvgate.SharedPool(8 * layout.size) as ppool, kvgate.SharedPool(8 * layout.size, memfd=True) as dpool:
                pr = await p.register_pool(ppool, label="prefill")
                dr = await d.register_pool(dpool, label="decode")

                async def one(i: int) -> None:
                    room, base = 200 + i, i * layout.size
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
                assert await d.rooms() == []
                await p.unregister_memory(pr)
                await d.unregister_memory(dr)

    asyncio.run(scenario())


def test_refusals_carry_their_reason_code(pair: Pair) -> None:
    layout = Layout()
    decode = Engine(pair.decode.socket, layout, slots=2, name="decode")
    prefill = Engine(pair.prefill.socket, layout, slots=2, name="prefill")
    c = decode.client

    def refused(call: Callable[[], object]) -> kvgate.KvgateError:
        with pytest.raises(kvgate.KvgateError) as raised:
            call()
        return raised.value

    try:
        e = refused(lambda: c.expect(1, "prefill", [[kvgate.Slice(999, 0, 8)]]))
        assert (type(e), e.code, e.status) == (kvgate.RegionError, "unknown_region", "INVALID_ARGUMENT") or (type(e), e.code) == (kvgate.RegionError, "unknown_region")
        e = refused(lambda: c.expect(1, "prefill", [[kvgate.Slice(decode.region.id, decode.pool.size - 4, 8)]]))
        assert (type(e), e.code) == (kvgate.RegionError, "slice_out_of_range")
        e = refused(lambda: c.expect(1, "nobody", [[decode.region.slice(0, 8)]]))
        assert (type(e), e.code) == (kvgate.PeerError, "unknown_peer")
        e = refused(lambda: c.expect(1, "prefill", []))
        assert (type(e), e.code) == (kvgate.InvalidRequest, "empty_request")
        e = refused(lambda: c.unregister_memory(12345))
        assert (type(e), e.code, e.status) == (kvgate.RegionError, "unknown_region", "NOT_FOUND")
        e = refused(lambda: c.room(424242))
        assert (type(e), e.code) == (kvgate.RoomError, "unknown_room")
        e = refused(lambda: c.register_shared_memory("/dev/shm/does-not-exist-kvgate", length=4096))
        assert (type(e), e.code) == (kvgate.RegionError, "memory_unavailable")
        # A room id reused: the duplicate expect, then (after the room ended) a late counterpart.
        decode.expect(7, 0)
        e = refused(lambda: decode.expect(7, 1))
        assert (type(e), e.code) == (kvgate.RoomError, "duplicate_expect")
        e = refused(lambda: prefill.client.send(8, 0, 1, [prefill.region.slice(0, 8)], peer="decode"))
        assert (type(e), e.code) == (kvgate.InvalidRequest, "out_of_order_chunk")
        assert c.abort(7, "test")
        # The abort reaches the prefill gateway over the peer link: wait until its side of the room is over.
        deadline = time.monotonic() + 10
        while prefill.client.room(7).state != "failed" and time.monotonic() < deadline:
            time.sleep(0.01)
        e = refused(lambda: prefill.send(7, 0))
        assert (type(e), e.code) == (kvgate.RoomError, "room_terminal")
        assert "room_terminal" in str(e)
        e = refused(lambda: decode.expect((7, 0), 0))
        assert (type(e), e.code) == (kvgate.RoomError, "room_terminal")
        # A refused creating call leaves nothing tracked; the aborted room is over on this side.
        assert decode.client.handle(8, "sender") is None and prefill.client.handle(8, "sender") is None
        assert not c.abort(7, "again"), "a second abort is harmless"
    finally:
        decode.close()
        prefill.close()


def test_tcp_engine_api_with_bearer_token(start_pair: Callable[..., Pair]) -> None:
    pair = start_pair(tcp=True)
    layout = Layout()
    prefill = Engine(pair.prefill.tcp, layout, slots=1, token=pair.prefill.token, name="prefill")
    decode = Engine(f"tcp://{pair.decode.tcp}", layout, slots=1, token=pair.decode.token, name="decode")
    try:
        prefill.fill(0, 31)
        receiver = decode.expect(31, 0)
        prefill.send(31, 0)
        assert receiver.result(timeout=10).succeeded and decode.holds(0, 31)
        for token in (None, "wrong"):
            with kvgate.Client(pair.decode.tcp, token=token) as stranger:
                with pytest.raises(kvgate.AuthError) as raised:
                    stranger.rooms()
                assert raised.value.code == "bad_token"
        token_file = pair.workdir / "decode.token"
        with kvgate.Client(f"tcp://{pair.decode.tcp}", token_file=token_file) as by_file:
            assert by_file.room(31).succeeded

        async def asyncio_over_tcp() -> None:
            async with kvgate.AsyncClient(pair.decode.tcp, token=pair.decode.token) as a:
                assert (await a.room(31)).succeeded
            async with kvgate.AsyncClient(pair.decode.tcp, token="wrong") as a:
                with pytest.raises(kvgate.AuthError):
                    await a.rooms()

        asyncio.run(asyncio_over_tcp())
    finally:
        prefill.close()
        decode.close()


def test_raw_watch_stream_shows_state_changes_and_outcomes(pair: Pair) -> None:
    layout = Layout(chunks=1)
    decode = Engine(pair.decode.socket, layout, slots=1, name="decode")
    prefill = Engine(pair.prefill.socket, layout, slots=1, name="prefill")
    stream = decode.client.watch(41)
    try:
        receiver = decode.expect(41, 0)
        prefill.send(41, 0)
        receiver.result(timeout=10)
        kinds: list[str] = []
        for event in stream:
            assert event.key == kvgate.RoomKey(41) and event.role == "receiver"
            kinds.append(event.kind if event.kind != "state_changed" else event.state)
            if event.kind == "reusable":
                break
        assert kinds[-2:] == ["terminal", "reusable"], kinds
        assert "transferring" in kinds or "waiting_sender" in kinds, kinds

        async def asyncio_watch() -> list[str]:
            async with kvgate.AsyncClient(pair.decode.socket) as a:
                async with await a.watch(outcomes_only=True) as events:
                    decode.clear(0)
                    receiver = decode.expect(42, 0)
                    prefill.send(42, 0)
                    seen = []
                    async for event in events:
                        seen.append(f"{event.kind}:{event.key.room}")
                        if event.kind == "reusable":
                            break
                    assert receiver.terminal(timeout=5).succeeded
                    return seen

        assert asyncio.run(asyncio_watch()) == ["terminal:42", "reusable:42"]
    finally:
        stream.close()
        decode.close()
        prefill.close()


def test_cuda_tensor_registration_on_a_gpu(pair: Pair) -> None:
    ok, why = kvgate.cuda_available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU and PyTorch with CUDA: {why}")
    import torch

    block = torch.arange(4096, dtype=torch.uint8, device="cuda")
    tensor = block[1024:]
    export = kvgate.cuda_ipc_export(tensor)
    assert export.base >= 1024 and export.length == export.base + 3072 and len(export.handle) == 64
    with kvgate.Client(pair.decode.socket) as client:
        try:
            region = client.register_cuda_tensor(tensor, label="gpu")
        except kvgate.RegionError as e:
            # The shm plugin serves host memory only; the call reached the gateway with the handle.
            assert e.code == "unsupported_memory", e
        else:
            assert region.base == export.base and region.slice(0, 8).offset == export.base
