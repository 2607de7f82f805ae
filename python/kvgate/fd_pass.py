"""Passing a memory descriptor (a memfd, or any file the engine maps) to the gateway on its fd socket,
`<engine socket>.fds`: one byte with the descriptor attached (SCM_RIGHTS), answered by the line
`ok <token>` or `err <reason> <message>`. The token then goes in `RegisterMemory(passed_fd=...)`
(`Client.register_fd` does both). The gateway keeps its own copy of the descriptor while the region
is registered, so the engine may close its copy."""

from __future__ import annotations

import os
import socket

from . import errors

FD_SOCKET_SUFFIX = ".fds"


def fd_socket_path(engine_socket: str | os.PathLike[str]) -> str:
    """The fd socket beside an engine socket."""
    return os.fspath(engine_socket) + FD_SOCKET_SUFFIX


def pass_fd(engine_socket: str | os.PathLike[str], fd: int, *, timeout: float = 5.0) -> int:
    """Pass `fd` to the gateway whose engine socket is `engine_socket`; its token. Raises the
    gateway's reason as a `KvgateError` (`too_many_passed_fds`, ...) or `GatewayUnavailable`."""
    path = fd_socket_path(engine_socket)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            socket.send_fds(s, [b"F"], [fd])
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
    except OSError as e:
        raise errors.GatewayUnavailable("fd_socket_unavailable", f"{path}: {e}") from e
    line = answer.decode(errors="replace").strip()
    if line.startswith("ok "):
        return int(line[3:])
    rest = line[4:] if line.startswith("err ") else line
    reason, _, message = rest.partition(" ")
    raise errors.from_reason(reason or "fd_socket_error", message or line)
