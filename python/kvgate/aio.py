"""The asyncio engine-API client (grpc.aio): the same calls as `kvgate.Client`, awaited.

    async with kvgate.AsyncClient() as client:
        region = await client.register_pool(pool)
        room = await client.expect(7, peer="prefill-0", parts=[[region.slice(0, 4096)]])
        outcome = await room.terminal(timeout=30)

Use a client from the event loop it was made in. Its rooms are fed by one Watch stream (outcomes
only), read by a task of that loop and, after any cut, resumed or reconciled (`kvgate.rooms`).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, Sequence, TypeVar

import grpc
import grpc.aio

from . import _channel, _lane_aio, errors
from .fd_pass import pass_fd
from ._proto import kvgate_pb2 as pb
from .client import (
    CONNECT_TIMEOUT_S,
    RECONNECT_PAUSE_MAX_S,
    RECONNECT_PAUSE_S,
    _expect_request,
    _register_cuda_request,
    _register_cuda_vmm_request,
    _register_fd_request,
    _register_shared_request,
    _send_request,
    _watch_request,
    batch_errors,
    session_name_of,
    shared_file_length,
)
from .errors import GatewayUnavailable, KvgateError, RoomError, SessionError, from_rpc_error
from .memory import SharedPool, cuda_ipc_export
from .rooms import AsyncRoomHandle, RoomTable, TrackingStats
from .types import (
    RECEIVER,
    ROLES,
    SENDER,
    Chunk,
    ChunkSend,
    Expectation,
    GatewayInfo,
    Region,
    RoomEvent,
    RoomInfo,
    RoomKey,
    RoomKeyLike,
    Slice,
    event_of,
    info_of,
    key_pb,
    room_key,
)

T = TypeVar("T")


class AsyncClient:
    """A connection to one gateway's engine API for asyncio code. Arguments as `kvgate.Client`
    (`lane=True`: every call on the gateway's engine fast lane)."""

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        session: str | bool = True,
        timeout: float | None = _channel.DEFAULT_TIMEOUT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        lane: bool = False,
    ) -> None:
        self.target = _channel.parse_target(target)
        if lane and not self.target.is_unix:
            raise ValueError(f"the engine fast lane is a Unix socket beside the engine socket; {self.target} is a TCP address")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.session_name = session_name_of(session)
        self.session_id: int | None = None
        self._token = _channel.read_token(token, token_file)
        self._metadata = _channel.call_metadata(self._token)
        self._api: GatewayInfo | None = None
        self._start_lock = asyncio.Lock()
        self._started = False
        self._channel = grpc.aio.insecure_channel(self.target.grpc_target, options=_channel.channel_options(self.target))
        m = _channel.METHOD
        ch = self._channel
        self._lane = _lane_aio.AioLane(self.target.unix_path, connect_timeout) if lane else None
        on_lane = self._lane

        def unary(name: str) -> Any:
            if on_lane is not None:
                return on_lane.unary(name)
            return ch.unary_unary(m[name].path, request_serializer=m[name].request.SerializeToString, response_deserializer=m[name].reply.FromString)

        self._open_session_rpc: Callable[..., Awaitable[pb.OpenSessionReply]] = unary("OpenSession")
        self._close_session_rpc: Callable[..., Awaitable[pb.CloseSessionReply]] = unary("CloseSession")
        self._info: Callable[..., Awaitable[pb.InfoReply]] = unary("Info")
        self._register: Callable[..., Awaitable[pb.RegisterMemoryReply]] = unary("RegisterMemory")
        self._unregister: Callable[..., Awaitable[pb.UnregisterMemoryReply]] = unary("UnregisterMemory")
        self._expect: Callable[..., Awaitable[pb.ExpectReply]] = unary("Expect")
        self._send: Callable[..., Awaitable[pb.SendReply]] = unary("Send")
        self._send_batch: Callable[..., Awaitable[pb.BatchReply]] = unary("SendBatch")
        self._expect_batch: Callable[..., Awaitable[pb.BatchReply]] = unary("ExpectBatch")
        self._abort: Callable[..., Awaitable[pb.AbortReply]] = unary("Abort")
        self._get_room: Callable[..., Awaitable[pb.RoomInfo]] = unary("GetRoom")
        self._list_rooms: Callable[..., Awaitable[pb.ListRoomsReply]] = unary("ListRooms")
        self._watch: Callable[..., Any] = (
            on_lane.watch
            if on_lane is not None
            else ch.unary_stream(m["Watch"].path, request_serializer=pb.WatchRequest.SerializeToString, response_deserializer=pb.RoomEvent.FromString)
        )
        self._tracker = _AsyncTracker(self)
        self._closed = False

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self, *, end_session: bool = True) -> None:
        """See `kvgate.Client.close`."""
        if self._closed:
            return
        self._closed = True
        if end_session and self.session_id is not None:
            try:
                await self._call(self._close_session_rpc, pb.CloseSessionRequest(session=self.session_id), timeout=5)
            except KvgateError:
                pass
        await self._tracker.close()
        if self._lane is not None:
            await self._lane.close()
        await self._channel.close(None)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the gateway accepts a connection (raises `GatewayUnavailable` after `timeout`)."""
        wait = timeout if timeout is not None else self.connect_timeout
        if self._lane is not None:
            try:
                await self._lane.wait_ready(wait)
            except grpc.RpcError as e:
                raise GatewayUnavailable("unavailable", f"no gateway answered on the engine fast lane {self._lane.path} within {wait} s: {e}") from None
            return
        try:
            await asyncio.wait_for(self._channel.channel_ready(), wait)
        except asyncio.TimeoutError:
            raise GatewayUnavailable("unavailable", f"no gateway answered at {self.target} within {wait} s") from None

    async def _call(self, fn: Callable[..., Awaitable[T]], request: Any, timeout: float | None = None) -> T:
        try:
            return await fn(request, timeout=timeout if timeout is not None else self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
            if error.code == "unknown_session":
                self._session_lost()
            raise error from None

    async def _ready(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if self._started:
                return
            if (await self.info()).api_version >= 2 and self.session_name:
                await self._open_session()
            await self._tracker.ensure_started()
            self._started = True

    async def _open_session(self) -> bool:
        """See `kvgate.Client._open_session`."""
        previous = self.session_id
        try:
            reply = await self._open_session_rpc(
                pb.OpenSessionRequest(name=self.session_name or ""), timeout=self.timeout, metadata=_channel.call_metadata(self._token)
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        self.session_id = reply.session
        self._metadata = _channel.call_metadata(self._token, reply.session)
        return reply.resumed and previous == reply.session

    def _session_lost(self) -> None:
        self.session_id = None
        self._metadata = _channel.call_metadata(self._token)

    async def info(self, refresh: bool = False) -> GatewayInfo:
        """See `kvgate.Client.info`."""
        if self._api is None or refresh:
            try:
                reply = await self._info(pb.InfoRequest(), timeout=self.timeout, metadata=self._metadata)
                self._api = GatewayInfo(reply.api_version, reply.gateway, tuple(reply.plugins))
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                if error.status != "UNIMPLEMENTED":
                    raise error from None
                self._api = GatewayInfo(1)
        return self._api

    # -- memory ---------------------------------------------------------------------------------

    async def register_shared_memory(self, path: str | os.PathLike[str], *, offset: int = 0, length: int | None = None, label: str = "") -> Region:
        await self._ready()
        path = os.fspath(path)
        length = shared_file_length(path, offset, length)
        reply = await self._call(self._register, _register_shared_request(path, offset, length, label))
        return Region(reply.region, length, tuple(reply.plugins), label)

    async def register_pool(self, pool: SharedPool, *, label: str = "") -> Region:
        """Register a whole `SharedPool`."""
        return await self.register_shared_memory(pool.path, offset=pool.offset, length=pool.size, label=label)

    async def register_fd(self, fd: int, *, length: int, offset: int = 0, label: str = "") -> Region:
        """See `kvgate.Client.register_fd` (the descriptor is passed in a worker thread)."""
        await self._ready()
        if self.target.unix_path is None:
            raise errors.InvalidRequest("missing_field", "register_fd needs the gateway's Unix socket (a descriptor cannot cross TCP)")
        token = await asyncio.to_thread(pass_fd, self.target.unix_path, fd)
        reply = await self._call(self._register, _register_fd_request(token, offset, length, label))
        return Region(reply.region, length, tuple(reply.plugins), label)

    async def register_cuda_vmm_fd(self, fd: int, *, device: int, length: int, allocation_size: int, offset: int = 0, label: str = "") -> Region:
        """See `kvgate.Client.register_cuda_vmm_fd` (the descriptor is passed in a worker thread)."""
        await self._ready()
        if self.target.unix_path is None:
            raise errors.InvalidRequest("missing_field", "register_cuda_vmm_fd needs the gateway's Unix socket (a descriptor cannot cross TCP)")
        token = await asyncio.to_thread(pass_fd, self.target.unix_path, fd)
        reply = await self._call(self._register, _register_cuda_vmm_request(token, device, offset, length, allocation_size, label))
        return Region(reply.region, length, tuple(reply.plugins), label)

    async def register_cuda_ipc(self, device: int, ipc_handle: bytes, length: int, *, label: str = "", base: int = 0) -> Region:
        await self._ready()
        reply = await self._call(self._register, _register_cuda_request(device, ipc_handle, length, label))
        return Region(reply.region, length, tuple(reply.plugins), label, base)

    async def register_cuda_tensor(self, tensor: Any, *, label: str = "") -> Region:
        """See `kvgate.Client.register_cuda_tensor`."""
        export = cuda_ipc_export(tensor)
        return await self.register_cuda_ipc(export.device, export.handle, export.length, label=label, base=export.base)

    async def unregister_memory(self, region: Region | int) -> None:
        region_id = region.id if isinstance(region, Region) else region
        await self._call(self._unregister, pb.UnregisterMemoryRequest(region=region_id))

    # -- rooms ----------------------------------------------------------------------------------

    async def expect(
        self,
        key: RoomKeyLike,
        peer: str,
        parts: Sequence[Sequence[Slice]],
        *,
        timeout_ms: int = 0,
        source_kinds: Sequence[str] = (),
        part_peers: Sequence[str] = (),
    ) -> AsyncRoomHandle:
        """See `kvgate.Client.expect`."""
        await self._ready()
        k = room_key(key)
        handle = await self._tracker.begin(k, RECEIVER)
        try:
            await self._call(self._expect, _expect_request(k, peer, parts, timeout_ms, source_kinds, part_peers))
        except KvgateError:
            self._tracker.table.forget(handle)
            raise
        self._tracker.table.confirm(handle)
        return handle

    async def send(
        self, key: RoomKeyLike, part: int, chunk: int, slices: Sequence[Slice], *, last: bool = False, peer: str = "", offset: Optional[int] = None
    ) -> AsyncRoomHandle:
        await self._ready()
        k = room_key(key)
        handle = await self._tracker.begin(k, SENDER)
        try:
            await self._call(self._send, _send_request(k, part, chunk, slices, last, peer, offset))
        except KvgateError:
            self._tracker.table.forget(handle)
            raise
        self._tracker.table.confirm(handle)
        return handle

    async def send_chunks(self, key: RoomKeyLike, chunks: Iterable[Chunk], *, peer: str = "") -> AsyncRoomHandle:
        """Several chunks of one room in one call (`SendBatch`; on a v1 gateway one call per chunk, the
        parts side by side). The first refusal is raised; the chunks accepted stay accepted."""
        k = room_key(key)
        results = await self.send_batch([ChunkSend(k, c.part, c.chunk, c.slices, c.last, peer, c.offset) for c in chunks])
        if not results:
            raise ValueError("send_chunks needs at least one chunk")
        for result in results:
            if isinstance(result, KvgateError):
                raise result
        first = results[0]
        assert isinstance(first, AsyncRoomHandle)
        return first

    async def send_batch(self, sends: Sequence[ChunkSend]) -> list[AsyncRoomHandle | KvgateError]:
        """See `kvgate.Client.send_batch`. On a v1 gateway the sends of different parts or rooms go side
        by side, those of one part in order."""
        await self._ready()
        keys = [room_key(s.key) for s in sends]
        handles = {k: await self._tracker.begin(k, SENDER) for k in keys}
        if (await self.info()).api_version >= 2:
            request = pb.SendBatchRequest(sends=[_send_request(k, s.part, s.chunk, s.slices, s.last, s.peer, s.offset) for k, s in zip(keys, sends)])
            errors = batch_errors(await self._call(self._send_batch, request), len(sends))
        else:
            errors = await self._one_by_one_sends(keys, sends)
        return self._settle(keys, handles, errors)

    async def _one_by_one_sends(self, keys: list[RoomKey], sends: Sequence[ChunkSend]) -> list[KvgateError | None]:
        errors: list[KvgateError | None] = [None] * len(sends)
        lanes: dict[tuple[RoomKey, int], list[int]] = {}
        for i, (k, s) in enumerate(zip(keys, sends)):
            lanes.setdefault((k, s.part), []).append(i)

        async def lane(indices: list[int]) -> None:
            for i in indices:
                s = sends[i]
                try:
                    await self._call(self._send, _send_request(keys[i], s.part, s.chunk, s.slices, s.last, s.peer, s.offset))
                except KvgateError as e:
                    errors[i] = e

        await asyncio.gather(*(lane(indices) for indices in lanes.values()))
        return errors

    async def expect_batch(self, expects: Sequence[Expectation]) -> list[AsyncRoomHandle | KvgateError]:
        """See `kvgate.Client.expect_batch`."""
        await self._ready()
        keys = [room_key(e.key) for e in expects]
        handles = {k: await self._tracker.begin(k, RECEIVER) for k in keys}
        if (await self.info()).api_version >= 2:
            request = pb.ExpectBatchRequest(expects=[_expect_request(k, e.peer, e.parts, e.timeout_ms, e.source_kinds, e.part_peers) for k, e in zip(keys, expects)])
            errors = batch_errors(await self._call(self._expect_batch, request), len(expects))
        else:

            async def one(k: RoomKey, e: Expectation) -> KvgateError | None:
                try:
                    await self._call(self._expect, _expect_request(k, e.peer, e.parts, e.timeout_ms, e.source_kinds, e.part_peers))
                except KvgateError as error:
                    return error
                return None

            errors = list(await asyncio.gather(*(one(k, e) for k, e in zip(keys, expects))))
        return self._settle(keys, handles, errors)

    def _settle(self, keys: list[RoomKey], handles: dict[RoomKey, AsyncRoomHandle], errors: Sequence[KvgateError | None]) -> list[AsyncRoomHandle | KvgateError]:
        accepted = {k for k, e in zip(keys, errors) if e is None}
        for k, handle in handles.items():
            if k in accepted:
                self._tracker.table.confirm(handle)
            else:
                self._tracker.table.forget(handle)
        return [handles[k] if e is None else e for k, e in zip(keys, errors)]

    async def abort(self, key: RoomKeyLike, why: str = "") -> bool:
        reply = await self._call(self._abort, pb.AbortRequest(key=key_pb(room_key(key)), why=why))
        return reply.was_live

    async def room(self, key: RoomKeyLike) -> RoomInfo:
        return info_of(await self._call(self._get_room, pb.GetRoomRequest(key=key_pb(room_key(key)))))

    async def rooms(self, include_terminal: bool = False) -> list[RoomInfo]:
        reply = await self._call(self._list_rooms, pb.ListRoomsRequest(include_terminal=include_terminal))
        return [info_of(r) for r in reply.rooms]

    async def _rooms_at(self, include_terminal: bool) -> tuple[list[RoomInfo], int]:
        reply = await self._call(self._list_rooms, pb.ListRoomsRequest(include_terminal=include_terminal))
        return [info_of(r) for r in reply.rooms], reply.seq

    async def track(self, key: RoomKeyLike, role: str) -> AsyncRoomHandle:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        await self._ready()
        k = room_key(key)
        handle = await self._tracker.begin(k, role)
        if handle.poll() is None:
            await self._tracker.check(handle)
        return handle

    def handle(self, key: RoomKeyLike, role: str) -> AsyncRoomHandle | None:
        return self._tracker.table.get(room_key(key), role)

    async def watch(self, key: RoomKeyLike | None = None, *, outcomes_only: bool = False) -> AsyncWatchStream:
        """A Watch stream of its own, open when this returns; see `kvgate.Client.watch`."""
        request = pb.WatchRequest(outcomes_only=outcomes_only)
        if key is not None:
            request.key.CopyFrom(key_pb(room_key(key)))
        call: Any = self._watch(request, metadata=self._metadata)
        try:
            await asyncio.wait_for(call.initial_metadata(), self.connect_timeout)
        except asyncio.TimeoutError:
            call.cancel()
            raise GatewayUnavailable("unavailable", f"the Watch stream did not open within {self.connect_timeout} s") from None
        return AsyncWatchStream(call)

    @property
    def tracking_stats(self) -> TrackingStats:
        stats = self._tracker.table.stats
        stats.tracked_live = len(self._tracker.table)
        return stats

    @property
    def watch_up(self) -> bool:
        return self._tracker.up


class AsyncWatchStream:
    """An open Watch stream: `async for` its `RoomEvent`s; ends on `close()`, or with the error that cut it."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._events: AsyncIterator[pb.RoomEvent] = call.__aiter__()

    def __aiter__(self) -> AsyncWatchStream:
        return self

    async def __anext__(self) -> RoomEvent:
        try:
            return event_of(await self._events.__anext__())
        except grpc.RpcError as e:
            error = from_rpc_error(e)
            if error.code == "cancelled":
                raise StopAsyncIteration from None
            raise error from None
        except asyncio.CancelledError:
            if self._call.cancelled():
                raise StopAsyncIteration from None
            raise

    async def __aenter__(self) -> AsyncWatchStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._call.cancel()


