"""What the example engines share: the shape of one request's KV cache laid out as a paged cache
(`[part][layer][token][bytes per token]`, one part per tensor-parallel rank), the scatter-gather
slices of each chunk, the deterministic bytes a prefill engine writes for a room, the rendezvous
through which the two engines agree on room ids (a stand-in for the router of a real deployment),
and a progress bar."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import kvgate

#: Where the decode engine announces its run and the prefill engine answers (same host).
DEFAULT_RENDEZVOUS = "/tmp/kvgate/example-rooms.json"


@dataclass(frozen=True)
class KvShape:
    """One request's KV cache: `parts` x `layers` x `tokens` x `token_bytes`, sent in `chunks` chunks
    of tokens per part (chunked prefill)."""

    layers: int = 8
    tokens: int = 256
    token_bytes: int = 1024
    parts: int = 2
    chunks: int = 4

    @property
    def part_bytes(self) -> int:
        return self.layers * self.tokens * self.token_bytes

    @property
    def request_bytes(self) -> int:
        return self.parts * self.part_bytes

    def chunk_tokens(self, chunk: int) -> tuple[int, int]:
        per = self.tokens // self.chunks
        start = chunk * per
        return start, (self.tokens if chunk + 1 == self.chunks else start + per)

    def _offset(self, part: int, layer: int, token: int) -> int:
        return ((part * self.layers + layer) * self.tokens + token) * self.token_bytes

    def chunk_slices(self, region: kvgate.Region, slot_offset: int, part: int, chunk: int) -> list[kvgate.Slice]:
        """One slice per layer: the chunk's tokens of that layer."""
        start, end = self.chunk_tokens(chunk)
        return [region.slice(slot_offset + self._offset(part, layer, start), (end - start) * self.token_bytes) for layer in range(self.layers)]

    def part_slices(self, region: kvgate.Region, slot_offset: int, part: int) -> list[kvgate.Slice]:
        """A part's destination: its chunks' slices in the order the sender fills them."""
        return [s for c in range(self.chunks) for s in self.chunk_slices(region, slot_offset, part, c)]

    def chunks_of(self, region: kvgate.Region, slot_offset: int) -> list[kvgate.Chunk]:
        return [
            kvgate.Chunk(part, chunk, self.chunk_slices(region, slot_offset, part, chunk), last=chunk + 1 == self.chunks)
            for chunk in range(self.chunks)
            for part in range(self.parts)
        ]


def pattern(room: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes the prefill engine writes for `room` (and the decode engine expects)."""
    seed = (room * 0x9E3779B97F4A7C15 + 1) & 0xFFFF_FFFF_FFFF_FFFF
    words = np.arange(nbytes // 8, dtype=np.uint64) ^ np.uint64(seed)
    words *= np.uint64(0xBF58476D1CE4E5B9)
    words ^= words >> np.uint64(31)
    out: np.ndarray[Any, np.dtype[np.uint8]] = words.view(np.uint8)
    return out


def checksum(data: np.ndarray[Any, np.dtype[np.uint8]]) -> str:
    return hashlib.blake2b(np.ascontiguousarray(data).tobytes(), digest_size=8).hexdigest()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def announce(path: str, info: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(json.dumps(info))
    os.replace(tmp, path)


def await_announcement(path: str, what: str, timeout: float, newer_than: float = 0.0) -> dict[str, Any]:
    """Wait for `path` written by a live process (its `pid`) after `newer_than` (wall clock)."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            info: dict[str, Any] = json.loads(Path(path).read_text())
            if pid_alive(int(info["pid"])) and float(info.get("at", 0)) >= newer_than:
                return info
        except (OSError, ValueError, KeyError):
            pass
        if not told:
            print(f"waiting for {what} ({path}) ...", file=sys.stderr)
            told = True
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not show up within {timeout:.0f} s ({path})")
        time.sleep(0.1)


def connect_error(side: str, target: str, error: kvgate.KvgateError) -> SystemExit:
    """A newcomer-readable exit for a gateway that cannot be reached."""
    config = f"configs/shm-one-host/{side}.toml"
    return SystemExit(
        f"cannot reach the {side} gateway at {target} ({error.code}): is it running?\n"
        f"  kvgate keygen psk configs/shm-one-host/peer.key   # once\n"
        f"  kvgate serve --config {config}"
    )


def shape_of(info: dict[str, Any]) -> KvShape:
    return KvShape(**info["shape"])


def shape_dict(shape: KvShape) -> dict[str, int]:
    return asdict(shape)


class Progress:
    """tqdm when it is installed, else a plain text bar on stderr."""

    def __init__(self, total: int, label: str) -> None:
        self.total = total
        self.label = label
        self.done = 0
        self.failed = 0
        self._last = 0.0
        self._tqdm: Any = None
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc=label, unit="room", file=sys.stderr)
        except ImportError:
            pass

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if self._tqdm is not None:
            self._tqdm.update(1)
            if self.failed:
                self._tqdm.set_postfix(failed=self.failed)
            return
        now = time.monotonic()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        width = 30
        filled = width * self.done // max(self.total, 1)
        failed = f", {self.failed} failed" if self.failed else ""
        end = "\n" if self.done >= self.total else ""
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} rooms{failed}{end}")
        sys.stderr.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


def results_line(role: str, rooms: int, ok: int, failed: int, corrupt: int, nbytes: int, seconds: float) -> str:
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return (
        f"{role}: {rooms} rooms: {ok} ok, {failed} failed, {corrupt} corrupt; "
        f"{nbytes / 2**20:.1f} MiB in {seconds:.2f} s = {gbps:.2f} GB/s"
    )
