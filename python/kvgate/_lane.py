"""The engine fast lane (`<engine socket>.lane`): the engine API's calls as length-prefixed protobuf
frames on the gateway's Unix socket, without HTTP/2 (gateway/proto/kvgate.proto, `LaneRequest` /
`LaneReply`; docs/internals.md, "The engine fast lane").

This module owns the lane's transport for the blocking client: one connection for the unary calls
(many in flight, replies matched by id, read by one background thread) and one connection per Watch
stream. It offers the same call surface the client uses for gRPC, a callable per method and the
Watch stream's call object, so `Client(lane=True)` changes the transport and nothing else. A refusal
arrives as `LaneCallError`, which `errors.from_rpc_error` reads exactly as it reads a gRPC error
(status, reason code, message).
"""

from __future__ import annotations

import queue
import re
import select
import socket
import struct
import threading
import time
from typing import Any, Generic, Iterator, Optional, Sequence, TypeVar

import grpc

from ._proto import kvgate_pb2 as pb

#: The lane's socket is the engine socket's path with this suffix.
LANE_SUFFIX = ".lane"
#: Every frame starts with its body's length: 4 bytes, little-endian.
LENGTH = struct.Struct("<I")
#: Largest reply frame the client accepts, in bytes (a busy gateway's `ListRooms` may be large; the
#: same bound as the gRPC channel's receive limit). A longer one ends the connection with a reason.
MAX_REPLY_FRAME_BYTES = 64 << 20
#: Bytes asked of the socket per read (one read usually carries many small frames).
READ_CHUNK_BYTES = 64 << 10
#: The metadata key that names the engine session on gRPC; on the lane it is `LaneRequest.session`.
SESSION_KEY = "kvgate-session"

Rep = TypeVar("Rep")

_STATUS_OF_CODE = {status.value[0]: status for status in grpc.StatusCode}


def lane_path(engine_socket: str) -> str:
    """The lane socket of the gateway whose engine socket is `engine_socket`."""
    return engine_socket + LANE_SUFFIX


