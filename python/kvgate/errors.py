"""Errors as exceptions that carry the gateway's reason code.

A refused engine-API call is a gRPC status whose message starts with a reason code
(`unknown_region: region 7 is not registered`); the same code is in the `kvgate-reason` response
metadata. Each code belongs to one family, one exception class each, so an engine can catch a
family and branch on `.code`:

    try:
        client.send(key, part, chunk, slices, last=True)
    except kvgate.RoomError as e:        # room_terminal, stale_generation, ...
        if e.code == "room_terminal": ...
    except kvgate.PeerError as e:        # peer_not_connected, ...
        ...

A room that ends badly is not a refused call: its `Outcome` says so, and `Outcome.raise_for_failure()`
(or `RoomHandle.result()`) raises `TransferFailed` with the failure reason (`peer_lost`, `aborted`, ...)
as its code.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import grpc

if TYPE_CHECKING:
    from .types import Outcome

#: Metadata key that carries the machine-readable reason of a refused call.
REASON_METADATA_KEY = "kvgate-reason"

_CODE_PREFIX = re.compile(r"^([a-z][a-z0-9_]*): ")


class KvgateError(Exception):
    """Base of every kvgate error. `code` is the reason code; `status` the gRPC status code name
    (`FAILED_PRECONDITION`, ...) when the error came from a call, else empty; `details` the message."""

    #: The codes this family stands for (documentation; `error_class_for` maps them).
    codes: tuple[str, ...] = ()

    def __init__(self, code: str, details: str = "", status: str = "") -> None:
        self.code = code
        self.details = details
        self.status = status
        super().__init__(f"{code}: {details}" if details and not details.startswith(code + ":") else (details or code))


class RoomError(KvgateError):
    """The room (this key) cannot take the request: it is terminal or tombstoned, a higher generation
    exists, it is already expected, or the gateway does not know it."""

    codes = ("room_terminal", "stale_generation", "duplicate_expect", "unknown_room")


class RegionError(KvgateError):
    """A region or a slice of one is wrong: not registered, out of range, unmappable, or refused by
    every plugin."""

    codes = (
        "unknown_region",
        "slice_out_of_range",
        "memory_unavailable",
        "empty_region",
        "unsupported_memory",
        "region_in_use",
        "no_plugin_for_memory",
        "unknown_memory_kind",
        "unknown_fd_token",
        "one_fd_per_message",
        "invalid_device",
    )


class PeerError(KvgateError):
    """The named peer gateway is not connected, not configured, or not the one the room is bound to."""

    codes = ("peer_not_connected", "peer_mismatch", "unknown_peer")


class LimitError(KvgateError):
    """A configured limit was reached (`too_many_*`), or a Watch stream fell too far behind."""

    codes = (
        "too_many_rooms",
        "too_many_parts",
        "too_many_chunks",
        "too_many_slices",
        "too_many_segments",
        "too_many_pending_sends",
        "too_many_regions",
        "too_many_watchers",
        "too_many_sessions",
        "too_many_passed_fds",
        "watch_lagged",
        "watch_cursor_expired",
    )


class InvalidRequest(KvgateError):
    """The request itself is malformed: a missing field, no parts or slices, a bad timeout, or chunks
    that do not fit the room's parts (numbering, lengths)."""

    codes = (
        "missing_field",
        "empty_request",
        "invalid_timeout",
        "unknown_part",
        "duplicate_chunk",
        "out_of_order_chunk",
        "chunk_after_last",
        "length_mismatch",
        "invalid_session",
        "invalid_session_name",
    )


class SessionError(KvgateError):
    """The engine session the call names is not open (it ended: closed, or detached past the
    gateway's `engine_api.session_grace_ms`; its rooms failed `engine_lost` and its regions were
    released), or another engine has that session name open. The client opens a new session when
    its Watch stream comes back; memory must then be registered again."""

    codes = ("unknown_session", "session_in_use")


class AuthError(KvgateError):
    """The TCP engine API refused the bearer token (missing or wrong)."""

    codes = ("bad_token",)


class GatewayUnavailable(KvgateError):
    """The gateway cannot be reached, or is stopping. Codes: `gateway_stopping`, `shutdown`, and
    `unavailable` / `deadline_exceeded` / `cancelled` for transport failures without a reason code."""

    codes = ("gateway_stopping", "shutdown", "unavailable", "deadline_exceeded", "cancelled", "fd_socket_unavailable")


class TransferFailed(KvgateError):
    """A room ended without success; `code` is its failure reason (`peer_lost`, `aborted`,
    `bootstrap_timeout`, ...), `outcome` the whole outcome."""

    def __init__(self, outcome: Outcome) -> None:
        where = f" in {outcome.phase}" if outcome.phase else ""
        super().__init__(outcome.reason or "failed", f"room {outcome.key} ({outcome.role}) failed{where}")
        self.outcome = outcome


class CudaUnavailable(KvgateError):
    """CUDA memory cannot be registered from this process (no PyTorch, no CUDA build, no device)."""

    codes = ("cuda_unavailable",)

    def __init__(self, details: str) -> None:
        super().__init__("cuda_unavailable", details)


_FAMILIES: tuple[type[KvgateError], ...] = (RoomError, RegionError, PeerError, LimitError, InvalidRequest, SessionError, AuthError, GatewayUnavailable)
_BY_CODE: dict[str, type[KvgateError]] = {code: cls for cls in _FAMILIES for code in cls.codes}
_BY_STATUS: Mapping[grpc.StatusCode, type[KvgateError]] = {
    grpc.StatusCode.UNAVAILABLE: GatewayUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: GatewayUnavailable,
    grpc.StatusCode.CANCELLED: GatewayUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: RoomError,
    grpc.StatusCode.ALREADY_EXISTS: RoomError,
}


def error_class_for(code: str, status: grpc.StatusCode | None = None) -> type[KvgateError]:
    """The exception class of a reason code; an unknown code falls back on the gRPC status."""
    if code in _BY_CODE:
        return _BY_CODE[code]
    if code.startswith("too_many_"):
        return LimitError
    if status is not None and status in _BY_STATUS:
        return _BY_STATUS[status]
    return KvgateError


def _metadata_reason(metadata: Iterable[Any] | None) -> str:
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == REASON_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def reason_of(error: BaseException) -> tuple[str, str, grpc.StatusCode | None]:
    """(reason code, message, gRPC status) of a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    status: grpc.StatusCode | None = None
    details = ""
    reason = ""
    code_fn = getattr(error, "code", None)
    if callable(code_fn):
        value = code_fn()
        status = value if isinstance(value, grpc.StatusCode) else None
    details_fn = getattr(error, "details", None)
    if callable(details_fn):
        details = str(details_fn() or "")
    for attr in ("trailing_metadata", "initial_metadata"):
        fn = getattr(error, attr, None)
        if callable(fn) and not reason:
            try:
                reason = _metadata_reason(fn())
            except Exception:  # a call that never started has no metadata
                reason = ""
    if not reason:
        found = _CODE_PREFIX.match(details)
        if found:
            reason = found.group(1)
    if not reason:
        reason = status.name.lower() if status is not None else "unknown"
    return reason, details, status


def from_reason(code: str, details: str) -> KvgateError:
    """The exception for a refusal reported inside a reply (one call of a batch)."""
    return error_class_for(code)(code, details)


def from_rpc_error(error: BaseException) -> KvgateError:
    """The kvgate exception for a failed gRPC call."""
    code, details, status = reason_of(error)
    cls = error_class_for(code, status)
    return cls(code, details, status.name if status is not None else "")
