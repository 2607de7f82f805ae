"""Room outcomes as an engine needs them: a handle per room whose `terminal()` and `reusable()` can be
waited for (blocking `RoomHandle`) or awaited (`AsyncRoomHandle`), or polled without blocking, fed by
one Watch stream per client.

`RoomTable` is the bookkeeping shared by the blocking and the asyncio client, without any I/O: which
rooms are tracked, the routing of Watch events to them, and the reconciliation rule applied after the
stream was cut and opened again:

* every tracked room the gateway lists (`ListRooms(include_terminal=True)`) gets the outcome and the
  reusability the listing shows;
* a tracked room whose creating call (`Expect`, or the first `Send`) had returned but that the gateway
  neither lists nor finds (`GetRoom`) is over: it fails with reason `unknown_after_reconnect`, and its
  memory is reusable with the same reason (the gateway that forgot it holds no transfer into it);
* a room whose creating call had not returned is left to the new stream: the gateway had not created
  it when it listed its rooms, so every event of it comes after the stream was open again.

Each room's `Terminal` and `Reusable` are delivered exactly once, whether by the stream or by the
reconciliation, whichever comes first.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, TypeVar

from ._proto import kvgate_pb2 as pb
from .errors import TransferFailed
from .types import RECONCILED, UNKNOWN_AFTER_RECONNECT, Outcome, RoomInfo, RoomKey, outcome_of_info, outcome_of_terminal

TrackKey = tuple[int, int, str]
#: How many untracked rooms' outcomes are remembered for a `track()` that comes after them.
RECENT_UNTRACKED = 8192


@dataclass
class TrackingStats:
    """How a client's room tracking has gone: streams opened and cut, reconciliations and what they filled in."""

    watch_opened: int = 0
    watch_cuts: int = 0
    #: Streams opened again after the cursor, the gateway replaying what they missed (API v2).
    resumes: int = 0
    reconciles: int = 0
    reconciled_outcomes: int = 0
    unknown_after_reconnect: int = 0
    tracked_live: int = 0
    last_cut: str = ""


