"""The one Watch stream per client: cut (the connection to the gateway dropped while rooms end), it is
opened again and reconciled, and every room's outcome arrives exactly once; rooms a restarted gateway
no longer knows end as `unknown_after_reconnect`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from typing import Callable

import kvgate
from gateways import Pair
from helpers import Engine, Layout, wait_until


class Proxy:
    """A TCP forwarder to `upstream` that can cut every connection and refuse new ones for a while."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._accepting = True
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if not self._accepting:
                    conn.close()
                    continue
                try:
                    up = socket.create_connection(self.upstream)
                except OSError:
                    conn.close()
                    continue
                self._conns += [conn, up]
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Drop every connection; refuse new ones (accepted, then closed at once) until `resume`."""
        with self._lock:
            self._accepting = False
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def resume(self) -> None:
        with self._lock:
            self._accepting = True

    def close(self) -> None:
        self.cut()
        self._listener.close()


def reusable_counter(delivered: Counter[str], room: int) -> Callable[[str], None]:
    return lambda reason: delivered.update([f"reusable {room}"])


def test_a_cut_watch_stream_loses_no_outcome(start_pair: Callable[..., Pair]) -> None:
    pair = start_pair(tcp=True)
    proxy = Proxy(("127.0.0.1", int(pair.decode.tcp.rsplit(":", 1)[1])))
    layout = Layout()
    decode = Engine(proxy.address, layout, slots=8, token=pair.decode.token, name="decode")
    prefill = Engine(pair.prefill.socket, layout, slots=8, name="prefill")
    delivered: Counter[str] = Counter()
    try:
        handles = []
        for slot in range(6):
            prefill.fill(slot, 900 + slot)
            h = decode.expect(900 + slot, slot)
            h.on_terminal(lambda o: delivered.update([f"terminal {o.key.room}"]))
            h.on_reusable(reusable_counter(delivered, 900 + slot))
            handles.append(h)
        assert decode.client.watch_up
        proxy.cut()
        wait_until(lambda: not decode.client.watch_up, 5, "the client saw its stream cut")
        # While the decode engine hears nothing: five rooms complete, one is aborted by its sender.
        senders = [prefill.send(900 + slot, slot) for slot in range(5)]
        prefill.send(905, 5, chunks=1)
        assert prefill.client.abort(905, "aborted while the decode engine was cut off")
        for s in senders:
            assert s.result(timeout=10).succeeded
        assert pair.decode.wait_rooms_empty(5) == []
        assert all(h.poll() is None for h in handles), "nothing can have reached the decode engine"
        proxy.resume()
        for h in handles:
            h.terminal(timeout=10)
            h.reusable(timeout=10)
        # Engine API v2 replays what the stream missed (resume after the cursor); v1 reconciles.
        v2 = decode.client.info().api_version >= 2
        source = "watch" if v2 else "reconcile"
        for slot, h in enumerate(handles[:5]):
            got = h.terminal(timeout=0)
            assert got.succeeded and got.source == source, got
            assert decode.holds(slot, 900 + slot)
        aborted = handles[5].terminal(timeout=0)
        assert (aborted.succeeded, aborted.reason, aborted.source) == (False, "aborted_by_peer", source)
        stats = decode.client.tracking_stats
        assert stats.watch_cuts >= 1 and stats.watch_opened >= 2, stats
        assert (stats.resumes >= 1 and stats.reconciles == 0) if v2 else stats.reconciles >= 1, stats
        # A room after the stream came back is told by the stream again.
        prefill.fill(6, 906)
        after = decode.expect(906, 6)
        prefill.send(906, 6)
        got = after.result(timeout=10)
        assert got.source == "watch" and decode.holds(6, 906)
        after.reusable(timeout=10)
        time.sleep(0.2)  # anything duplicated would have been delivered by now
        expected = {f"{kind} {900 + i}": 1 for i in range(6) for kind in ("terminal", "reusable")}
        assert dict(delivered) == expected, "each outcome exactly once"
    finally:
        decode.close()
        prefill.close()
        proxy.close()


def test_a_cut_watch_stream_loses_no_outcome_asyncio(start_pair: Callable[..., Pair]) -> None:
    """With a replay log smaller than what the stream missed (v2), the cursor has expired: the client
    reconciles from ListRooms, as a v1 client always does."""
    pair = start_pair(tcp=True, watch_replay_events=16)
    proxy = Proxy(("127.0.0.1", int(pair.decode.tcp.rsplit(":", 1)[1])))
    layout = Layout(chunks=1)
    prefill = Engine(pair.prefill.socket, layout, slots=4, name="prefill")

    async def scenario() -> None:
        delivered: Counter[str] = Counter()
        async with kvgate.AsyncClient(proxy.address, token=pair.decode.token) as d:
            with kvgate.SharedPool(4 * layout.size) as pool:
                region = await d.register_pool(pool)
                handles = []
                for slot in range(4):
                    h = await d.expect(950 + slot, "prefill", layout.parts_of(region, slot * layout.size))
                    h.on_terminal(lambda o: delivered.update([f"terminal {o.key.room}"]))
                    handles.append(h)
                proxy.cut()
                deadline = time.monotonic() + 5
                while d.watch_up and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert not d.watch_up
                for slot in range(3):
                    sender = await asyncio.to_thread(prefill.send, 950 + slot, slot)
                    await asyncio.to_thread(sender.result, 10)
                await asyncio.to_thread(prefill.client.abort, 953, "cut off")
                # More events than the replay log holds: rooms of another engine of the gateway.
                await asyncio.to_thread(other_engine_rooms, pair, 12)
                await asyncio.to_thread(pair.decode.wait_rooms_empty, 5)
                proxy.resume()
                await kvgate.aio.wait_all(handles, timeout=10)
                outcomes = [await h.terminal() for h in handles]
                assert [o.succeeded for o in outcomes] == [True, True, True, False]
                assert all(o.source == "reconcile" for o in outcomes)
                assert (await handles[3].terminal()).reason == "aborted_by_peer"
                await asyncio.gather(*(h.reusable(timeout=10) for h in handles))
                assert d.tracking_stats.watch_cuts >= 1 and d.tracking_stats.reconciles >= 1
                await asyncio.sleep(0.2)
                assert delivered == Counter({f"terminal {950 + i}": 1 for i in range(4)})

    try:
        asyncio.run(scenario())
    finally:
        prefill.close()
        proxy.close()


def other_engine_rooms(pair: Pair, count: int) -> None:
    """`count` rooms expected and aborted by another engine of the decode gateway (2 events each)."""
    with kvgate.Client(pair.decode.socket) as other, kvgate.SharedPool(4096) as pool:
        region = other.register_pool(pool)
        for i in range(count):
            h = other.expect(kvgate.RoomKey(5000 + i), "prefill", [[region.slice(0, 4096)]])
            other.abort(h.key, "filler")
            h.reusable(timeout=10)
        other.unregister_memory(region)


def test_rooms_a_restarted_gateway_forgot_end_unknown_after_reconnect(pair: Pair) -> None:
    decode = Engine(pair.decode.socket, Layout(), slots=3, name="decode")
    try:
        handles = [decode.expect(990 + slot, slot) for slot in range(3)]
        pair.decode.restart()
        pair.decode.wait_ready()
        for h in handles:
            got = h.terminal(timeout=15)
            assert (got.succeeded, got.reason, got.source) == (False, kvgate.UNKNOWN_AFTER_RECONNECT, "reconcile"), got
            assert h.reusable(timeout=1) == kvgate.UNKNOWN_AFTER_RECONNECT
        assert decode.client.tracking_stats.unknown_after_reconnect == 3
        # The new gateway does not know the old registration either; registering again works.
        try:
            decode.expect(995, 0)
        except kvgate.RegionError as e:
            assert e.code == "unknown_region"
        else:
            raise AssertionError("the restarted gateway knew a region of its previous process")
        decode.region = decode.client.register_pool(decode.pool, label="again")
        assert decode.expect(996, 0).poll() is None
    finally:
        decode.close()
