"""The engine fast lane for the asyncio client (`AsyncClient(lane=True)`): the same frames as
`kvgate._lane`, on asyncio Unix-socket streams. One connection carries the unary calls (a reader
task hands each reply to the future of its id); each Watch stream has a connection of its own. The
call surface is the one the asyncio client uses of grpc.aio: an awaitable callable per method, and
a Watch call object (`initial_metadata()`, `done()`, `cancelled()`, `cancel()`, `async for`).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional, Sequence

import grpc

from ._lane import (
    LENGTH,
    LaneCallError,
    _frame,
    _session_of,
    _unavailable,
    answer_of,
    cancelled_watch,
    error_of,
    field_of,
    lane_path,
    request_of,
    watch_event,
)
from . import _lane
from ._proto import kvgate_pb2 as pb


async def _open(path: str, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        return await asyncio.wait_for(asyncio.open_unix_connection(path), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise _unavailable(f"cannot connect to the engine fast lane at {path}: {e or 'timed out'}") from None


async def _read_frame(reader: asyncio.StreamReader, path: str) -> pb.LaneReply:
    try:
        prefix = await reader.readexactly(LENGTH.size)
        (length,) = LENGTH.unpack(prefix)
        if length > _lane.MAX_REPLY_FRAME_BYTES:
            raise LaneCallError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "frame_too_large",
                f"the gateway at {path} sent a frame of {length} bytes; the client takes at most {_lane.MAX_REPLY_FRAME_BYTES}",
            )
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise _unavailable(f"the gateway closed the engine fast lane at {path}") from None
    return pb.LaneReply.FromString(body)


class _Connection:
    """The unary calls' connection: a reader task resolves each call's future by id; a failure fails
    every waiting call (`unavailable`) and the next call opens a new connection."""

    def __init__(self, path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.path = path
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future[pb.LaneReply]] = {}
        self._next_id = 1
        self.failed: Optional[LaneCallError] = None
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def call(self, request: pb.LaneRequest, timeout: Optional[float]) -> pb.LaneReply:
        if self.failed is not None:
            raise self.failed
        request.id = self._next_id
        self._next_id += 1
        future: asyncio.Future[pb.LaneReply] = asyncio.get_running_loop().create_future()
        self._pending[request.id] = future
        try:
            self._writer.write(_frame(request))
            await self._writer.drain()
        except OSError as e:
            self._fail(_unavailable(f"writing to the engine fast lane at {self.path} failed: {e}"))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise LaneCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", f"no reply within {timeout} s") from None
        finally:
            # A reply that comes later finds no one waiting and is dropped.
            self._pending.pop(request.id, None)

    async def _read(self) -> None:
        try:
            while True:
                reply = await _read_frame(self._reader, self.path)
                future = self._pending.pop(reply.id, None)
                if future is not None and not future.done():
                    future.set_result(reply)
                elif reply.id == 0 and reply.WhichOneof("reply") == "error":
                    raise error_of(reply.error)
        except LaneCallError as e:
            self._fail(e)
        except (OSError, ValueError) as e:
            self._fail(_unavailable(f"reading the engine fast lane at {self.path} failed: {e}"))

    def _fail(self, error: LaneCallError) -> None:
        if self.failed is None:
            self.failed = error
        waiting, self._pending = self._pending, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
        self.close()

    def close(self) -> None:
        self._writer.close()
        if not self._task.done() and self._task is not asyncio.current_task():
            self._task.cancel()


class AioLane:
    """The lane of one gateway for one asyncio client."""

    def __init__(self, engine_socket: str, connect_timeout: float) -> None:
        self.path = lane_path(engine_socket)
        self.connect_timeout = connect_timeout
        self._conn: Optional[_Connection] = None
        self._connecting = asyncio.Lock()
        self._closed = False

    async def _connection(self, timeout: Optional[float] = None) -> _Connection:
        async with self._connecting:
            if self._closed:
                raise LaneCallError(grpc.StatusCode.CANCELLED, "cancelled", "the client is closed")
            if self._conn is None or self._conn.failed is not None:
                reader, writer = await _open(self.path, timeout if timeout is not None else self.connect_timeout)
                self._conn = _Connection(self.path, reader, writer)
            return self._conn

    async def wait_ready(self, timeout: float) -> None:
        await self._connection(timeout)

    def unary(self, method: str) -> AioLaneUnary:
        return AioLaneUnary(self, field_of(method))

    async def call(self, field: str, request: Any, timeout: Optional[float], metadata: Sequence[tuple[str, str]]) -> Any:
        reply = await (await self._connection()).call(request_of(field, request, metadata), timeout)
        return answer_of(field, reply)

    def watch(self, request: pb.WatchRequest, metadata: Sequence[tuple[str, str]] = (), **_: Any) -> AioLaneWatch:
        return AioLaneWatch(self.path, request, _session_of(metadata), self.connect_timeout)

    async def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class AioLaneUnary:
    """One engine-API method on the lane, awaited as the asyncio client awaits a grpc.aio method."""

    def __init__(self, lane: AioLane, field: str) -> None:
        self._lane = lane
        self._field = field

    async def __call__(self, request: Any, timeout: Optional[float] = None, metadata: Sequence[tuple[str, str]] = (), **_: Any) -> Any:
        return await self._lane.call(self._field, request, timeout, metadata)


class AioLaneWatch:
    """A Watch stream on the lane with the surface of a grpc.aio stream call: `await
    initial_metadata()` (returns once the gateway accepted it; a refusal ends the call),
    `done()`, `cancelled()`, `cancel()`, and `async for` (raises `LaneCallError` when cut)."""

    def __init__(self, path: str, request: pb.WatchRequest, session: Optional[int], connect_timeout: float) -> None:
        self.path = path
        self._events: asyncio.Queue[pb.RoomEvent | LaneCallError] = asyncio.Queue()
        self._opened = asyncio.Event()
        self._ended: Optional[LaneCallError] = None
        self._cancelled = False
        self._writer: Optional[asyncio.StreamWriter] = None
        message = pb.LaneRequest(id=1, watch=request)
        if session is not None:
            message.session = session
        self._task = asyncio.get_running_loop().create_task(self._run(message, connect_timeout))

    async def _run(self, message: pb.LaneRequest, connect_timeout: float) -> None:
        try:
            reader, self._writer = await _open(self.path, connect_timeout)
            self._writer.write(_frame(message))
            await self._writer.drain()
            while True:
                event = watch_event(await _read_frame(reader, self.path))
                if event is not None:
                    self._events.put_nowait(event)
                else:
                    self._opened.set()
        except LaneCallError as e:
            self._end(e)
        except (OSError, ValueError) as e:
            self._end(_unavailable(f"reading the Watch stream on the engine fast lane at {self.path} failed: {e}"))
        except asyncio.CancelledError:
            self._end(cancelled_watch())

    def _end(self, error: LaneCallError) -> None:
        if self._ended is None:
            self._ended = cancelled_watch() if self._cancelled else error
            self._events.put_nowait(self._ended)
        self._opened.set()
        if self._writer is not None:
            self._writer.close()

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        await self._opened.wait()
        return ()

    def done(self) -> bool:
        return self._ended is not None

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        self._cancelled = True
        self._task.cancel()
        return True

    def __aiter__(self) -> AsyncIterator[pb.RoomEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[pb.RoomEvent]:
        while True:
            item = await self._events.get()
            if isinstance(item, LaneCallError):
                self._events.put_nowait(item)
                if item.code() == grpc.StatusCode.CANCELLED and self._cancelled:
                    return
                raise item
            yield item