def field_of(method: str) -> str:
    """The `LaneRequest.call` / `LaneReply.reply` field of an engine-API method (`SendBatch` -> `send_batch`)."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", method).lower()


class LaneCallError(grpc.RpcError):
    """A lane call that failed: the gateway's refusal (its gRPC status, reason code and message), or
    the connection's own failure. Read by `errors.from_rpc_error` like a gRPC error."""

    def __init__(self, status: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self._status = status
        self._reason = reason
        self._message = message

    def code(self) -> grpc.StatusCode:
        return self._status

    def details(self) -> str:
        return self._message

    # grpc-stubs types this as a tuple of `_Metadatum` objects; grpc itself returns (key, value)
    # tuples, which is what `errors.reason_of` reads.
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:  # type: ignore[override]
        return (("kvgate-reason", self._reason),)

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def error_of(reply: pb.LaneError) -> LaneCallError:
    return LaneCallError(_STATUS_OF_CODE.get(reply.code, grpc.StatusCode.UNKNOWN), reply.reason or "unknown", reply.message)


def _unavailable(message: str) -> LaneCallError:
    return LaneCallError(grpc.StatusCode.UNAVAILABLE, "unavailable", message)


def _session_of(metadata: Sequence[tuple[str, str]]) -> Optional[int]:
    for key, value in metadata:
        if key == SESSION_KEY:
            return int(value)
    return None


def watch_event(reply: pb.LaneReply) -> Optional[pb.RoomEvent]:
    """What a reply frame on a Watch connection means: its room event; None for `watch_opened`; a
    refusal is raised (`LaneCallError`)."""
    kind = reply.WhichOneof("reply")
    if kind == "error":
        raise error_of(reply.error)
    return reply.event if kind == "event" else None


def request_of(field: str, request: Any, metadata: Sequence[tuple[str, str]]) -> pb.LaneRequest:
    """The frame of a call: `request` in the `field` of `LaneRequest.call`, the session taken from the
    metadata the client would send on gRPC."""
    message = pb.LaneRequest()
    session = _session_of(metadata)
    if session is not None:
        message.session = session
    getattr(message, field).CopyFrom(request)
    return message


def answer_of(field: str, reply: pb.LaneReply) -> Any:
    """The reply message of a `field` call, or its refusal raised."""
    kind = reply.WhichOneof("reply")
    if kind == "error":
        raise error_of(reply.error)
    if kind != field:
        raise LaneCallError(grpc.StatusCode.INTERNAL, "internal", f"the gateway answered a {field} call with {kind}")
    return getattr(reply, field)


def cancelled_watch() -> LaneCallError:
    return LaneCallError(grpc.StatusCode.CANCELLED, "cancelled", "the Watch stream was cancelled")


def _frame(message: pb.LaneRequest) -> bytes:
    body: bytes = message.SerializeToString()
    return LENGTH.pack(len(body)) + body


def _connect(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise _unavailable(f"cannot connect to the engine fast lane at {path}: {e}") from None
    sock.settimeout(None)
    return sock


class _Frames:
    """Reply frames read from a socket, one at a time, with the length bound checked."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self._sock = sock
        self._path = path
        self._buf = bytearray()

    def next(self, deadline: Optional[float] = None) -> Optional[pb.LaneReply]:
        """The next reply frame; None when `deadline` (a `time.monotonic()` instant) passes first."""
        while True:
            if len(self._buf) >= LENGTH.size:
                (length,) = LENGTH.unpack_from(self._buf)
                if length > MAX_REPLY_FRAME_BYTES:
                    raise LaneCallError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "frame_too_large",
                        f"the gateway at {self._path} sent a frame of {length} bytes; the client takes at most {MAX_REPLY_FRAME_BYTES}",
                    )
                end = LENGTH.size + length
                if len(self._buf) >= end:
                    reply = pb.LaneReply.FromString(bytes(self._buf[LENGTH.size : end]))
                    del self._buf[:end]
                    return reply
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not select.select([self._sock], [], [], remaining)[0]:
                    return None
            chunk = self._sock.recv(READ_CHUNK_BYTES)
            if not chunk:
                raise _unavailable(f"the gateway closed the engine fast lane at {self._path}")
            self._buf += chunk


class _Pending:
    __slots__ = ("reply", "error")

    def __init__(self) -> None:
        self.reply: Optional[pb.LaneReply] = None
        self.error: Optional[LaneCallError] = None

    @property
    def done(self) -> bool:
        return self.reply is not None or self.error is not None


class _UnaryConnection:
    """The connection the unary calls share. Callers write whole frames under a lock, and the calling
    threads read the replies themselves: whichever waiting caller finds no one reading reads the next
    frame and hands it to the call of its id, so a lone caller reads its own reply without a thread
    hand-off. A connection that fails fails every call waiting on it (`unavailable`), and the next
    call opens a new one."""

    def __init__(self, path: str, connect_timeout: float) -> None:
        self.path = path
        self._sock = _connect(path, connect_timeout)
        self._frames = _Frames(self._sock, path)
        self._write_lock = threading.Lock()
        #: Guards `_pending`, `_reading`, `_next_id` and `failed`; notified when a reply was handed
        #: over or the reader left.
        self._cond = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._reading = False
        self._next_id = 1
        self.failed: Optional[LaneCallError] = None

    def call(self, request: pb.LaneRequest, timeout: Optional[float]) -> pb.LaneReply:
        pending = _Pending()
        with self._cond:
            if self.failed is not None:
                raise self.failed
            request.id = self._next_id
            self._next_id += 1
            self._pending[request.id] = pending
        try:
            data = _frame(request)
            with self._write_lock:
                self._sock.sendall(data)
        except OSError as e:
            self._fail(_unavailable(f"writing to the engine fast lane at {self.path} failed: {e}"))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not pending.done:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    # A reply that comes later finds no one waiting and is dropped.
                    self._pending.pop(request.id, None)
                    raise LaneCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", f"no reply within {timeout} s")
                if self._reading:
                    self._cond.wait(remaining)
                    continue
                self._reading = True
                self._cond.release()
                try:
                    reply = self._read_one(deadline)
                finally:
                    self._cond.acquire()
                    self._reading = False
                if reply is not None:
                    waiting = self._pending.pop(reply.id, None)
                    if waiting is not None:
                        waiting.reply = reply
                self._cond.notify_all()
        if pending.error is not None:
            raise pending.error
        assert pending.reply is not None
        return pending.reply

    def _read_one(self, deadline: Optional[float]) -> Optional[pb.LaneReply]:
        """The next reply frame (None: the deadline passed first); a failure fails the connection."""
        try:
            reply = self._frames.next(deadline)
            if reply is not None and reply.id == 0 and reply.WhichOneof("reply") == "error":
                # An error about the connection itself; the gateway closes it next.
                raise error_of(reply.error)
            return reply
        except LaneCallError as e:
            self._fail(e)
        except (OSError, ValueError) as e:
            self._fail(_unavailable(f"reading the engine fast lane at {self.path} failed: {e}"))
        return None

    def _fail(self, error: LaneCallError) -> None:
        with self._cond:
            if self.failed is None:
                self.failed = error
            waiting, self._pending = self._pending, {}
            for pending in waiting.values():
                pending.error = error
            self._cond.notify_all()
        self.close()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class Lane:
    """The lane of one gateway for one client: the unary calls' connection (opened on first use and
    again after a failure) and a Watch connection per stream."""

    def __init__(self, engine_socket: str, connect_timeout: float) -> None:
        self.path = lane_path(engine_socket)
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._conn: Optional[_UnaryConnection] = None
        self._closed = False

    def _connection(self) -> _UnaryConnection:
        with self._lock:
            if self._closed:
                raise LaneCallError(grpc.StatusCode.CANCELLED, "cancelled", "the client is closed")
            if self._conn is None or self._conn.failed is not None:
                self._conn = _UnaryConnection(self.path, self.connect_timeout)
            return self._conn

    def wait_ready(self, timeout: float) -> None:
        """Connect now (raises `LaneCallError` `unavailable` when nothing answers within `timeout`)."""
        with self._lock:
            if self._conn is None or self._conn.failed is not None:
                self._conn = _UnaryConnection(self.path, timeout)

    def unary(self, method: str) -> LaneUnary[Any]:
        """The callable of engine-API method `method` (`"Expect"`) on the lane."""
        return LaneUnary(self, field_of(method))

    def call(self, field: str, request: Any, timeout: Optional[float], metadata: Sequence[tuple[str, str]]) -> Any:
        return answer_of(field, self._connection().call(request_of(field, request, metadata), timeout))

    def watch(self, request: pb.WatchRequest, metadata: Sequence[tuple[str, str]] = (), **_: Any) -> LaneWatch:
        """A Watch stream on a connection of its own (the lane takes one watch per connection)."""
        return LaneWatch(self.path, request, _session_of(metadata), self.connect_timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class LaneUnary(Generic[Rep]):
    """One engine-API method on the lane, called as the client calls a gRPC method:
    `fn(request, timeout=..., metadata=...)`."""

    def __init__(self, lane: Lane, field: str) -> None:
        self._lane = lane
        self._field = field

    def __call__(self, request: Any, timeout: Optional[float] = None, metadata: Sequence[tuple[str, str]] = (), **_: Any) -> Rep:
        reply: Rep = self._lane.call(self._field, request, timeout, metadata)
        return reply


_END = object()


class LaneWatch:
    """A Watch stream on the lane, with the call surface the client uses of a gRPC stream:
    `initial_metadata()` returns once the gateway accepted it (or raises its refusal), `is_active()`,
    iteration (raises `LaneCallError` when cut; `cancelled` after `cancel()`), `cancel()`."""

    def __init__(self, path: str, request: pb.WatchRequest, session: Optional[int], connect_timeout: float) -> None:
        self.path = path
        self._events: queue.Queue[Any] = queue.Queue()
        self._opened = threading.Event()
        self._ended: Optional[LaneCallError] = None
        self._cancelled = False
        self._sock: Optional[socket.socket] = None
        try:
            self._sock = _connect(path, connect_timeout)
            message = pb.LaneRequest(id=1, watch=request)
            if session is not None:
                message.session = session
            self._sock.sendall(_frame(message))
        except (LaneCallError, OSError) as e:
            self._end(e if isinstance(e, LaneCallError) else _unavailable(str(e)))
            return
        threading.Thread(target=self._read, name=f"kvgate-lane-watch {path}", daemon=True).start()

    def _read(self) -> None:
        assert self._sock is not None
        frames = _Frames(self._sock, self.path)
        try:
            while True:
                reply = frames.next()  # no deadline: a reply, or an exception
                if reply is None:
                    continue
                event = watch_event(reply)
                if event is not None:
                    self._events.put(event)
                else:
                    self._opened.set()
        except LaneCallError as e:
            self._end(e)
        except (OSError, ValueError) as e:
            self._end(_unavailable(f"reading the Watch stream on the engine fast lane at {self.path} failed: {e}"))

    def _end(self, error: LaneCallError) -> None:
        if self._ended is None:
            self._ended = cancelled_watch() if self._cancelled else error
        self._opened.set()
        self._events.put(_END)

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        self._opened.wait()
        return ()

    def is_active(self) -> bool:
        return self._ended is None

    def __iter__(self) -> Iterator[pb.RoomEvent]:
        return self

    def __next__(self) -> pb.RoomEvent:
        item = self._events.get()
        if item is _END:
            self._events.put(_END)
            assert self._ended is not None
            raise self._ended
        event: pb.RoomEvent = item
        return event

    def cancel(self) -> None:
        self._cancelled = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        else:
            self._end(cancelled_watch())


def check_fields(methods: Sequence[str]) -> list[str]:
    """The methods that have no `LaneRequest.call` field of their name (the lane would refuse them)."""
    fields = {f.name for f in pb.LaneRequest.DESCRIPTOR.oneofs_by_name["call"].fields}
    return [m for m in methods if field_of(m) not in fields]
