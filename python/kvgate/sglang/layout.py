"""How an SGLang request maps onto kvgate rooms and parts, without SGLang itself.

* **Room ids.** kvgate rooms are `RoomKey(room, generation)` per gateway. One SGLang request
  (`bootstrap_room`) moves between several pairs of ranks, and every pair gets its own room:

      room = blake2b-64(b"kvgate-sglang/1" | bootstrap_room | prefill rank | decode rank) & (2**63 - 1)
      generation = 0

  with `bootstrap_room` as 8 little-endian bytes (modulo 2**64), the prefill rank as its
  bootstrap-server coordinates `(dp, cp, tp, pp)` and the decode rank as `(system_dp, attn_dp,
  cp, tp, pp)`, each an unsigned 32-bit little-endian integer. Both sides compute it; the decode
  side also sends it to the prefill side, which checks it.
* **Parts.** A part's destination is filled in chunk order, so each part is one buffer whose
  stream is that buffer's pages in token order: one part per KV buffer (`KVArgs.kv_data_ptrs`:
  per layer, K then V, then draft layers), one per metadata (aux) buffer, one per state buffer of
  each state component. A page `p` of a buffer with item length `n` is the `n` bytes at `p * n`.
  Which parts a room has is decided by the decode side (`PartSpec`s, in the order of the room's
  parts) and sent to the prefill side with the room's metadata.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

from ..types import RoomKey, Slice

ROOM_MASK = (1 << 63) - 1
_ROOM_TAG = b"kvgate-sglang/1"

#: Part kinds.
KV = "kv"
AUX = "aux"
STATE = "state"


class PrefillRank(NamedTuple):
    """A prefill rank as SGLang's bootstrap server files it."""

    dp: int = 0
    cp: int = 0
    tp: int = 0
    pp: int = 0


class DecodeRank(NamedTuple):
    """A decode rank: system data-parallel replica, attention DP/CP/TP rank, pipeline stage."""

    system_dp: int = 0
    attn_dp: int = 0
    cp: int = 0
    tp: int = 0
    pp: int = 0


def room_id(bootstrap_room: int, prefill: Sequence[int], decode: Sequence[int]) -> int:
    """The kvgate room id of one (request, prefill rank, decode rank) triple (module docstring)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOM_TAG)
    h.update(struct.pack("<Q", bootstrap_room & ((1 << 64) - 1)))
    for rank in (prefill, decode):
        h.update(struct.pack(f"<B{len(rank)}I", len(rank), *(int(x) & 0xFFFFFFFF for x in rank)))
    return int.from_bytes(h.digest(), "little") & ROOM_MASK


def room_key(bootstrap_room: int, prefill: Sequence[int], decode: Sequence[int]) -> RoomKey:
    return RoomKey(room_id(bootstrap_room, prefill, decode), 0)


@dataclass(frozen=True)
class Buffer:
    """One SGLang buffer as registered: where it starts inside a kvgate region, how long it is and
    how many bytes one item (a page of KV, a slot of aux or state) takes."""

    region: int
    offset: int
    length: int
    item_len: int

    def items(self, indices: Iterable[int]) -> list[Slice]:
        """The slices of items `indices`, in that order; runs of consecutive items become one slice."""
        out: list[Slice] = []
        run_start = run_end = -1
        n = self.item_len
        for raw in indices:
            i = int(raw)
            if i < 0 or (i + 1) * n > self.length:
                raise IndexError(f"item {i} lies outside the buffer ({self.length // n if n else 0} items of {n} bytes)")
            if i == run_end:
                run_end += 1
                continue
            if run_start >= 0:
                out.append(Slice(self.region, self.offset + run_start * n, (run_end - run_start) * n))
            run_start, run_end = i, i + 1
        if run_start >= 0:
            out.append(Slice(self.region, self.offset + run_start * n, (run_end - run_start) * n))
        return out


class PartSpec(NamedTuple):
    """Which buffer a part is: `(KV, i)`, `(AUX, j)` or `(STATE, component, buffer)`."""

    kind: str
    number: int
    sub: int = 0

    def encode(self) -> list[object]:
        return [self.kind, self.number, self.sub]

    @classmethod
    def decode(cls, raw: Sequence[object]) -> PartSpec:
        kind, number, sub = raw
        if kind not in (KV, AUX, STATE):
            raise ValueError(f"unknown part kind {kind!r}")
        return cls(str(kind), int(str(number)), int(str(sub)))


@dataclass(frozen=True)
class Layout:
    """The registered buffers of one rank, in `KVArgs` order."""

    kv: Sequence[Buffer]
    aux: Sequence[Buffer]
    state: Sequence[Sequence[Buffer]]

    def buffer(self, spec: PartSpec) -> Buffer:
        if spec.kind == KV:
            return self.kv[spec.number]
        if spec.kind == AUX:
            return self.aux[spec.number]
        return self.state[spec.number][spec.sub]

    def signature(self) -> dict[str, object]:
        """What both sides must agree on: every buffer's item length."""
        return {
            KV: [b.item_len for b in self.kv],
            AUX: [b.item_len for b in self.aux],
            STATE: [[b.item_len for b in comp] for comp in self.state],
        }

    def part_specs(self, kv_pages: int, aux: bool, state_components: Iterable[int]) -> list[PartSpec]:
        """The parts of a room with `kv_pages` pages, an aux slot or not, and these state components."""
        specs = [PartSpec(KV, i) for i in range(len(self.kv))] if kv_pages > 0 else []
        if aux:
            specs += [PartSpec(AUX, j) for j in range(len(self.aux))]
        for c in state_components:
            specs += [PartSpec(STATE, c, b) for b in range(len(self.state[c]))]
        return specs

    def slices(self, spec: PartSpec, kv_pages: Sequence[int], aux_index: int | None, state_indices: Sequence[Sequence[int] | None] | None) -> list[Slice]:
        """The slices of part `spec` for these pages, aux slot and state indices."""
        buffer = self.buffer(spec)
        if spec.kind == KV:
            return buffer.items(kv_pages)
        if spec.kind == AUX:
            if aux_index is None:
                raise ValueError("an aux part needs an aux index")
            return buffer.items([aux_index])
        indices = state_indices[spec.number] if state_indices is not None and spec.number < len(state_indices) else None
        if indices is None:
            raise ValueError(f"state component {spec.number} has no indices")
        return buffer.items(_flat(indices))


def _flat(indices: object) -> list[int]:
    """State indices as SGLang passes them (a list, a NumPy array, nested one level) as ints."""
    tolist = getattr(indices, "tolist", None)
    values: Any = tolist() if callable(tolist) else indices
    out: list[int] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(int(x) for x in v)
        else:
            out.append(int(v))
    return out


def state_components(state_indices: Sequence[object] | None) -> list[int]:
    """The state components that carry indices."""
    if not state_indices:
        return []
    return [c for c, indices in enumerate(state_indices) if indices is not None and len(_flat(indices)) > 0]