class _AsyncTracker:
    """The client's one Watch stream (outcomes only), read by a task, and its rooms. Mirrors
    `kvgate.client._Tracker`: see it for the reconnect rule."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.table: RoomTable[AsyncRoomHandle] = RoomTable()
        self.up = False
        self.cursor = 0
        self._task: asyncio.Task[None] | None = None
        self._established: asyncio.Event | None = None
        self._closed = False
        self._call: Any = None
        self._last_error = ""

    async def begin(self, key: RoomKey, role: str) -> AsyncRoomHandle:
        await self.ensure_started()
        loop = asyncio.get_running_loop()
        handle, _ = self.table.track(key, role, lambda: AsyncRoomHandle(key, role, loop))
        return handle

    async def ensure_started(self) -> None:
        if self._established is not None and self._established.is_set():
            return
        if self._task is None:
            self._established = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kvgate-watch {self.client.target}")
        assert self._established is not None
        try:
            await asyncio.wait_for(self._established.wait(), self.client.connect_timeout)
        except asyncio.TimeoutError:
            raise GatewayUnavailable(
                "unavailable", f"cannot open the Watch stream of {self.client.target} within {self.client.connect_timeout} s: {self._last_error or 'no answer'}"
            ) from None

    async def close(self) -> None:
        self._closed = True
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def check(self, handle: AsyncRoomHandle) -> None:
        try:
            info = await self.client.room(handle.key)
        except RoomError as e:
            if e.code == "unknown_room":
                return
            raise
        self.table.confirm(handle)
        if info.role == handle.role:
            self.table.reconcile_listing([handle], [info])
        else:
            listing = await self.client.rooms(include_terminal=True)
            self.table.reconcile_listing([handle], [r for r in listing if r.key == handle.key])

    async def _open(self, after_seq: int | None) -> Any:
        call: Any = self.client._watch(_watch_request(after_seq), metadata=self.client._metadata, wait_for_ready=True)
        self._call = call
        try:
            # Returns once the gateway answered the call: from then on every event reaches this stream.
            await call.initial_metadata()
            if call.done():
                async for _ in call:
                    pass
                raise GatewayUnavailable("unavailable", "the Watch stream ended as it opened")
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return call

    async def _connect(self, first: bool) -> Any:
        """See `kvgate.client._Tracker._connect`."""
        client = self.client
        api = (await client.info(refresh=not first)).api_version
        if api < 2:
            call = await self._open(None)
            if not first:
                await self._reconcile((await client._rooms_at(include_terminal=True))[0])
            return call
        if first:
            _, self.cursor = await client._rooms_at(include_terminal=False)
            return await self._open_after_cursor()
        if client.session_name and await client._open_session():
            self.table.stats.resumes += 1
            return await self._open_after_cursor()
        return await self._reconcile_then_open()

    async def _open_after_cursor(self) -> Any:
        try:
            return await self._open(self.cursor)
        except KvgateError as e:
            if e.code != "watch_cursor_expired":
                raise
            return await self._reconcile_then_open()

    async def _reconcile_then_open(self) -> Any:
        rooms, seq = await self.client._rooms_at(include_terminal=True)
        await self._reconcile(rooms)
        self.cursor = seq
        return await self._open(seq)

    async def _reconcile(self, rooms: list[RoomInfo]) -> None:
        snapshot = self.table.snapshot()
        for handle in self.table.reconcile_listing(snapshot, rooms):
            try:
                info: RoomInfo | None = await self.client.room(handle.key)
            except RoomError as e:
                if e.code != "unknown_room":
                    raise
                info = None
            self.table.reconcile_lookup(handle, info)

    async def _run(self) -> None:
        pause = RECONNECT_PAUSE_S
        first = True
        assert self._established is not None
        while not self._closed:
            try:
                call = await self._connect(first)
                first = False
                self.table.stats.watch_opened += 1
                self.up = True
                self._established.set()
                pause = RECONNECT_PAUSE_S
                async for message in call:
                    if message.seq:
                        if message.seq <= self.cursor:
                            continue
                        self.cursor = message.seq
                    self.table.on_event(message)
                cut = "the gateway ended the Watch stream"
            except grpc.RpcError as e:
                cut = str(from_rpc_error(e))
            except SessionError as e:
                cut = str(e)
                if e.code == "unknown_session":
                    self.client._session_lost()
                # `session_in_use`: the gateway has not yet seen the old stream end; try again.
            except KvgateError as e:
                cut = str(e)
            finally:
                if self.up:
                    self.table.stats.watch_cuts += 1
                self.up = False
            self._last_error = cut
            if self._closed:
                break
            self.table.stats.last_cut = cut
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECONNECT_PAUSE_MAX_S)


async def wait_all(handles: Iterable[AsyncRoomHandle], timeout: float | None = None) -> list[AsyncRoomHandle]:
    """Wait until every handle is terminal (raises `TimeoutError` past `timeout` seconds)."""
    items = list(handles)
    try:
        await asyncio.wait_for(asyncio.gather(*(h.terminal() for h in items)), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{sum(1 for h in items if not h.done)} of {len(items)} rooms not terminal within {timeout} s") from None
    return items
