"""Engines for the tests: a client, a pool split into slots, a small paged KV layout with
scatter-gather chunks, deterministic bytes per room."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

import kvgate

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "python"
#: Slack on top of a configured bound for a loaded 2-core machine (never tighter than this).
GRACE_S = 1.5


@dataclass(frozen=True)
class Layout:
    """`[part][layer][token][token_bytes]`; a chunk is a token range: one slice per layer."""

    parts: int = 2
    layers: int = 4
    tokens: int = 16
    token_bytes: int = 256
    chunks: int = 2

    @property
    def size(self) -> int:
        return self.parts * self.layers * self.tokens * self.token_bytes

    def _offset(self, part: int, layer: int, token: int) -> int:
        return ((part * self.layers + layer) * self.tokens + token) * self.token_bytes

    def chunk_slices(self, region: kvgate.Region, base: int, part: int, chunk: int) -> list[kvgate.Slice]:
        per = self.tokens // self.chunks
        start = chunk * per
        end = self.tokens if chunk + 1 == self.chunks else start + per
        return [region.slice(base + self._offset(part, layer, start), (end - start) * self.token_bytes) for layer in range(self.layers)]

    def parts_of(self, region: kvgate.Region, base: int) -> list[list[kvgate.Slice]]:
        return [[s for c in range(self.chunks) for s in self.chunk_slices(region, base, p, c)] for p in range(self.parts)]

    def chunks_of(self, region: kvgate.Region, base: int, limit: int | None = None) -> list[kvgate.Chunk]:
        count = self.chunks if limit is None else min(limit, self.chunks)
        return [
            kvgate.Chunk(p, c, self.chunk_slices(region, base, p, c), last=c + 1 == self.chunks) for c in range(count) for p in range(self.parts)
        ]


def pattern(room: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    rng = np.random.default_rng(room)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


class Engine:
    """A blocking client with a pool of `slots` slots of `layout.size` bytes, registered."""

    def __init__(
        self, target: str, layout: Layout = Layout(), slots: int = 8, *, token: str | None = None, memfd: bool = False, name: str = "engine", lane: bool = False
    ) -> None:
        self.layout = layout
        self.client = kvgate.Client(target, token=token, lane=lane)
        self.pool = kvgate.SharedPool(slots * layout.size, memfd=memfd, name=f"kvgate-test-{name}")
        self.region = self.client.register_pool(self.pool, label=name)

    def base(self, slot: int) -> int:
        return slot * self.layout.size

    def slot(self, slot: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.pool.numpy()[self.base(slot) : self.base(slot) + self.layout.size]

    def fill(self, slot: int, room: int) -> None:
        self.slot(slot)[:] = pattern(room, self.layout.size)

    def clear(self, slot: int) -> None:
        self.slot(slot)[:] = 0

    def holds(self, slot: int, room: int) -> bool:
        return bool(np.array_equal(self.slot(slot), pattern(room, self.layout.size)))

    def expect(self, room: kvgate.types.RoomKeyLike, slot: int, peer: str = "prefill", timeout_ms: int = 0) -> kvgate.RoomHandle:
        return self.client.expect(room, peer, self.layout.parts_of(self.region, self.base(slot)), timeout_ms=timeout_ms)

    def send(self, room: kvgate.types.RoomKeyLike, slot: int, peer: str = "decode", chunks: int | None = None) -> kvgate.RoomHandle:
        return self.client.send_chunks(room, self.layout.chunks_of(self.region, self.base(slot), chunks), peer=peer)

    def close(self) -> None:
        self.client.close()
        self.pool.close()


def wait_until(condition: Callable[[], bool], within: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(step)


def python_script(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """A Python child process of this interpreter (the environment's kvgate), text pipes."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kwargs)
