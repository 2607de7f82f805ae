"""The blocking engine-API client.

    import kvgate
    with kvgate.Client() as client:                     # kvgate.default_socket()
        region = client.register_pool(pool)
        room = client.expect(7, peer="prefill-0", parts=[[region.slice(0, 4096)]])
        outcome = room.terminal(timeout=30)

Every call returns or raises a `KvgateError` subclass carrying the gateway's reason code. Rooms that
the client creates (`expect`, `send`) or asks for (`track`) get a `RoomHandle`, fed by the client's
one Watch stream (outcomes only), which a background thread reads and, after any cut, resumes or
reconciles (see `kvgate.rooms` and README, "Outcomes and the Watch stream").

With a gateway of engine API v2 the client also opens an engine session (`session=`): its regions
and rooms belong to it, and if the engine goes away (its Watch stream gone for the gateway's
`session_grace_ms`) its live rooms fail `engine_lost` and its memory is released.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import grpc

from . import _channel, _lane, errors
from .fd_pass import pass_fd
from ._proto import kvgate_pb2 as pb
from .errors import GatewayUnavailable, KvgateError, RoomError, SessionError, from_reason, from_rpc_error
from .memory import SharedPool, cuda_ipc_export
from .rooms import RoomHandle, RoomTable, TrackingStats
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
    slices_pb,
)

T = TypeVar("T")

#: How long the first Watch stream may take to open (the gateway must answer within it).
CONNECT_TIMEOUT_S = 5.0
#: Pause between two attempts to open the Watch stream again (doubling up to the maximum).
RECONNECT_PAUSE_S = 0.05
RECONNECT_PAUSE_MAX_S = 1.0


def _send_request(
    key: RoomKey, part: int, chunk: int, slices: Iterable[Slice], last: bool, peer: str, offset: Optional[int] = None
) -> pb.SendRequest:
    request = pb.SendRequest(key=key_pb(key), part=part, chunk=chunk, slices=slices_pb(slices), last=last, peer=peer)
    if offset is not None:
        request.offset = offset
    return request


def _expect_request(
    key: RoomKey,
    peer: str,
    parts: Sequence[Sequence[Slice]],
    timeout_ms: int,
    source_kinds: Sequence[str] = (),
    part_peers: Sequence[str] = (),
) -> pb.ExpectRequest:
    kinds = list(source_kinds) + [""] * max(0, len(parts) - len(source_kinds))
    return pb.ExpectRequest(
        key=key_pb(key),
        peer=peer,
        parts=[pb.PartSlices(slices=slices_pb(p), source_kind=kind) for p, kind in zip(parts, kinds)],
        # 0: the field is left unset, so the gateway applies its `room_timeout_ms`.
        timeout_ms=timeout_ms or None,
        part_peers=list(part_peers),
    )


def _register_shared_request(path: str, offset: int, length: int, label: str) -> pb.RegisterMemoryRequest:
    return pb.RegisterMemoryRequest(shared_memory=pb.SharedMemoryFile(path=path, offset=offset, len=length), label=label)


def _register_fd_request(token: int, offset: int, length: int, label: str) -> pb.RegisterMemoryRequest:
    return pb.RegisterMemoryRequest(passed_fd=pb.PassedFdMemory(token=token, offset=offset, len=length), label=label)


def _register_cuda_vmm_request(token: int, device: int, offset: int, length: int, allocation_size: int, label: str) -> pb.RegisterMemoryRequest:
    memory = pb.CudaVmmFdMemory(token=token, device=device, offset=offset, len=length, allocation_size=allocation_size)
    return pb.RegisterMemoryRequest(cuda_vmm_fd=memory, label=label)


def _register_cuda_request(device: int, handle: bytes, length: int, label: str) -> pb.RegisterMemoryRequest:
    return pb.RegisterMemoryRequest(cuda_ipc=pb.CudaIpcMemory(device=device, ipc_handle=handle, len=length), label=label)


def _watch_request(after_seq: int | None) -> pb.WatchRequest:
    request = pb.WatchRequest(outcomes_only=True)
    if after_seq is not None:
        request.after_seq = after_seq
    return request


def shared_file_length(path: str, offset: int, length: int | None) -> int:
    if length is not None:
        return length
    return os.stat(path).st_size - offset


def session_name_of(session: str | bool | None) -> str | None:
    if session is True:
        return _channel.auto_session_name()
    return session or None


def batch_errors(reply: pb.BatchReply, count: int) -> list[KvgateError | None]:
    """One entry per call of a batch: None (accepted) or its refusal."""
    out: list[KvgateError | None] = [None if not r.reason else from_reason(r.reason, r.message) for r in reply.results]
    return out + [from_reason("missing_result", "the gateway answered fewer results than calls")] * (count - len(out))


class Client:
    """A connection to one gateway's engine API (thread-safe; one per engine process is enough).

    `target`: a Unix socket path (default `$KVGATE_ENGINE_API`, else the gateway's default socket,
    `kvgate.default_socket()`: `$XDG_RUNTIME_DIR/kvgate/engine.sock` or `/tmp/kvgate-<uid>/engine.sock`), or
    `host:port` / `tcp://host:port` for the TCP engine API with `token` (or `token_file`).
    `session`: the engine session's name (True: one made up for this process; False: none). Used
    when the gateway speaks engine API v2; opened with the first call that registers memory or
    posts a room, and closed by `close()` (its live rooms then fail `engine_lost`).
    `timeout`: the deadline of each unary call, in seconds.
    `lane`: make every call on the gateway's engine fast lane (`<socket>.lane`: the same calls as
    length-prefixed frames without HTTP/2, far cheaper per call) instead of gRPC; Unix sockets only.
    """

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
        self._start_lock = threading.Lock()
        self._session_lock = threading.Lock()
        self._started = False
        self._channel = grpc.insecure_channel(self.target.grpc_target, options=_channel.channel_options(self.target))
        m = _channel.METHOD
        ch = self._channel
        self._lane = _lane.Lane(self.target.unix_path, connect_timeout) if lane else None
        on_lane = self._lane

        def unary(name: str) -> Any:
            if on_lane is not None:
                return on_lane.unary(name)
            return ch.unary_unary(m[name].path, request_serializer=m[name].request.SerializeToString, response_deserializer=m[name].reply.FromString)

        self._open_session_rpc: Callable[..., pb.OpenSessionReply] = unary("OpenSession")
        self._close_session_rpc: Callable[..., pb.CloseSessionReply] = unary("CloseSession")
        self._info: Callable[..., pb.InfoReply] = unary("Info")
        self._register: Callable[..., pb.RegisterMemoryReply] = unary("RegisterMemory")
        self._unregister: Callable[..., pb.UnregisterMemoryReply] = unary("UnregisterMemory")
        self._expect: Callable[..., pb.ExpectReply] = unary("Expect")
        self._send: Callable[..., pb.SendReply] = unary("Send")
        self._send_batch: Callable[..., pb.BatchReply] = unary("SendBatch")
        self._expect_batch: Callable[..., pb.BatchReply] = unary("ExpectBatch")
        self._abort: Callable[..., pb.AbortReply] = unary("Abort")
        self._get_room: Callable[..., pb.RoomInfo] = unary("GetRoom")
        self._list_rooms: Callable[..., pb.ListRoomsReply] = unary("ListRooms")
        self._watch: Callable[..., Any] = (
            on_lane.watch
            if on_lane is not None
            else ch.unary_stream(m["Watch"].path, request_serializer=pb.WatchRequest.SerializeToString, response_deserializer=pb.RoomEvent.FromString)
        )
        self._tracker = _Tracker(self)
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, end_session: bool = True) -> None:
        """Close the engine session (unless `end_session` is False: it then ends after the gateway's
        grace), stop the Watch stream and close the channel. Handles keep what they were told."""
        if self._closed:
            return
        self._closed = True
        if end_session and self.session_id is not None:
            try:
                self._call(self._close_session_rpc, pb.CloseSessionRequest(session=self.session_id), timeout=5)
            except KvgateError:
                pass
        self._tracker.close()
        if self._lane is not None:
            self._lane.close()
        self._channel.close()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the gateway accepts a connection (raises `GatewayUnavailable` after `timeout`)."""
        wait = timeout if timeout is not None else self.connect_timeout
        if self._lane is not None:
            try:
                self._lane.wait_ready(wait)
            except grpc.RpcError as e:
                raise GatewayUnavailable("unavailable", f"no gateway answered on the engine fast lane {self._lane.path} within {wait} s: {e}") from None
            return
        try:
            grpc.channel_ready_future(self._channel).result(timeout=wait)
        except grpc.FutureTimeoutError:
            raise GatewayUnavailable("unavailable", f"no gateway answered at {self.target} within {wait} s") from None

    def _call(self, fn: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        try:
            return fn(request, timeout=timeout if timeout is not None else self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
            if error.code == "unknown_session":
                self._session_lost()
            raise error from None

    def _ready(self) -> None:
        """Before the first call that registers memory or posts a room: learn the gateway's API,
        open the session (v2), and open the Watch stream (which attaches the session)."""
        if self._started:
            return
        with self._start_lock:
            if self._started:
                return
            if self.info().api_version >= 2 and self.session_name:
                self._open_session()
            self._tracker.ensure_started()
            self._started = True

    def _open_session(self) -> bool:
        """Open this client's session by name; True when the gateway resumed the very session the
        client had (the same gateway process, so its event log goes on), False when it opened a new
        one (none had this name: the gateway restarted, or the session ended)."""
        previous = self.session_id
        with self._session_lock:
            try:
                reply = self._open_session_rpc(
                    pb.OpenSessionRequest(name=self.session_name or ""), timeout=self.timeout, metadata=_channel.call_metadata(self._token)
                )
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            self.session_id = reply.session
            self._metadata = _channel.call_metadata(self._token, reply.session)
        return reply.resumed and previous == reply.session

    def _session_lost(self) -> None:
        """The gateway no longer knows our session: calls go without it until the next one opens."""
        with self._session_lock:
            self.session_id = None
            self._metadata = _channel.call_metadata(self._token)

    # -- gateway --------------------------------------------------------------------------------

    def info(self, refresh: bool = False) -> GatewayInfo:
        """The gateway's engine-API version, name and plugins (version 1 for a gateway without `Info`)."""
        if self._api is None or refresh:
            try:
                reply = self._info(pb.InfoRequest(), timeout=self.timeout, metadata=self._metadata)
                self._api = GatewayInfo(reply.api_version, reply.gateway, tuple(reply.plugins))
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                if error.status != "UNIMPLEMENTED":
                    raise error from None
                self._api = GatewayInfo(1)
        return self._api

    # -- memory ---------------------------------------------------------------------------------

    def register_shared_memory(self, path: str | os.PathLike[str], *, offset: int = 0, length: int | None = None, label: str = "") -> Region:
        """Register `length` bytes at `offset` of a shared-memory file (a `/dev/shm` file, or
        `/proc/<pid>/fd/<n>` of a memfd). `length` None: to the end of the file."""
        self._ready()
        path = os.fspath(path)
        length = shared_file_length(path, offset, length)
        reply = self._call(self._register, _register_shared_request(path, offset, length, label))
        return Region(reply.region, length, tuple(reply.plugins), label)

    def register_pool(self, pool: SharedPool, *, label: str = "") -> Region:
        """Register a whole `SharedPool`."""
        return self.register_shared_memory(pool.path, offset=pool.offset, length=pool.size, label=label)

    def register_fd(self, fd: int, *, length: int, offset: int = 0, label: str = "") -> Region:
        """Register `length` bytes at `offset` of the host memory behind descriptor `fd` (a memfd, or any
        file this process can map), passed to the gateway on its fd socket: the gateway keeps its own
        copy while the region is registered, so `fd` may be closed afterwards. Needs a Unix-socket
        target (the gateway on this host)."""
        self._ready()
        if self.target.unix_path is None:
            raise errors.InvalidRequest("missing_field", "register_fd needs the gateway's Unix socket (a descriptor cannot cross TCP)")
        token = pass_fd(self.target.unix_path, fd)
        reply = self._call(self._register, _register_fd_request(token, offset, length, label))
        return Region(reply.region, length, tuple(reply.plugins), label)

    def register_cuda_vmm_fd(self, fd: int, *, device: int, length: int, allocation_size: int, offset: int = 0, label: str = "") -> Region:
        """Register CUDA VMM memory (`cuMemCreate`, e.g. PyTorch's expandable segments) by the POSIX
        descriptor of its allocation (`cuMemExportToShareableHandle` with
        `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`): `length` bytes at `offset` inside the allocation of
        `allocation_size` bytes on CUDA device `device`. The descriptor is passed on the gateway's fd
        socket and the gateway keeps its own copy while the region is registered, so `fd` may be closed
        afterwards. Needs a Unix-socket target (the gateway on this host)."""
        self._ready()
        if self.target.unix_path is None:
            raise errors.InvalidRequest("missing_field", "register_cuda_vmm_fd needs the gateway's Unix socket (a descriptor cannot cross TCP)")
        token = pass_fd(self.target.unix_path, fd)
        reply = self._call(self._register, _register_cuda_vmm_request(token, device, offset, length, allocation_size, label))
        return Region(reply.region, length, tuple(reply.plugins), label)

    def register_cuda_ipc(self, device: int, ipc_handle: bytes, length: int, *, label: str = "", base: int = 0) -> Region:
        """Register CUDA device memory by its IPC handle (`cudaIpcGetMemHandle`), `length` bytes from the
        start of its allocation; `base` is where the object of interest starts inside it."""
        self._ready()
        reply = self._call(self._register, _register_cuda_request(device, ipc_handle, length, label))
        return Region(reply.region, length, tuple(reply.plugins), label, base)

    def register_cuda_tensor(self, tensor: Any, *, label: str = "") -> Region:
        """Register a contiguous PyTorch CUDA tensor by the IPC handle of its allocation; the region's
        `base` is the tensor's offset in it, so `region.slice(0, n)` is the tensor's first n bytes.
        Raises `CudaUnavailable` (saying why) where CUDA is not usable."""
        export = cuda_ipc_export(tensor)
        return self.register_cuda_ipc(export.device, export.handle, export.length, label=label, base=export.base)

    def unregister_memory(self, region: Region | int) -> None:
        """Release a region (refused with `region_in_use` while a room that named it is not reusable)."""
        region_id = region.id if isinstance(region, Region) else region
        self._call(self._unregister, pb.UnregisterMemoryRequest(region=region_id))

    # -- rooms ----------------------------------------------------------------------------------

    def expect(
        self,
        key: RoomKeyLike,
        peer: str,
        parts: Sequence[Sequence[Slice]],
        *,
        timeout_ms: int = 0,
        source_kinds: Sequence[str] = (),
        part_peers: Sequence[str] = (),
    ) -> RoomHandle:
        """Decode side: bytes for `key` come from the prefill gateway `peer` into `parts` (one list of
        slices per part, concatenated in order). `timeout_ms`: how long the room may live from now
        (0: the gateway's `room_timeout_ms`).
        `source_kinds`: the memory kind the sender reads each part from (`"host"`, `"cuda_device"`;
        missing: the kind of the part's destination); with the destination it picks each part's plugin.
        `part_peers`: the prefill gateway each part comes from (missing: `peer`); the room fails as a
        whole when any of them fails."""
        self._ready()
        k = room_key(key)
        handle = self._tracker.begin(k, RECEIVER)
        try:
            self._call(self._expect, _expect_request(k, peer, parts, timeout_ms, source_kinds, part_peers))
        except KvgateError:
            self._tracker.table.forget(handle)
            raise
        self._tracker.table.confirm(handle)
        return handle

    def send(
        self, key: RoomKeyLike, part: int, chunk: int, slices: Sequence[Slice], *, last: bool = False, peer: str = "", offset: Optional[int] = None
    ) -> RoomHandle:
        """Prefill side: chunk `chunk` (0, 1, 2, ... in order) of part `part`, read from `slices`.
        `peer`: the decode gateway (empty: the one the room's expect came from)."""
        self._ready()
        k = room_key(key)
        handle = self._tracker.begin(k, SENDER)
        try:
            self._call(self._send, _send_request(k, part, chunk, slices, last, peer, offset))
        except KvgateError:
            self._tracker.table.forget(handle)
            raise
        self._tracker.table.confirm(handle)
        return handle

    def send_chunks(self, key: RoomKeyLike, chunks: Iterable[Chunk], *, peer: str = "") -> RoomHandle:
        """Send several chunks of one room (each part's chunks in order) in one call (`SendBatch`; one
        call per chunk on a v1 gateway). The first refusal is raised; the chunks accepted stay accepted."""
        k = room_key(key)
        results = self.send_batch([ChunkSend(k, c.part, c.chunk, c.slices, c.last, peer, c.offset) for c in chunks])
        if not results:
            raise ValueError("send_chunks needs at least one chunk")
        for result in results:
            if isinstance(result, KvgateError):
                raise result
        first = results[0]
        assert isinstance(first, RoomHandle)
        return first

    def send_batch(self, sends: Sequence[ChunkSend]) -> list[RoomHandle | KvgateError]:
        """Many sends, of one room or several, in one call (`SendBatch`, v2; one call each on v1): each
        checked and applied on its own, in order. One entry per send: its room's handle, or its refusal."""
        self._ready()
        keys = [room_key(s.key) for s in sends]
        handles = {k: self._tracker.begin(k, SENDER) for k in keys}
        if self.info().api_version >= 2:
            request = pb.SendBatchRequest(sends=[_send_request(k, s.part, s.chunk, s.slices, s.last, s.peer, s.offset) for k, s in zip(keys, sends)])
            errors = batch_errors(self._call(self._send_batch, request), len(sends))
        else:
            errors = []
            for k, s in zip(keys, sends):
                try:
                    self._call(self._send, _send_request(k, s.part, s.chunk, s.slices, s.last, s.peer, s.offset))
                    errors.append(None)
                except KvgateError as e:
                    errors.append(e)
        return self._settle(keys, handles, errors)

    def expect_batch(self, expects: Sequence[Expectation]) -> list[RoomHandle | KvgateError]:
        """Many expects in one call (`ExpectBatch`, v2; one call each on v1). One entry per expect: its
        room's handle, or its refusal."""
        self._ready()
        keys = [room_key(e.key) for e in expects]
        handles = {k: self._tracker.begin(k, RECEIVER) for k in keys}
        if self.info().api_version >= 2:
            request = pb.ExpectBatchRequest(expects=[_expect_request(k, e.peer, e.parts, e.timeout_ms, e.source_kinds, e.part_peers) for k, e in zip(keys, expects)])
            errors = batch_errors(self._call(self._expect_batch, request), len(expects))
        else:
            errors = []
            for k, e in zip(keys, expects):
                try:
                    self._call(self._expect, _expect_request(k, e.peer, e.parts, e.timeout_ms, e.source_kinds, e.part_peers))
                    errors.append(None)
                except KvgateError as error:
                    errors.append(error)
        return self._settle(keys, handles, errors)

    def _settle(self, keys: list[RoomKey], handles: dict[RoomKey, RoomHandle], errors: Sequence[KvgateError | None]) -> list[RoomHandle | KvgateError]:
        accepted = {k for k, e in zip(keys, errors) if e is None}
        for k, handle in handles.items():
            if k in accepted:
                self._tracker.table.confirm(handle)
            else:
                self._tracker.table.forget(handle)
        return [handles[k] if e is None else e for k, e in zip(keys, errors)]

    def abort(self, key: RoomKeyLike, why: str = "") -> bool:
        """End the room now, on both sides. True if it was live here; an unknown room leaves a tombstone
        so that a late counterpart is refused."""
        return self._call(self._abort, pb.AbortRequest(key=key_pb(room_key(key)), why=why)).was_live

    def room(self, key: RoomKeyLike) -> RoomInfo:
        """The gateway's view of one room (raises `RoomError` `unknown_room` when it has none)."""
        return info_of(self._call(self._get_room, pb.GetRoomRequest(key=key_pb(room_key(key)))))

    def rooms(self, include_terminal: bool = False) -> list[RoomInfo]:
        """Every room the gateway tracks (with the recently terminal ones if asked)."""
        return [info_of(r) for r in self._call(self._list_rooms, pb.ListRoomsRequest(include_terminal=include_terminal)).rooms]

    def _rooms_at(self, include_terminal: bool) -> tuple[list[RoomInfo], int]:
        reply = self._call(self._list_rooms, pb.ListRoomsRequest(include_terminal=include_terminal))
        return [info_of(r) for r in reply.rooms], reply.seq

    def track(self, key: RoomKeyLike, role: str) -> RoomHandle:
        """A handle for a room this client did not create (another process posted it), `role`
        `sender` or `receiver`; its current state is read at once."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self._ready()
        k = room_key(key)
        handle = self._tracker.begin(k, role)
        if handle.poll() is None:
            self._tracker.check(handle)
        return handle

    def handle(self, key: RoomKeyLike, role: str) -> RoomHandle | None:
        """The live handle of a room this client tracks, if any (no call)."""
        return self._tracker.table.get(room_key(key), role)

    def watch(self, key: RoomKeyLike | None = None, *, outcomes_only: bool = False) -> WatchStream:
        """A Watch stream of its own (every room, or `key`), with state changes unless `outcomes_only`;
        open when this returns (every later event of the room reaches it). Room handles do not need
        it. Iterate it; `close()` it (or use it as a context manager) to end it."""
        request = pb.WatchRequest(outcomes_only=outcomes_only)
        if key is not None:
            request.key.CopyFrom(key_pb(room_key(key)))
        return WatchStream(self._watch(request, metadata=self._metadata), self.connect_timeout)

    @property
    def tracking_stats(self) -> TrackingStats:
        """Counters of the room tracking (streams opened and cut, resumes, reconciliations)."""
        stats = self._tracker.table.stats
        stats.tracked_live = len(self._tracker.table)
        return stats

    @property
    def watch_up(self) -> bool:
        """Whether the client's Watch stream is open now."""
        return self._tracker.up


class WatchStream:
    """An open Watch stream: iterate for `RoomEvent`s; ends on `close()`, or with the error that cut it."""

    def __init__(self, call: Any, timeout: float) -> None:
        self._call = call
        opened = threading.Event()

        def wait_open() -> None:
            try:
                call.initial_metadata()
            finally:
                opened.set()

        threading.Thread(target=wait_open, daemon=True).start()
        if not opened.wait(timeout):
            call.cancel()
            raise GatewayUnavailable("unavailable", f"the Watch stream did not open within {timeout} s")

    def __iter__(self) -> Iterator[RoomEvent]:
        return self

    def __next__(self) -> RoomEvent:
        try:
            return event_of(next(self._call))
        except grpc.RpcError as e:
            error = from_rpc_error(e)
            if error.code == "cancelled":
                raise StopIteration from None
            raise error from None

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._call.cancel()


class _Tracker:
    """The client's one Watch stream (outcomes only), read by a background thread, and its rooms."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.table: RoomTable[RoomHandle] = RoomTable()
        self.up = False
        #: The `seq` of the last event handled (engine API v2).
        self.cursor = 0
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._established = threading.Event()
        self._closed = threading.Event()
        self._call: Any = None
        self._last_error = ""

    def begin(self, key: RoomKey, role: str) -> RoomHandle:
        """The handle of (key, role); the stream is open (so no event of the room can be missed)."""
        self.ensure_started()
        handle, _ = self.table.track(key, role, lambda: RoomHandle(key, role))
        return handle

    def ensure_started(self) -> None:
        if self._established.is_set():
            return
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"kvgate-watch {self.client.target}", daemon=True)
                self._thread.start()
        if not self._established.wait(self.client.connect_timeout):
            raise GatewayUnavailable(
                "unavailable", f"cannot open the Watch stream of {self.client.target} within {self.client.connect_timeout} s: {self._last_error or 'no answer'}"
            )

    def close(self) -> None:
        self._closed.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def check(self, handle: RoomHandle) -> None:
        """Read one room's state now (`track`)."""
        try:
            info = self.client.room(handle.key)
        except RoomError as e:
            if e.code == "unknown_room":
                return
            raise
        self.table.confirm(handle)
        if info.role == handle.role:
            self.table.reconcile_listing([handle], [info])
        else:
            self.table.reconcile_listing([handle], [r for r in self.client.rooms(include_terminal=True) if r.key == handle.key])

    # -- (re)connecting: the one place that knows how a cut is recovered -------------------------

    def _open(self, after_seq: int | None) -> Any:
        """A Watch stream (outcomes only, after `after_seq` if given), answered by the gateway."""
        call: Any = self.client._watch(_watch_request(after_seq), metadata=self.client._metadata, wait_for_ready=True)
        self._call = call
        if self._closed.is_set():
            call.cancel()
        # Returns once the gateway answered the call: from then on every event reaches this stream.
        call.initial_metadata()
        if not call.is_active():
            # The call ended as it opened: iterating it raises its error.
            try:
                for _ in call:
                    pass
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            raise GatewayUnavailable("unavailable", "the Watch stream ended as it opened")
        return call

    def _connect(self, first: bool) -> Any:
        """Open the stream and bring every tracked room up to date (README, "Outcomes and the Watch
        stream"). Engine API v2: after a cut, the client opens its session again by name; when the
        gateway resumes that very session it is the same gateway process, and the stream resumes after
        the cursor (the gateway replays what it missed). Otherwise (a new session: the gateway
        restarted or the session ended; no session; or a cursor the replay log no longer holds) the
        client reconciles from a `ListRooms` snapshot and watches after the snapshot's `seq`.
        Engine API v1: open the stream, then reconcile from `ListRooms`."""
        client = self.client
        api = client.info(refresh=not first).api_version
        if api < 2:
            call = self._open(None)
            if not first:
                self._reconcile(client._rooms_at(include_terminal=True)[0])
            return call
        if first:
            _, self.cursor = client._rooms_at(include_terminal=False)
            return self._open_after_cursor()
        if client.session_name and client._open_session():
            self.table.stats.resumes += 1
            return self._open_after_cursor()
        return self._reconcile_then_open()

    def _open_after_cursor(self) -> Any:
        try:
            return self._open(self.cursor)
        except KvgateError as e:
            if e.code != "watch_cursor_expired":
                raise
            return self._reconcile_then_open()

    def _reconcile_then_open(self) -> Any:
        rooms, seq = self.client._rooms_at(include_terminal=True)
        self._reconcile(rooms)
        self.cursor = seq
        return self._open(seq)

    def _reconcile(self, rooms: list[RoomInfo]) -> None:
        snapshot = self.table.snapshot()
        for handle in self.table.reconcile_listing(snapshot, rooms):
            try:
                info: RoomInfo | None = self.client.room(handle.key)
            except RoomError as e:
                if e.code != "unknown_room":
                    raise
                info = None
            self.table.reconcile_lookup(handle, info)

    def _run(self) -> None:
        pause = RECONNECT_PAUSE_S
        first = True
        while not self._closed.is_set():
            try:
                call = self._connect(first)
                first = False
                self.table.stats.watch_opened += 1
                self.up = True
                self._established.set()
                pause = RECONNECT_PAUSE_S
                for message in call:
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
            if self._closed.is_set():
                break
            self.table.stats.last_cut = cut
            self._closed.wait(pause)
            pause = min(pause * 2, RECONNECT_PAUSE_MAX_S)


def wait_all(handles: Iterable[RoomHandle], timeout: float | None = None) -> list[RoomHandle]:
    """Wait until every handle is terminal (raises `TimeoutError` past `timeout` seconds in all)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for handle in handles:
        handle.terminal(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out.append(handle)
    return out
