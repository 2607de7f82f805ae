"""Faults seen from Python: aborts from either side in every phase; a peer gateway killed ends every room
bound to it with `peer_lost` within heartbeat_interval x misses (+ slack); an engine process killed
leaves no room behind."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

import kvgate
from gateways import Pair
from helpers import GRACE_S, Engine, Layout, python_script

LAYOUT = Layout(chunks=3)


@pytest.mark.parametrize("aborter", ["prefill", "decode"])
def test_abort_from_either_side_in_every_phase(pair: Pair, aborter: str) -> None:
    prefill = Engine(pair.prefill.socket, LAYOUT, slots=3, name="prefill")
    decode = Engine(pair.decode.socket, LAYOUT, slots=3, name="decode")
    try:
        for slot, phase in enumerate(["bootstrap", "matched", "transfer"]):
            room = kvgate.RoomKey(500 + slot + (10 if aborter == "decode" else 0), 1)
            receiver: kvgate.RoomHandle | None = None
            sender: kvgate.RoomHandle | None = None
            if phase == "bootstrap":
                # Only the aborting side has posted its request.
                if aborter == "prefill":
                    sender = prefill.send(room, slot, chunks=1)
                else:
                    receiver = decode.expect(room, slot)
            else:
                receiver = decode.expect(room, slot)
                sender = prefill.send(room, slot, chunks=1 if phase == "matched" else LAYOUT.chunks - 1)
                time.sleep(0.05)
            engine = prefill if aborter == "prefill" else decode
            assert engine.client.abort(room, "test"), f"{phase}: room {room} was live"
            own = sender if aborter == "prefill" else receiver
            other = receiver if aborter == "prefill" else sender
            assert own is not None
            got = own.terminal(timeout=10)
            assert (got.succeeded, got.reason) == (False, "aborted"), f"{aborter} {phase}: {got}"
            assert own.reusable(timeout=10), f"{aborter} {phase}: never reusable"
            with pytest.raises(kvgate.TransferFailed) as raised:
                own.result(timeout=1)
            assert raised.value.code == "aborted"
            if other is not None:
                peer_side = other.terminal(timeout=10)
                assert (peer_side.succeeded, peer_side.reason) == (False, "aborted_by_peer"), f"{aborter} {phase}: {peer_side}"
                assert other.reusable(timeout=10)
            elif aborter == "prefill":
                # The decode side never had the room: its late expect is refused, not created.
                time.sleep(0.1)
                with pytest.raises(kvgate.RoomError) as late:
                    decode.expect(room, slot)
                assert late.value.code == "room_terminal"
            else:
                late_sender = prefill.client.track(room, "sender")
                assert late_sender.terminal(timeout=10).reason == "aborted_by_peer"
                with pytest.raises(kvgate.RoomError) as late:
                    prefill.send(room, slot, chunks=1)
                assert late.value.code == "room_terminal"
        for g in (pair.prefill, pair.decode):
            assert g.wait_rooms_empty(5) == [], g.name
    finally:
        prefill.close()
        decode.close()


def test_abort_from_asyncio_reaches_the_other_side(pair: Pair) -> None:
    async def scenario() -> None:
        async with kvgate.AsyncClient(pair.prefill.socket) as p, kvgate.AsyncClient(pair.decode.socket) as d:
            with kvgate.SharedPool(LAYOUT.size) as ppool, kvgate.SharedPool(LAYOUT.size) as dpool:
                pr, dr = await p.register_pool(ppool), await d.register_pool(dpool)
                receiver = await d.expect(600, "prefill", LAYOUT.parts_of(dr, 0))
                sender = await p.send_chunks(600, LAYOUT.chunks_of(pr, 0, limit=1), peer="decode")
                assert await d.abort(600, "asyncio test")
                assert (await receiver.terminal(timeout=10)).reason == "aborted"
                assert (await sender.terminal(timeout=10)).reason == "aborted_by_peer"
                assert await sender.reusable(timeout=10)
                with pytest.raises(kvgate.RoomError) as late:
                    await p.send(600, 0, 1, LAYOUT.chunk_slices(pr, 0, 0, 1), peer="decode")
                assert late.value.code == "room_terminal"

    asyncio.run(scenario())


@pytest.mark.parametrize("killed", ["prefill", "decode"])
def test_killed_peer_gateway_ends_every_room_with_peer_lost_within_the_bound(pair: Pair, killed: str) -> None:
    prefill = Engine(pair.prefill.socket, LAYOUT, slots=6, name="prefill")
    decode = Engine(pair.decode.socket, LAYOUT, slots=6, name="decode")
    survivor = decode if killed == "prefill" else prefill
    try:
        handles: list[kvgate.RoomHandle] = []
        for slot in range(6):
            room = 700 + slot
            receiver = decode.expect(room, slot)
            sender = prefill.send(room, slot, chunks=1 + slot % 2)  # matched, or mid-transfer
            handles.append(receiver if survivor is decode else sender)
        time.sleep(0.1)
        (pair.prefill if killed == "prefill" else pair.decode).kill()
        killed_at = time.monotonic()
        bound = pair.settings.peer_loss_bound_s + GRACE_S
        seen_after: list[float] = []
        for h in handles:
            got = h.terminal(timeout=bound + 10)
            seen_after.append(time.monotonic() - killed_at)
            assert (got.succeeded, got.reason) == (False, "peer_lost"), f"room {h.key}: {got}"
        assert max(seen_after) <= bound, f"rooms ended {max(seen_after):.2f} s after the kill; bound {bound:.2f} s"
        # Nothing can confirm that a dead peer's transfers stopped: the memory is released by the bound.
        for h in handles:
            assert h.reusable(timeout=pair.settings.quarantine_timeout_ms / 1000 + 10) in ("quarantine_timeout", "quiesced", "nothing_in_flight")
        alive = pair.decode if killed == "prefill" else pair.prefill
        assert alive.wait_rooms_empty(5) == []
        assert f'kvgate_peer_up{{peer="{killed}"}} 0' in alive.metrics()
        # The survivor's engine is told the peer is gone when it asks for another room.
        with pytest.raises(kvgate.PeerError) as refused:
            if survivor is decode:
                decode.expect(799, 0)
            else:
                prefill.send(799, 0)
        assert refused.value.code == "peer_not_connected"
    finally:
        prefill.close()
        decode.close()


def test_killed_engine_process_leaves_no_room_behind(start_pair: Callable[..., Pair], workdir: Path) -> None:
    pair = start_pair(bootstrap_timeout_ms=1500, room_timeout_ms=3000, transfer_base_ms=5000, session_grace_ms=1000)
    script = str(Path(__file__).with_name("engine_proc.py"))
    observer_decode = kvgate.Client(pair.decode.socket)
    decode = Engine(pair.decode.socket, Layout(token_bytes=512), slots=1, name="decode")
    assert decode.layout.size == 64 * 1024, "the room engine_proc.py sends"
    expecting: subprocess.Popen[str] | None = None
    sending: subprocess.Popen[str] | None = None
    try:
        # A decode engine posts expects and dies before any sender comes.
        expecting = python_script([script, "expect", pair.decode.socket, "prefill", "801", "802", "803"])
        # A prefill engine sends the first of two chunks of a room this test's decode engine expects, and dies.
        receiver = decode.client.expect(811, "prefill", [[decode.region.slice(0, 64 * 1024)]])
        sending = python_script([script, "send-first", pair.prefill.socket, "decode", "811"])
        procs = (expecting, sending)
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"{line}{proc.stderr.read() if proc.stderr else ''}"
        orphans = [observer_decode.track(room, "receiver") for room in (801, 802, 803)]
        assert all(h.poll() is None for h in orphans)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        killed_at = time.monotonic()
        # Engine API v2: each engine process had a session, which ends once its Watch stream has been
        # gone for session_grace_ms: its live rooms fail `engine_lost` (peers told). Engine API v1 has no
        # sessions: the rooms end by their bootstrap or room deadline.
        sessions = observer_decode.info().api_version >= 2
        if sessions:
            bound = (pair.settings.session_grace_ms or 0) / 1000 + GRACE_S
        else:
            bound = max(pair.settings.bootstrap_timeout_ms, pair.settings.room_timeout_ms) / 1000 + GRACE_S
        for h in [*orphans, receiver]:
            got = h.terminal(timeout=bound + 10)
            assert not got.succeeded, f"room {h.key}: {got}"
            assert time.monotonic() - killed_at <= bound, f"room {h.key} ended {time.monotonic() - killed_at:.2f} s after the kill: {got}"
            if sessions and h is receiver:
                assert got.peer_reason == "engine_lost", got
            elif sessions:
                assert got.reason == "engine_lost", got
            assert h.reusable(timeout=10)
        for g in (pair.prefill, pair.decode):
            assert g.wait_rooms_empty(5) == [], g.name
    finally:
        observer_decode.close()
        decode.close()
        for leftover in (expecting, sending):
            if leftover is not None and leftover.poll() is None:
                leftover.kill()
                leftover.wait()
