"""Where a client connects, how its channel is set up, and the engine API's methods on a channel.

The method table is the one place that names the RPCs; `test_api_surface` checks it against the
service in the generated descriptor, so a method added to the proto shows up as a failing test.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Tuple

from ._proto import kvgate_pb2 as pb



def default_socket() -> str:
    """The gateway's default engine socket (`engine_api.unix_socket` when the config names none):
    `$XDG_RUNTIME_DIR/kvgate/engine.sock`, else `/tmp/kvgate-<uid>/engine.sock`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/"):
        return runtime.rstrip("/") + "/kvgate/engine.sock"
    return f"/tmp/kvgate-{os.getuid()}/engine.sock"


#: Environment variable naming the default target when none is given.
TARGET_ENV = "KVGATE_ENGINE_API"
#: The service's full name, as in `/kvgate.v1.EngineApi/Send`.
SERVICE = "kvgate.v1.EngineApi"
#: Default deadline of a unary call, in seconds.
DEFAULT_TIMEOUT_S = 30.0

Metadata = Tuple[Tuple[str, str], ...]


@dataclass(frozen=True)
class Target:
    """A parsed target: a Unix socket path, or a TCP `host:port`."""

    grpc_target: str
    unix_path: str = ""
    tcp_address: str = ""

    @property
    def is_unix(self) -> bool:
        return bool(self.unix_path)

    def __str__(self) -> str:
        return self.unix_path or self.tcp_address


def parse_target(target: str | os.PathLike[str] | None) -> Target:
    """`/path/engine.sock`, `unix:/path`, `unix:///path` (Unix socket); `host:port`, `tcp://host:port`,
    `http://host:port` (TCP). None: `$KVGATE_ENGINE_API`, else the gateway's default socket."""
    if target is None:
        target = os.environ.get(TARGET_ENV) or default_socket()
    text = os.fspath(target)
    if text.startswith("unix://"):
        text = text[len("unix://") :]
        return Target(f"unix:{text}", unix_path=text)
    if text.startswith("unix:"):
        text = text[len("unix:") :]
        return Target(f"unix:{text}", unix_path=text)
    for scheme in ("tcp://", "http://", "grpc://"):
        if text.startswith(scheme):
            address = text[len(scheme) :].rstrip("/")
            return Target(address, tcp_address=address)
    if text.startswith(("/", ".", "~")) or Path(text).suffix == ".sock" or ":" not in text:
        path = str(Path(text).expanduser())
        return Target(f"unix:{path}", unix_path=path)
    return Target(text, tcp_address=text)


def channel_options(target: Target) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        # ListRooms of a busy gateway may be large.
        ("grpc.max_receive_message_length", 64 << 20),
        # A local gateway that restarts should be found again within a second, not after grpc's
        # default backoff (up to two minutes).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_retries", 0),
    ]
    if target.is_unix:
        # grpc-python sends the socket path as `:authority` on `unix:` targets; a path is no valid
        # authority and the gateway's HTTP/2 server resets such streams. Send a plain host name.
        options.append(("grpc.default_authority", "localhost"))
    return options


def read_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    if token is not None:
        return token.strip()
    if token_file is not None:
        return Path(token_file).read_text(encoding="utf-8").strip()
    return None


def call_metadata(token: str | None, session: int | None = None) -> Metadata:
    md: Metadata = (("authorization", f"Bearer {token}"),) if token else ()
    if session is not None:
        md += ((SESSION_METADATA_KEY, str(session)),)
    return md


def auto_session_name() -> str:
    """A session name of this process: host, pid and a random tag ([A-Za-z0-9._:-], <= 128 chars)."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:64] or "host"
    return f"py:{host}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Method:
    name: str
    request: Any
    reply: Any
    streaming: bool = False

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


#: The metadata key that names the engine session of a call (engine API v2).
SESSION_METADATA_KEY = "kvgate-session"

METHODS: Sequence[Method] = (
    Method("OpenSession", pb.OpenSessionRequest, pb.OpenSessionReply),
    Method("CloseSession", pb.CloseSessionRequest, pb.CloseSessionReply),
    Method("Info", pb.InfoRequest, pb.InfoReply),
    Method("RegisterMemory", pb.RegisterMemoryRequest, pb.RegisterMemoryReply),
    Method("UnregisterMemory", pb.UnregisterMemoryRequest, pb.UnregisterMemoryReply),
    Method("Expect", pb.ExpectRequest, pb.ExpectReply),
    Method("Send", pb.SendRequest, pb.SendReply),
    Method("SendBatch", pb.SendBatchRequest, pb.BatchReply),
    Method("ExpectBatch", pb.ExpectBatchRequest, pb.BatchReply),
    Method("Abort", pb.AbortRequest, pb.AbortReply),
    Method("GetRoom", pb.GetRoomRequest, pb.RoomInfo),
    Method("ListRooms", pb.ListRoomsRequest, pb.ListRoomsReply),
    Method("Watch", pb.WatchRequest, pb.RoomEvent, streaming=True),
)
METHOD = {m.name: m for m in METHODS}
