"""The engine API's vocabulary as plain Python values: room keys, slices, registered regions, room
views and events, outcomes, and their conversion to and from the protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence, Tuple, Union

from ._proto import kvgate_pb2 as pb

#: The two sides of a room: `sender` (prefill, posts `Send`s) and `receiver` (decode, posts `Expect`).
SENDER = "sender"
RECEIVER = "receiver"
ROLES = (SENDER, RECEIVER)

#: States of a room (`RoomInfo.state`, `StateChanged.state`); the last three are terminal.
LIVE_STATES = ("waiting_expect", "waiting_send", "waiting_sender", "transferring")
TERMINAL_STATES = ("succeeded", "quarantined", "failed")

#: The reason of a tracked room that the gateway no longer knew when the client's Watch stream came back
#: (see README, "Outcomes and the Watch stream"). Both its `Terminal` and its `Reusable` carry it.
UNKNOWN_AFTER_RECONNECT = "unknown_after_reconnect"
#: The `Reusable` reason of a room whose memory a re-read of the gateway's rooms found reusable.
RECONCILED = "reconciled"


class RoomKey(NamedTuple):
    """A room: the id both engines agree on, and its generation (a reused id with a higher generation
    starts clean; anything for a lower one is refused as late)."""

    room: int
    generation: int = 0

    def __str__(self) -> str:
        return f"{self.room}#{self.generation}"


#: A room key, a bare room id (generation 0) or a `(room, generation)` pair.
RoomKeyLike = Union[RoomKey, int, Tuple[int, int]]


def room_key(key: RoomKeyLike) -> RoomKey:
    if isinstance(key, RoomKey):
        return key
    if isinstance(key, int):
        return RoomKey(key, 0)
    room, generation = key
    return RoomKey(int(room), int(generation))


class Slice(NamedTuple):
    """`length` bytes at `offset` inside registered region `region`."""

    region: int
    offset: int
    length: int


class Chunk(NamedTuple):
    """One chunk of one part of a room, as the prefill side hands it over: chunks of a part are numbered
    0, 1, 2, ... in order, and the one with `last` closes the part. With `offset` (engine API v2) the
    chunk names the byte of the part's destination stream its bytes start at instead: such chunks come
    in any order, and the part is done once every byte is covered exactly once."""

    part: int
    chunk: int
    slices: Sequence[Slice]
    last: bool = False
    offset: Optional[int] = None


class Expectation(NamedTuple):
    """One expect of a batch (`expect_batch`): the room, the prefill gateway, the destination parts,
    (optional) how long the room may live from now (`timeout_ms`; 0: the gateway's
    `room_timeout_ms`), and (optional) the memory kind the sender reads each part from (`"host"`,
    `"cuda_device"`; empty or missing: the kind of the part's destination), and (optional) the prefill
    gateway each part comes from (empty or missing: `peer`)."""

    key: "RoomKeyLike"
    peer: str
    parts: Sequence[Sequence[Slice]]
    timeout_ms: int = 0
    source_kinds: Sequence[str] = ()
    part_peers: Sequence[str] = ()


class ChunkSend(NamedTuple):
    """One send of a batch (`send_batch`): a chunk of a part of a room."""

    key: "RoomKeyLike"
    part: int
    chunk: int
    slices: Sequence[Slice]
    last: bool = False
    peer: str = ""
    #: Byte offset in the part's destination stream (None: right after the previous chunk).
    offset: Optional[int] = None


@dataclass(frozen=True)
class GatewayInfo:
    """What `Info` says: the engine-API version (1: no sessions, batches or resume), the gateway's
    name and its opened plugins. A gateway without `Info` is version 1."""

    api_version: int
    gateway: str = ""
    plugins: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Region:
    """Memory registered with the gateway. `base` is where the registered object starts inside the
    region (non-zero for a CUDA tensor that does not start its allocation); `slice` adds it."""

    id: int
    length: int
    plugins: Tuple[str, ...] = ()
    label: str = ""
    base: int = 0

    def slice(self, offset: int, length: int) -> Slice:
        if offset < 0 or length <= 0 or self.base + offset + length > self.length:
            raise ValueError(f"slice [{offset}, {offset + length}) lies outside region {self.id} ({self.length - self.base} bytes)")
        return Slice(self.id, self.base + offset, length)


@dataclass(frozen=True)
class RoomInfo:
    """The gateway's view of one room (`GetRoom`, `ListRooms`)."""

    key: RoomKey
    state: str
    role: str
    peer: str = ""
    plugin: str = ""
    age_ms: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    #: Set once failed: the reason code and the phase.
    reason: str = ""
    phase: str = ""
    reusable: bool = False
    last_event: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"


@dataclass(frozen=True)
class Outcome:
    """A room's terminal outcome on one side. `source` is `watch` (the `Terminal` event) or `reconcile`
    (read back with `ListRooms`/`GetRoom` after the Watch stream was cut)."""

    key: RoomKey
    role: str
    succeeded: bool
    reason: str = ""
    phase: str = ""
    elapsed_ms: int = 0
    bytes: int = 0
    source: str = "watch"
    #: For `aborted_by_peer`, `sender_failed`, `receiver_failed`: the reason the peer gave (API v2).
    peer_reason: str = ""

    def raise_for_failure(self) -> None:
        """Raise `TransferFailed` (code = the reason) unless the room succeeded."""
        if not self.succeeded:
            from .errors import TransferFailed

            raise TransferFailed(self)


@dataclass(frozen=True)
class RoomEvent:
    """One event of the Watch stream: `kind` is `state_changed`, `terminal` or `reusable`."""

    key: RoomKey
    role: str
    kind: str
    at_ms: int
    #: `state_changed`: the new state.
    state: str = ""
    #: `terminal`: the outcome.
    outcome: Outcome | None = None
    #: `reusable`: what released the memory (`nothing_in_flight`, `quiesced`, `quarantine_timeout`).
    reusable_reason: str = ""


# -- protobuf conversion -------------------------------------------------------------------------


def key_pb(key: RoomKey) -> pb.RoomKey:
    return pb.RoomKey(room=key.room, generation=key.generation)


def key_of(message: pb.RoomKey) -> RoomKey:
    return RoomKey(message.room, message.generation)


def slices_pb(slices: Iterable[Slice]) -> list[pb.Slice]:
    return [pb.Slice(region=s[0], offset=s[1], len=s[2]) for s in slices]


def info_of(message: pb.RoomInfo) -> RoomInfo:
    return RoomInfo(
        key=key_of(message.key),
        state=message.state,
        role=message.role,
        peer=message.peer,
        plugin=message.plugin,
        age_ms=message.age_ms,
        bytes_total=message.bytes_total,
        bytes_done=message.bytes_done,
        reason=message.reason,
        phase=message.phase,
        reusable=message.reusable,
        last_event=message.last_event,
    )


def outcome_of_terminal(key: RoomKey, role: str, terminal: pb.Terminal) -> Outcome:
    return Outcome(
        key=key,
        role=role,
        succeeded=terminal.succeeded,
        reason=terminal.reason,
        phase=terminal.phase,
        elapsed_ms=terminal.elapsed_ms,
        bytes=terminal.bytes,
        source="watch",
        peer_reason=terminal.peer_reason,
    )


def outcome_of_info(info: RoomInfo) -> Outcome:
    return Outcome(
        key=info.key,
        role=info.role,
        succeeded=info.succeeded,
        reason=info.reason,
        phase=info.phase,
        elapsed_ms=info.age_ms,
        bytes=info.bytes_done,
        source="reconcile",
    )


def event_of(message: pb.RoomEvent) -> RoomEvent:
    key = key_of(message.key)
    kind = message.WhichOneof("event") or ""
    if kind == "terminal":
        return RoomEvent(key, message.role, kind, message.at_ms, outcome=outcome_of_terminal(key, message.role, message.terminal))
    if kind == "reusable":
        return RoomEvent(key, message.role, kind, message.at_ms, reusable_reason=message.reusable.reason)
    return RoomEvent(key, message.role, kind, message.at_ms, state=message.state_changed.state)
