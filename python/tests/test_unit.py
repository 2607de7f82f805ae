"""The package without a gateway: targets, the reason-code mapping, the API surface against the proto,
the room table's delivery and reconciliation rules, and the memory helpers."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc
import numpy as np
import pytest

import kvgate
from kvgate import _channel, errors
from kvgate._proto import kvgate_pb2 as pb
from kvgate.rooms import AsyncRoomHandle, RoomHandle, RoomTable
from kvgate.types import RoomInfo, RoomKey


def test_targets() -> None:
    assert _channel.parse_target("/tmp/x.sock").unix_path == "/tmp/x.sock"
    assert _channel.parse_target("unix:/tmp/x.sock").grpc_target == "unix:/tmp/x.sock"
    assert _channel.parse_target("unix:///tmp/x.sock").unix_path == "/tmp/x.sock"
    assert _channel.parse_target("127.0.0.1:9000").tcp_address == "127.0.0.1:9000"
    assert _channel.parse_target("tcp://gw:9000").grpc_target == "gw:9000"
    assert _channel.parse_target("http://gw:9000/").tcp_address == "gw:9000"
    saved = os.environ.pop(_channel.TARGET_ENV, None)
    try:
        assert _channel.parse_target(None).unix_path == _channel.default_socket()
        os.environ[_channel.TARGET_ENV] = "/run/kvgate/e.sock"
        assert _channel.parse_target(None).unix_path == "/run/kvgate/e.sock"
    finally:
        os.environ.pop(_channel.TARGET_ENV, None)
        if saved is not None:
            os.environ[_channel.TARGET_ENV] = saved
    unix = dict(_channel.channel_options(_channel.parse_target("/x.sock")))
    assert unix["grpc.default_authority"] == "localhost"
    assert "grpc.default_authority" not in dict(_channel.channel_options(_channel.parse_target("h:1")))


def test_every_rpc_of_the_proto_is_in_the_method_table() -> None:
    service = pb.DESCRIPTOR.services_by_name["EngineApi"]
    in_proto = {m.name: (m.input_type.full_name, m.output_type.full_name, m.server_streaming) for m in service.methods}
    in_table = {m.name: (m.request.DESCRIPTOR.full_name, m.reply.DESCRIPTOR.full_name, m.streaming) for m in _channel.METHODS}
    assert in_table == in_proto
    assert service.full_name == _channel.SERVICE


class FakeRpcError(Exception):
    """What grpc raises for a refused call: a status code, details and metadata."""

    def __init__(self, status: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(details)
        self._status, self._details, self._trailing = status, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._status

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


@pytest.mark.parametrize(
    "code, cls",
    [
        ("room_terminal", kvgate.RoomError),
        ("stale_generation", kvgate.RoomError),
        ("unknown_room", kvgate.RoomError),
        ("unknown_region", kvgate.RegionError),
        ("slice_out_of_range", kvgate.RegionError),
        ("peer_not_connected", kvgate.PeerError),
        ("unknown_peer", kvgate.PeerError),
        ("too_many_rooms", kvgate.LimitError),
        ("too_many_something_new", kvgate.LimitError),
        ("watch_lagged", kvgate.LimitError),
        ("out_of_order_chunk", kvgate.InvalidRequest),
        ("bad_token", kvgate.AuthError),
        ("gateway_stopping", kvgate.GatewayUnavailable),
    ],
)
def test_reason_codes_map_to_one_family_each(code: str, cls: type[kvgate.KvgateError]) -> None:
    by_metadata = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNKNOWN, f"{code}: words", (("kvgate-reason", code),)))
    assert type(by_metadata) is cls and by_metadata.code == code and by_metadata.status == "UNKNOWN"
    by_prefix = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNKNOWN, f"{code}: words"))
    assert type(by_prefix) is cls and by_prefix.code == code
    assert str(by_prefix) == f"{code}: words"


def test_a_failure_without_reason_code_maps_by_status() -> None:
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
    assert isinstance(e, kvgate.GatewayUnavailable) and e.code == "unavailable"
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "Something Broke"))
    assert type(e) is kvgate.KvgateError and e.code == "internal"
    assert errors.error_class_for("a_code_from_the_future") is kvgate.KvgateError


def test_a_failed_outcome_raises_transfer_failed_with_its_reason() -> None:
    outcome = kvgate.Outcome(RoomKey(3), "receiver", succeeded=False, reason="peer_lost", phase="transfer")
    with pytest.raises(kvgate.TransferFailed) as raised:
        outcome.raise_for_failure()
    assert raised.value.code == "peer_lost" and raised.value.outcome is outcome
    kvgate.Outcome(RoomKey(3), "receiver", succeeded=True).raise_for_failure()


def terminal_event(room: int, role: str, succeeded: bool = True, reason: str = "") -> pb.RoomEvent:
    return pb.RoomEvent(key=pb.RoomKey(room=room), role=role, terminal=pb.Terminal(succeeded=succeeded, reason=reason))


def reusable_event(room: int, role: str, reason: str = "quiesced") -> pb.RoomEvent:
    return pb.RoomEvent(key=pb.RoomKey(room=room), role=role, reusable=pb.Reusable(reason=reason))


def new_table() -> tuple[RoomTable[RoomHandle], Any]:
    table: RoomTable[RoomHandle] = RoomTable(recent_limit=4)

    def track(room: int, role: str = "receiver") -> RoomHandle:
        key = RoomKey(room)
        return table.track(key, role, lambda: RoomHandle(key, role))[0]

    return table, track


def test_outcomes_are_delivered_exactly_once_per_room_and_role() -> None:
    table, track = new_table()
    receiver, sender = track(1, "receiver"), track(1, "sender")
    calls: list[str] = []
    receiver.on_terminal(lambda o: calls.append(f"terminal {o.reason}"))
    receiver.on_reusable(lambda r: calls.append(f"reusable {r}"))
    assert receiver.poll() is None and not receiver.done
    table.on_event(terminal_event(1, "receiver", False, "aborted"))
    table.on_event(terminal_event(1, "receiver", True))  # a duplicate is ignored
    table.on_event(reusable_event(1, "receiver"))
    table.on_event(reusable_event(1, "receiver", "again"))
    assert calls == ["terminal aborted", "reusable quiesced"]
    assert receiver.terminal(0).reason == "aborted" and receiver.reusable(0) == "quiesced"
    assert sender.poll() is None, "the other role of the same key is another room"
    late: list[str] = []
    receiver.on_terminal(lambda o: late.append(o.reason))  # after the fact: called at once
    assert late == ["aborted"]
    assert len(table) == 1, "a room both terminal and reusable is no longer tracked"
    with pytest.raises(TimeoutError):
        sender.terminal(timeout=0.01)


def test_outcomes_that_came_before_the_room_was_tracked_are_kept() -> None:
    table, track = new_table()
    table.on_event(terminal_event(5, "sender"))
    table.on_event(reusable_event(5, "sender", "nothing_in_flight"))
    handle = track(5, "sender")
    assert handle.poll() is not None and handle.poll_reusable() == "nothing_in_flight"
    for room in range(10, 20):  # the memory of untracked rooms is bounded
        table.on_event(terminal_event(room, "sender"))
    assert track(10, "sender").poll() is None
    assert track(19, "sender").poll() is not None


def info(room: int, role: str, state: str, reason: str = "", reusable: bool = False) -> RoomInfo:
    return RoomInfo(RoomKey(room), state=state, role=role, reason=reason, phase="transfer" if reason else "", reusable=reusable)


def test_reconciliation_rules() -> None:
    table, track = new_table()
    listed_done = track(1)
    listed_quarantined = track(2)
    listed_live = track(3)
    forgotten = track(4)
    not_yet_created = track(5)
    already_done = track(6)
    for h in (listed_done, listed_quarantined, listed_live, forgotten, already_done):
        table.confirm(h)
    table.on_event(terminal_event(6, "receiver"))
    seen: list[tuple[int, str]] = []
    for h in (listed_done, listed_quarantined, listed_live, forgotten, not_yet_created, already_done):
        h.on_terminal(lambda o: seen.append((o.key.room, o.source)))
    listing = [
        info(1, "receiver", "failed", "peer_lost", reusable=True),
        info(2, "receiver", "quarantined", "aborted_by_peer"),
        info(3, "receiver", "transferring"),
        info(3, "sender", "succeeded", reusable=True),  # another role: not this room
        info(6, "receiver", "succeeded", reusable=True),
    ]
    missing = table.reconcile_listing(table.snapshot(), listing)
    assert missing == [forgotten], "only a confirmed room the listing lacks is looked up"
    table.reconcile_lookup(forgotten, None)
    assert listed_done.terminal(0).reason == "peer_lost" and listed_done.poll_reusable() == kvgate.RECONCILED
    assert listed_quarantined.terminal(0).reason == "aborted_by_peer" and listed_quarantined.poll_reusable() is None
    assert listed_live.poll() is None
    gone = forgotten.terminal(0)
    assert (gone.succeeded, gone.reason, gone.source) == (False, kvgate.UNKNOWN_AFTER_RECONNECT, "reconcile")
    assert forgotten.poll_reusable() == kvgate.UNKNOWN_AFTER_RECONNECT
    assert not_yet_created.poll() is None, "a room whose creating call had not returned is left to the stream"
    assert already_done.terminal(0).source == "watch"
    assert sorted(seen) == [(1, "reconcile"), (2, "reconcile"), (4, "reconcile"), (6, "watch")]
    assert table.stats.reconciles == 1 and table.stats.unknown_after_reconnect == 1
    # The stream then says what the listing said: nothing new is delivered.
    table.on_event(terminal_event(1, "receiver", True))
    table.on_event(reusable_event(2, "receiver"))
    assert listed_done.terminal(0).reason == "peer_lost"
    assert sorted(seen) == [(1, "reconcile"), (2, "reconcile"), (4, "reconcile"), (6, "watch")]


def test_a_refused_creating_call_stops_tracking_unless_confirmed() -> None:
    table, track = new_table()
    h = track(1)
    table.forget(h)
    assert len(table) == 0
    h2 = track(2)
    table.confirm(h2)
    table.forget(h2)
    assert len(table) == 1


def test_async_handles_are_awaited_and_polled() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        table: RoomTable[AsyncRoomHandle] = RoomTable()
        key = RoomKey(9, 2)
        handle = table.track(key, "sender", lambda: AsyncRoomHandle(key, "sender", loop))[0]
        assert handle.poll() is None
        with pytest.raises(TimeoutError):
            await handle.terminal(timeout=0.01)
        waiter = asyncio.ensure_future(handle.result())
        await asyncio.sleep(0)
        table.on_event(pb.RoomEvent(key=pb.RoomKey(room=9, generation=2), role="sender", terminal=pb.Terminal(succeeded=False, reason="aborted")))
        with pytest.raises(kvgate.TransferFailed) as raised:
            await waiter
        assert raised.value.code == "aborted"
        # Fed from another thread (the blocking client's reader), the future is resolved on its loop.
        await asyncio.to_thread(table.on_event, pb.RoomEvent(key=pb.RoomKey(room=9, generation=2), role="sender", reusable=pb.Reusable(reason="quiesced")))
        assert await handle.reusable(timeout=1) == "quiesced"

    asyncio.run(scenario())


def test_region_slices_are_checked_and_offset_by_the_base() -> None:
    region = kvgate.Region(id=4, length=1000, base=100)
    assert region.slice(0, 10) == kvgate.Slice(4, 100, 10)
    with pytest.raises(ValueError):
        region.slice(850, 100)
    with pytest.raises(ValueError):
        region.slice(0, 0)


@pytest.mark.parametrize("memfd", [False, True])
def test_shared_pool_numpy_view_is_the_shared_memory(memfd: bool) -> None:
    with kvgate.SharedPool(1 << 16, memfd=memfd) as pool:
        array = pool.numpy()
        array[:4] = [1, 2, 3, 4]
        with open(pool.path, "rb") as f:  # what the gateway maps: the same bytes, no copy
            assert f.read(4) == bytes([1, 2, 3, 4])
        words = pool.numpy(np.uint32, shape=(4, 4))
        assert words.shape == (4, 4) and words[0, 0] == int.from_bytes(bytes([1, 2, 3, 4]), "little")
        other = kvgate.SharedPool.open(pool.path)
        other.numpy()[100] = 42
        assert array[100] == 42
        other.close()
        assert os.path.exists(pool.path), "open() does not own the file"
        path = pool.path
        del array, words
    assert memfd or not os.path.exists(path), "close() removes the file it created"


def test_shared_pool_torch_view_shares_memory_or_says_why() -> None:
    with kvgate.SharedPool(4096) as pool:
        try:
            import torch
        except ImportError:
            with pytest.raises(ModuleNotFoundError, match="needs PyTorch"):
                pool.torch()
            return
        tensor = pool.torch()
        tensor[7] = 99
        assert pool.numpy()[7] == 99
        assert pool.torch(torch.float32).numel() == 1024


def test_cuda_registration_says_why_it_is_unavailable() -> None:
    ok, why = kvgate.cuda_available()
    if ok:
        return  # test_transfer's GPU test covers this machine
    with pytest.raises(kvgate.CudaUnavailable) as raised:
        kvgate.cuda_ipc_export(object())
    assert raised.value.code == "cuda_unavailable" and raised.value.details == why
    assert any(w in why for w in ("PyTorch is not installed", "built without CUDA", "sees no CUDA device")), why


def test_expect_request_names_each_parts_source_kind_and_leaves_the_rest_to_the_destination() -> None:
    from kvgate.client import _expect_request

    parts = [[kvgate.Slice(1, 0, 64)], [kvgate.Slice(2, 0, 64)], [kvgate.Slice(3, 0, 64)]]
    request = _expect_request(RoomKey(5, 0), "prefill", parts, 0, ["cuda_device"])
    assert [p.source_kind for p in request.parts] == ["cuda_device", "", ""]
    assert [p.slices[0].region for p in request.parts] == [1, 2, 3]
    assert all(p.source_kind == "" for p in _expect_request(RoomKey(5, 0), "prefill", parts, 0).parts)
    request = _expect_request(RoomKey(5, 0), "rank-0", parts, 0, (), ["rank-0", "rank-1", ""])
    assert list(request.part_peers) == ["rank-0", "rank-1", ""] and request.peer == "rank-0"
    assert "no_plugin_for_memory" in errors.RegionError.codes and "unknown_memory_kind" in errors.RegionError.codes


def test_a_cuda_vmm_registration_request_carries_every_field() -> None:
    from kvgate.client import _register_cuda_vmm_request

    request = _register_cuda_vmm_request(11, 2, 4096, 1 << 20, 2 << 20, "kv")
    assert request.WhichOneof("memory") == "cuda_vmm_fd"
    v = request.cuda_vmm_fd
    assert (v.token, v.device, v.offset, v.len, v.allocation_size, request.label) == (11, 2, 4096, 1 << 20, 2 << 20, "kv")


class _FakeCuda:
    """libcuda for `cuda_backing` without a GPU: an allocation at `base` of `size` bytes on device 1
    that has no IPC handle; `vmm_rc` says how the VMM export goes (0: a memfd stands in for the
    descriptor)."""

    def __init__(self, base: int, size: int, retain_rc: int = 0, export_rc: int = 0) -> None:
        self.base, self.size, self.retain_rc, self.export_rc = base, size, retain_rc, export_rc
        self.released: list[int] = []
        self.exported: list[int] = []

    def cuPointerGetAttribute(self, out: Any, attribute: int, ptr: Any) -> int:
        out._obj.value = 1
        return 0

    def cuMemGetAddressRange_v2(self, base: Any, size: Any, ptr: Any) -> int:
        base._obj.value, size._obj.value = self.base, self.size
        return 0

    def cuIpcGetMemHandle(self, handle: Any, base: Any) -> int:
        return 1  # CUDA_ERROR_INVALID_VALUE, as for a VMM allocation

    def cuMemRetainAllocationHandle(self, handle: Any, addr: Any) -> int:
        handle._obj.value = 77
        return self.retain_rc

    def cuMemExportToShareableHandle(self, fd: Any, handle: Any, kind: Any, flags: Any) -> int:
        assert kind.value == 1, "POSIX_FILE_DESCRIPTOR"
        if self.export_rc == 0:
            fd._obj.value = os.memfd_create("kvgate-fake-vmm")
            self.exported.append(fd._obj.value)
        return self.export_rc

    def cuMemRelease(self, handle: Any) -> int:
        self.released.append(handle.value)
        return 0


class _RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, int]] = []

    def register_cuda_vmm_fd(self, fd: int, *, device: int, length: int, allocation_size: int, offset: int = 0, label: str = "") -> kvgate.Region:
        os.fstat(fd)  # the descriptor is open while it is passed
        self.calls.append((fd, device, offset, length, allocation_size))
        return kvgate.Region(len(self.calls), length, ("nvlink",), label)


def test_a_vmm_allocation_without_ipc_handle_is_registered_by_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgate.sglang import memory

    fake = _FakeCuda(base=0x10_0000, size=2 << 20)
    monkeypatch.setattr(memory, "_libcuda", lambda: fake)
    client = _RecordingClient()
    regions = memory.RegionMap(client)  # type: ignore[arg-type]
    # 0x10_0000 is below every mapping of this process: not shared host memory, so CUDA is asked.
    assert regions.locate(0x10_0000 + 4096, 8192, "kv") == (1, 4096)
    assert regions.locate(0x10_0000 + 8192, 64, "kv") == (1, 8192), "registered once"
    assert [c[1:] for c in client.calls] == [(1, 0, 2 << 20, 2 << 20)]
    assert fake.released == [77, 77], "every retained handle is released"
    for fd in fake.exported:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed once the gateway has its copy
    # A buffer running past the allocation cannot be one region: refused, its descriptor closed.
    fresh = memory.RegionMap(client)  # type: ignore[arg-type]
    with pytest.raises(memory.UnsupportedMemory, match="runs past the end of its CUDA VMM allocation"):
        fresh.locate(0x10_0000 + (2 << 20) - 10, 11, "kv")
    with pytest.raises(OSError):
        os.fstat(fake.exported[-1])


@pytest.mark.parametrize("retain_rc, export_rc, names", [(1, 0, "cuMemRetainAllocationHandle failed (1)"), (0, 101, "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) failed (101)")])
def test_an_allocation_exportable_neither_way_names_both_attempts(monkeypatch: pytest.MonkeyPatch, retain_rc: int, export_rc: int, names: str) -> None:
    from kvgate.sglang import memory

    fake = _FakeCuda(base=0x10_0000, size=2 << 20, retain_rc=retain_rc, export_rc=export_rc)
    monkeypatch.setattr(memory, "_libcuda", lambda: fake)
    with pytest.raises(memory.UnsupportedMemory) as raised:
        memory.RegionMap(_RecordingClient()).locate(0x10_0000, 64, "kv")  # type: ignore[arg-type]
    message = str(raised.value)
    assert "cuIpcGetMemHandle failed (1)" in message and names in message, message
    assert fake.released == ([] if retain_rc else [77]), "a retained handle is released on failure too, and only a retained one"