class _RoomBase:
    """What every room handle has: its key and role, and its outcome once known."""

    def __init__(self, key: RoomKey, role: str) -> None:
        self.key = key
        self.role = role
        self._outcome: Outcome | None = None
        self._reusable: str | None = None
        self._confirmed = False
        self._callback_lock = threading.Lock()
        self._terminal_notified = False
        self._reusable_notified = False
        self._terminal_callbacks: list[Callable[[Outcome], None]] = []
        self._reusable_callbacks: list[Callable[[str], None]] = []

    def __repr__(self) -> str:
        state = "live" if self._outcome is None else ("succeeded" if self._outcome.succeeded else f"failed:{self._outcome.reason}")
        return f"<{type(self).__name__} {self.key} {self.role} {state}{' reusable' if self._reusable is not None else ''}>"

    def poll(self) -> Outcome | None:
        """The outcome if the room is terminal, else None. Never blocks."""
        return self._outcome

    def poll_reusable(self) -> str | None:
        """The reason the room's memory became reusable (`nothing_in_flight`, `quiesced`,
        `quarantine_timeout`, ...), or None while it is not. Never blocks."""
        return self._reusable

    @property
    def done(self) -> bool:
        """Terminal (succeeded or failed)."""
        return self._outcome is not None

    @property
    def is_reusable(self) -> bool:
        return self._reusable is not None

    def on_terminal(self, callback: Callable[[Outcome], None]) -> None:
        """Call `callback(outcome)` once, when the room is terminal (at once if it is already). Runs on
        the thread (blocking client) or the event loop (asyncio client) that feeds the handle."""
        with self._callback_lock:
            if not self._terminal_notified:
                self._terminal_callbacks.append(callback)
                return
        assert self._outcome is not None
        callback(self._outcome)

    def on_reusable(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, when the room's memory is reusable (at once if it is already)."""
        with self._callback_lock:
            if not self._reusable_notified:
                self._reusable_callbacks.append(callback)
                return
        assert self._reusable is not None
        callback(self._reusable)

    # -- fed by RoomTable, under its lock; `_wake_*` and callbacks run after the lock is released --

    def _set_terminal(self, outcome: Outcome) -> bool:
        if self._outcome is not None:
            return False
        self._outcome = outcome
        return True

    def _set_reusable(self, reason: str) -> bool:
        if self._reusable is not None:
            return False
        self._reusable = reason
        return True

    def _notify_terminal(self) -> None:
        outcome = self._outcome
        assert outcome is not None
        self._wake_terminal(outcome)
        with self._callback_lock:
            self._terminal_notified = True
            callbacks, self._terminal_callbacks = self._terminal_callbacks, []
        for callback in callbacks:
            callback(outcome)

    def _notify_reusable(self) -> None:
        reason = self._reusable
        assert reason is not None
        self._wake_reusable(reason)
        with self._callback_lock:
            self._reusable_notified = True
            callbacks, self._reusable_callbacks = self._reusable_callbacks, []
        for callback in callbacks:
            callback(reason)

    def _wake_terminal(self, outcome: Outcome) -> None:
        raise NotImplementedError

    def _wake_reusable(self, reason: str) -> None:
        raise NotImplementedError


class RoomHandle(_RoomBase):
    """A room of the blocking `Client`: wait with `terminal()` / `reusable()`, or `poll()`."""

    def __init__(self, key: RoomKey, role: str) -> None:
        super().__init__(key, role)
        self._terminal_event = threading.Event()
        self._reusable_event = threading.Event()

    def terminal(self, timeout: float | None = None) -> Outcome:
        """Wait until the room is terminal; its outcome (a failed room is an outcome, not an error).
        Raises `TimeoutError` after `timeout` seconds."""
        if not self._terminal_event.wait(timeout):
            raise TimeoutError(f"room {self.key} ({self.role}) not terminal within {timeout} s")
        assert self._outcome is not None
        return self._outcome

    def reusable(self, timeout: float | None = None) -> str:
        """Wait until no byte can land in (receiver) or be read from (sender) the room's memory; the reason."""
        if not self._reusable_event.wait(timeout):
            raise TimeoutError(f"room {self.key} ({self.role}) not reusable within {timeout} s")
        assert self._reusable is not None
        return self._reusable

    def result(self, timeout: float | None = None) -> Outcome:
        """Like `terminal()`, but a failed room raises `TransferFailed` (code = its reason)."""
        outcome = self.terminal(timeout)
        if not outcome.succeeded:
            raise TransferFailed(outcome)
        return outcome

    def _wake_terminal(self, outcome: Outcome) -> None:
        self._terminal_event.set()

    def _wake_reusable(self, reason: str) -> None:
        self._reusable_event.set()


class AsyncRoomHandle(_RoomBase):
    """A room of the asyncio `AsyncClient`: `await terminal()` / `await reusable()`, or `poll()`."""

    def __init__(self, key: RoomKey, role: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(key, role)
        self._loop = loop
        self._terminal_future: asyncio.Future[Outcome] = loop.create_future()
        self._reusable_future: asyncio.Future[str] = loop.create_future()

    async def terminal(self, timeout: float | None = None) -> Outcome:
        """The room's outcome once terminal. Raises `TimeoutError` after `timeout` seconds."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._terminal_future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"room {self.key} ({self.role}) not terminal within {timeout} s") from None

    async def reusable(self, timeout: float | None = None) -> str:
        """The reason the room's memory became reusable, once it is."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._reusable_future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"room {self.key} ({self.role}) not reusable within {timeout} s") from None

    async def result(self, timeout: float | None = None) -> Outcome:
        """Like `terminal()`, but a failed room raises `TransferFailed` (code = its reason)."""
        outcome = await self.terminal(timeout)
        if not outcome.succeeded:
            raise TransferFailed(outcome)
        return outcome

    def _resolve(self, future: asyncio.Future[Outcome] | asyncio.Future[str], value: object) -> None:
        def set_result() -> None:
            if not future.done():
                future.set_result(value)  # type: ignore[arg-type]

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            set_result()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(set_result)

    def _wake_terminal(self, outcome: Outcome) -> None:
        self._resolve(self._terminal_future, outcome)

    def _wake_reusable(self, reason: str) -> None:
        self._resolve(self._reusable_future, reason)


H = TypeVar("H", bound=_RoomBase)


class RoomTable(Generic[H]):
    """The tracked rooms of one client and the outcomes of rooms it does not track (yet). Thread-safe."""

    def __init__(self, recent_limit: int = RECENT_UNTRACKED) -> None:
        self._lock = threading.Lock()
        self._live: dict[TrackKey, H] = {}
        self._recent: OrderedDict[TrackKey, list[pb.RoomEvent]] = OrderedDict()
        self._recent_limit = recent_limit
        self.stats = TrackingStats()

    def __len__(self) -> int:
        return len(self._live)

    def get(self, key: RoomKey, role: str) -> H | None:
        return self._live.get((key.room, key.generation, role))

    def track(self, key: RoomKey, role: str, factory: Callable[[], H]) -> tuple[H, bool]:
        """The live handle of (key, role), made with `factory` if there is none; (handle, created).
        A new handle gets the outcomes the stream delivered before anyone tracked the room."""
        k = (key.room, key.generation, role)
        with self._lock:
            handle = self._live.get(k)
            if handle is not None:
                return handle, False
            handle = factory()
            self._live[k] = handle
            early = self._recent.pop(k, [])
            notify = [self._apply_locked(handle, k, e) for e in early]
        self._notify(notify)
        return handle, True

    def confirm(self, handle: H) -> None:
        """The call that created the room returned: from now on the gateway must know it."""
        handle._confirmed = True

    def forget(self, handle: H) -> None:
        """The call that was to create the room failed: stop tracking it unless the gateway already
        reported on it or an earlier call had created it."""
        with self._lock:
            k = (handle.key.room, handle.key.generation, handle.role)
            if not handle._confirmed and handle._outcome is None and self._live.get(k) is handle:
                del self._live[k]

    # -- events ---------------------------------------------------------------------------------

    def on_event(self, event: pb.RoomEvent) -> None:
        """One Watch event (only `Terminal` and `Reusable` matter here)."""
        kind = event.WhichOneof("event")
        if kind != "terminal" and kind != "reusable":
            return
        k = (event.key.room, event.key.generation, event.role)
        with self._lock:
            handle = self._live.get(k)
            if handle is None:
                self._remember_locked(k, event)
                return
            notify = self._apply_locked(handle, k, event)
        self._notify([notify])

    def _remember_locked(self, k: TrackKey, event: pb.RoomEvent) -> None:
        self._recent.setdefault(k, []).append(event)
        self._recent.move_to_end(k)
        while len(self._recent) > self._recent_limit:
            self._recent.popitem(last=False)

    def _apply_locked(self, handle: H, k: TrackKey, event: pb.RoomEvent) -> tuple[H, bool, bool]:
        terminal = reusable = False
        if event.HasField("terminal"):
            terminal = handle._set_terminal(outcome_of_terminal(handle.key, handle.role, event.terminal))
        elif event.HasField("reusable"):
            reusable = handle._set_reusable(event.reusable.reason)
        self._retire_locked(handle, k)
        return handle, terminal, reusable

    def _retire_locked(self, handle: H, k: TrackKey) -> None:
        if handle._outcome is not None and handle._reusable is not None and self._live.get(k) is handle:
            del self._live[k]

    @staticmethod
    def _notify(items: Iterable[tuple[H, bool, bool]]) -> None:
        for handle, terminal, reusable in items:
            if terminal:
                handle._notify_terminal()
            if reusable:
                handle._notify_reusable()

    # -- reconciliation after a cut ---------------------------------------------------------------

    def snapshot(self) -> list[H]:
        """The rooms to reconcile: every tracked room not yet both terminal and reusable."""
        with self._lock:
            return list(self._live.values())

    def reconcile_listing(self, snapshot: list[H], rooms: Iterable[RoomInfo]) -> list[H]:
        """Apply `ListRooms(include_terminal=True)` to `snapshot`; returns the confirmed rooms it lacks
        (to look up one by one, then `reconcile_lookup`)."""
        listed = {(r.key.room, r.key.generation, r.role): r for r in rooms}
        missing: list[H] = []
        notify: list[tuple[H, bool, bool]] = []
        with self._lock:
            self.stats.reconciles += 1
            for handle in snapshot:
                k = (handle.key.room, handle.key.generation, handle.role)
                info = listed.get(k)
                if info is not None:
                    notify.append(self._apply_info_locked(handle, k, info))
                elif handle._confirmed and (handle._outcome is None or handle._reusable is None):
                    missing.append(handle)
        self._notify(notify)
        return missing

    def reconcile_lookup(self, handle: H, info: RoomInfo | None) -> None:
        """Apply what `GetRoom` said of a room the listing lacked (None: not known)."""
        k = (handle.key.room, handle.key.generation, handle.role)
        with self._lock:
            if info is not None and info.role == handle.role:
                notify = self._apply_info_locked(handle, k, info)
            else:
                terminal = handle._set_terminal(
                    Outcome(handle.key, handle.role, succeeded=False, reason=UNKNOWN_AFTER_RECONNECT, source="reconcile")
                )
                reusable = handle._set_reusable(UNKNOWN_AFTER_RECONNECT)
                if terminal:
                    self.stats.unknown_after_reconnect += 1
                self._retire_locked(handle, k)
                notify = (handle, terminal, reusable)
        self._notify([notify])

    def _apply_info_locked(self, handle: H, k: TrackKey, info: RoomInfo) -> tuple[H, bool, bool]:
        terminal = reusable = False
        if info.terminal:
            terminal = handle._set_terminal(outcome_of_info(info))
            if terminal:
                self.stats.reconciled_outcomes += 1
        if info.reusable:
            reusable = handle._set_reusable(RECONCILED)
        self._retire_locked(handle, k)
        return handle, terminal, reusable
