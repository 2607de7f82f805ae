"""kvgate: the Python client of the kvgate engine API.

An inference engine talks to its local gateway: it registers memory by reference (`SharedPool`, a
CUDA tensor), announces where a room's KV cache must land (`expect`, decode side), hands over the
chunks of a room (`send`, prefill side), and learns each room's outcome through a `RoomHandle`.
`Client` blocks; `kvgate.aio.AsyncClient` is the same for asyncio. Errors are `KvgateError`
subclasses carrying the gateway's reason code.
"""

from ._channel import default_socket
from .aio import AsyncClient
from .client import Client, wait_all
from .errors import (
    AuthError,
    CudaUnavailable,
    GatewayUnavailable,
    InvalidRequest,
    KvgateError,
    LimitError,
    PeerError,
    RegionError,
    RoomError,
    SessionError,
    TransferFailed,
)
from .memory import CudaIpcExport, SharedPool, cuda_available, cuda_ipc_export
from .rooms import AsyncRoomHandle, RoomHandle, TrackingStats
from .types import (
    RECEIVER,
    RECONCILED,
    SENDER,
    UNKNOWN_AFTER_RECONNECT,
    Chunk,
    ChunkSend,
    Expectation,
    GatewayInfo,
    Outcome,
    Region,
    RoomEvent,
    RoomInfo,
    RoomKey,
    Slice,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncRoomHandle",
    "AuthError",
    "Chunk",
    "ChunkSend",
    "Expectation",
    "GatewayInfo",
    "Client",
    "CudaIpcExport",
    "CudaUnavailable",
    "default_socket",
    "GatewayUnavailable",
    "InvalidRequest",
    "KvgateError",
    "LimitError",
    "Outcome",
    "PeerError",
    "RECEIVER",
    "RECONCILED",
    "Region",
    "RegionError",
    "RoomError",
    "RoomEvent",
    "RoomHandle",
    "RoomInfo",
    "RoomKey",
    "SENDER",
    "SessionError",
    "SharedPool",
    "Slice",
    "TrackingStats",
    "TransferFailed",
    "UNKNOWN_AFTER_RECONNECT",
    "cuda_available",
    "cuda_ipc_export",
    "wait_all",
]
