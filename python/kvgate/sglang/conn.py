"""kvgate as an SGLang transfer backend: the KV manager, sender, receiver and bootstrap server.

They subclass SGLang's `Common*` classes (`sglang.srt.disaggregation.common.conn`), as SGLang's
Mooncake backend does, and keep what those own: the bootstrap HTTP server, the rank topology, the
ZMQ side channel between a decode rank and the prefill ranks it pulls from, heartbeats, SGLang's
own timeouts. The bytes move through the engines' kvgate gateways:

* The manager connects to its gateway (`KVGATE_SGLANG_ENGINE_API`, else `KVGATE_ENGINE_API`, else
  the gateway's default socket) in an engine session, and registers every buffer of `KVArgs` (KV,
  aux, state) by reference (`memory.RegionMap`).
* Decode, `send_metadata`: one `ExpectBatch` with a room per prefill rank it pulls from
  (`layout.room_id`), one part per buffer, the pages it needs as slices; then the room's metadata
  (its gateway, ranks, pages and parts) to each prefill rank over SGLang's side channel.
* Prefill: the metadata makes the request `WaitingForInput`; each `send(kv_indices)` is one
  `SendBatch` with a send per part for that chunk (aux and state parts go with the last chunk).
* `poll`: the rooms' outcomes. A decode room that failed is reported `Failed` only once the gateway
  says its destination is `Reusable` (no late write can land in pages SGLang then frees).
* `abort`: kvgate `Abort` of the rooms (on a background thread: never blocks) and the request is
  failed locally at once; no answer from anyone is needed.
* `failure_exception`: `KvgateTransferError` (an SGLang `KVTransferError`) with the gateway's reason
  code, phase and elapsed time; `get_transfer_metric`: from the rooms' `Terminal` events.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Optional

from aiohttp import web  # type: ignore[import-not-found, unused-ignore]
from sglang.srt.disaggregation.base.conn import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # type: ignore[import-not-found, import-untyped, unused-ignore]
from sglang.srt.runtime_context import get_parallel  # type: ignore[import-not-found, import-untyped, unused-ignore]

from ..client import Client
from ..errors import KvgateError
from ..rooms import RoomHandle
from ..types import ChunkSend, Expectation, Outcome, RoomKey
from .layout import AUX, KV, Buffer, DecodeRank, Layout, PartSpec, PrefillRank, room_key, state_components
from .memory import RegionMap

logger = logging.getLogger(__name__)

REGISTER_TAG = b"KVGATE_REG"
METADATA_TAG = b"KVGATE_META"
#: How many aborted bootstrap rooms a prefill rank remembers (an abort can come before the request).
ABORTED_ROOMS_REMEMBERED = 65536


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    return float(raw) if raw.strip() else default


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _env_bool(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(_TRUE[:2])} or {', '.join(_FALSE[1:3])}")


#: Earlier names of settings, still read (with a warning) when the current name is unset.
RENAMED_ENV = {"KVGATE_SGLANG_ROOM_TIMEOUT_MS": "KVGATE_SGLANG_ROOM_DEADLINE_MS"}


def _env_float_renamed(name: str, default: float) -> float:
    """`_env_float(name)`, or the setting's earlier name when only that one is set."""
    old = RENAMED_ENV[name]
    if not os.environ.get(name, "").strip() and os.environ.get(old, "").strip():
        logger.warning("kvgate: %s is the earlier name of %s; it is read for now, rename it", old, name)
        return _env_float(old, default)
    return _env_float(name, default)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The backend's settings (environment variables of the SGLang processes)."""

    #: The gateway's engine API: a Unix socket or `host:port` (`{rank}` is the engine rank).
    engine_api: str | None
    token_file: str | None
    #: This gateway's peer name, when the gateway does not say it (engine API v1).
    gateway_name: str
    #: Decode: the prefill gateway to expect from when the bootstrap server names none.
    prefill_peer: str
    #: Decode: how long each room may live, in ms (0: the decode gateway's `room_timeout_ms`).
    room_timeout_ms: int
    #: Decode: how long a failed request waits for its rooms' `Reusable` at most, in seconds.
    release_timeout_s: float
    #: Make the engine-API calls on the gateway's engine fast lane (`<socket>.lane`) instead of gRPC.
    lane: bool = False

    @classmethod
    def from_env(cls, engine_rank: int = 0) -> Settings:
        api = os.environ.get("KVGATE_SGLANG_ENGINE_API") or os.environ.get("KVGATE_ENGINE_API") or None
        return cls(
            engine_api=api.replace("{rank}", str(engine_rank)) if api else None,
            token_file=os.environ.get("KVGATE_SGLANG_TOKEN_FILE") or None,
            gateway_name=os.environ.get("KVGATE_SGLANG_GATEWAY", ""),
            prefill_peer=os.environ.get("KVGATE_SGLANG_PREFILL_PEER", ""),
            room_timeout_ms=int(_env_float_renamed("KVGATE_SGLANG_ROOM_TIMEOUT_MS", 0)),
            release_timeout_s=_env_float("KVGATE_SGLANG_RELEASE_TIMEOUT_S", 60.0),
            lane=_env_bool("KVGATE_SGLANG_LANE"),
        )


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a request's transfer failed: the kvgate reason code (or the local cause), the phase it
    failed in, how long the room had run, and the text SGLang logs."""

    code: str
    phase: str = ""
    elapsed_ms: int = 0
    text: str = ""

    @classmethod
    def of_outcome(cls, outcome: Outcome, side: str) -> Failure:
        peer = f", peer reason {outcome.peer_reason}" if outcome.peer_reason else ""
        text = (
            f"kvgate room {outcome.key} ({side}) failed: {outcome.reason} in phase {outcome.phase or '-'} "
            f"after {outcome.elapsed_ms} ms{peer}"
        )
        return cls(outcome.reason, outcome.phase, outcome.elapsed_ms, text)

    @classmethod
    def of_error(cls, error: KvgateError, what: str) -> Failure:
        return cls(error.code, "call", 0, f"kvgate {what} refused: {error}")


class KvgateTransferError(KVTransferError):  # type: ignore[misc]
    """SGLang's `KVTransferError` with kvgate's reason `code`, `phase` and `elapsed_ms`."""

    def __init__(self, bootstrap_room: int, failure: Failure, is_from_another_rank: bool = False) -> None:
        super().__init__(bootstrap_room, failure.text or failure.code, is_from_another_rank=is_from_another_rank)
        self.code = failure.code
        self.phase = failure.phase
        self.elapsed_ms = failure.elapsed_ms


@dataclasses.dataclass(frozen=True)
class DecodeTarget:
    """Prefill side: one decode rank a request goes to, as its metadata said."""

    endpoint: str
    gateway: str
    rank: DecodeRank
    key: RoomKey | None
    dummy: bool
    pages: int
    prefix: int
    parts: tuple[PartSpec, ...]


def _metric(outcomes: list[Outcome], metric: Any) -> Any:
    if outcomes and all(o.succeeded for o in outcomes):
        metric.transfer_latency_s = max(o.elapsed_ms for o in outcomes) / 1000.0
        total = sum(o.bytes for o in outcomes)
        if total:
            metric.transfer_total_bytes = total
    return metric


class KvgateKVManager(CommonKVManager):  # type: ignore[misc]
    """One rank's connection to its kvgate gateway, its registered buffers, and (prefill) the
    decode metadata of its requests."""

    sender_trace_module = None

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any, is_mla_backend: Optional[bool] = False) -> None:
        self.settings = Settings.from_env(int(getattr(args, "engine_rank", 0) or 0))
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        session = f"sglang-{role}-{os.getpid()}-r{getattr(args, 'engine_rank', 0)}-pp{getattr(args, 'pp_rank', 0)}"
        self.client = Client(self.settings.engine_api, token_file=self.settings.token_file, session=session, lane=self.settings.lane)
        self.gateway_name = self.settings.gateway_name or self.client.info().gateway
        if not self.gateway_name:
            raise RuntimeError("kvgate: the gateway does not say its name (engine API v1): set KVGATE_SGLANG_GATEWAY to its [gateway] name")
        self._stopped = False
        self._aborts = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-abort")
        self._aborted_lock = threading.Lock()
        self._aborted_rooms: collections.OrderedDict[int, float] = collections.OrderedDict()
        #: Prefill: why a request failed before its sender learnt it (the decode side's abort message).
        self.local_failures: dict[int, Failure] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.regions = RegionMap(self.client, label=f"sglang {role} rank {getattr(args, 'engine_rank', 0)}")
        self.layout = self._register_buffers(args)
        self._threads: list[threading.Thread] = []
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self.targets: dict[int, dict[str, DecodeTarget]] = {}
            thread = threading.Thread(target=self._prefill_loop, name="kvgate-bootstrap", daemon=True)
            thread.start()
            self._threads.append(thread)
        else:
            self._threads.append(self._start_heartbeat_checker_thread())
        logger.info(
            "kvgate: %s rank %s on gateway %s (%s), %d KV, %d aux and %d state buffers in %d regions",
            role,
            getattr(args, "engine_rank", 0),
            self.gateway_name,
            self.client.target,
            len(self.layout.kv),
            len(self.layout.aux),
            sum(len(c) for c in self.layout.state),
            len(self.regions.regions),
        )

    # -- memory --------------------------------------------------------------------------------

    def _register_buffers(self, args: KVArgs) -> Layout:
        def buffer(ptr: int, length: int, item_len: int, what: str) -> Buffer:
            if length == 0:
                return Buffer(0, 0, 0, int(item_len))
            region, offset = self.regions.locate(int(ptr), int(length), what)
            return Buffer(region, offset, int(length), int(item_len))

        kv = [buffer(p, n, i, f"kv {k}") for k, (p, n, i) in enumerate(zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens))]
        aux = [buffer(p, n, i, f"aux {k}") for k, (p, n, i) in enumerate(zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens))]
        state = [
            [buffer(p, n, i, f"state {c}.{k}") for k, (p, n, i) in enumerate(zip(ptrs, lens, items))]
            for c, (ptrs, lens, items) in enumerate(
                zip(getattr(args, "state_data_ptrs", None) or [], getattr(args, "state_data_lens", None) or [], getattr(args, "state_item_lens", None) or [])
            )
        ]
        return Layout(kv, aux, state)

    def refresh_regions(self, error: KvgateError) -> bool:
        """After `unknown_region` (the gateway restarted and forgot its registrations): register the
        buffers again. True if it did."""
        if error.code != "unknown_region":
            return False
        logger.warning("kvgate: the gateway no longer knows this rank's regions (%s): registering them again", error)
        self.regions = RegionMap(self.client, label=self.regions.label)
        self.layout = self._register_buffers(self.kv_args)
        return True

    # -- ranks -----------------------------------------------------------------------------------

    def prefill_rank(self) -> PrefillRank:
        """This prefill rank as the bootstrap server files it (see `register_to_bootstrap`)."""
        tp, cp = self.attn_tp_rank, self.attn_cp_rank
        if get_parallel().enable_cp_tp_group_sharing:
            tp, cp = self.attn_cp_rank, 0
        dp = self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank
        return PrefillRank(int(dp), int(cp), int(tp), int(self.pp_rank))

    def decode_rank(self) -> DecodeRank:
        return DecodeRank(int(self.system_dp_rank), int(self.attn_dp_rank), int(self.attn_cp_rank), int(self.attn_tp_rank), int(self.pp_rank))

    def endpoint(self) -> str:
        return f"{self.local_ip}:{self.rank_port}"

    # -- bootstrap ---------------------------------------------------------------------------------

    def _register_topology_row(self, url: str, payload: dict[str, Any]) -> None:
        # The prefill rank's gateway goes into its bootstrap row (KvgateKVBootstrapServer serves it).
        super()._register_topology_row(url, {**payload, "kvgate_gateway": self.gateway_name})

    def build_receiver_registration_message(self) -> list[bytes]:
        body = {"endpoint": self.endpoint(), "gateway": self.gateway_name, "decode": list(self.decode_rank()), "layout": self.layout.signature()}
        return [REGISTER_TAG, json.dumps(body).encode()]

    # -- aborts --------------------------------------------------------------------------------------

    def abort_rooms(self, keys: list[RoomKey], why: str) -> None:
        """kvgate `Abort` of `keys`, on the abort thread: never blocks, failures are logged."""
        if not keys or self._stopped:
            return

        def run() -> None:
            for key in keys:
                try:
                    self.client.abort(key, why)
                except Exception as e:  # noqa: BLE001 - logged, the local failure stands
                    logger.warning("kvgate: Abort of room %s (%s) failed: %s", key, why, e)

        try:
            self._aborts.submit(run)
        except RuntimeError:
            pass

    def note_aborted(self, bootstrap_room: int) -> None:
        with self._aborted_lock:
            self._aborted_rooms[bootstrap_room] = time.monotonic()
            self._aborted_rooms.move_to_end(bootstrap_room)
            while len(self._aborted_rooms) > ABORTED_ROOMS_REMEMBERED:
                self._aborted_rooms.popitem(last=False)

    def was_aborted(self, bootstrap_room: int) -> bool:
        with self._aborted_lock:
            return bootstrap_room in self._aborted_rooms

    def record_first_failure(self, bootstrap_room: int, text: str) -> None:
        with self.failure_lock:
            self.failure_records.setdefault(bootstrap_room, text)

    # -- prefill: decode metadata --------------------------------------------------------------------

    def _prefill_loop(self) -> None:
        recv = self._make_worker_recv(self.server_socket)
        while not self._stopped:
            try:
                msg = recv()
            except Exception as e:  # noqa: BLE001 - socket closed at teardown
                if self._stopped:
                    return
                logger.warning("kvgate: bootstrap channel: %s", e)
                continue
            if msg is None:
                continue
            try:
                self._on_decode_message(msg)
            except Exception:
                logger.exception("kvgate: bad message from a decode rank")

    def _on_decode_message(self, msg: list[bytes]) -> None:
        tag = msg[0]
        if tag == ABORT_TAG:
            note = AbortNotification.from_zmq(msg)
            if note is not None:
                self.on_decode_abort(int(note.room))
        elif tag == REGISTER_TAG:
            body = json.loads(msg[1])
            logger.debug("kvgate: decode rank %s (gateway %s) registered", body.get("endpoint"), body.get("gateway"))
        elif tag == METADATA_TAG:
            self.on_decode_metadata(json.loads(msg[1]))
        else:
            logger.warning("kvgate: unknown message %r from a decode rank", tag[:32])

    def on_decode_metadata(self, body: dict[str, Any]) -> None:
        room = int(body["room"])
        rank = DecodeRank(*body["decode"])
        dummy = bool(body["dummy"])
        key = room_key(room, self.prefill_rank(), rank) if not dummy else None
        target = DecodeTarget(
            endpoint=str(body["endpoint"]),
            gateway=str(body["gateway"]),
            rank=rank,
            key=key,
            dummy=dummy,
            pages=int(body["pages"]),
            prefix=int(body.get("prefix") or 0),
            parts=tuple(PartSpec.decode(p) for p in body.get("parts", [])),
        )
        problem = None
        if not dummy:
            if body.get("key") != key.room:  # type: ignore[union-attr]
                problem = f"room id mismatch: decode {target.endpoint} computed {body.get('key')}, this prefill rank {key}"
            elif body.get("layout") != self.layout.signature():
                problem = f"buffer layout mismatch with decode {target.endpoint}: decode {body.get('layout')}, prefill {self.layout.signature()}"
        targets = self.targets.setdefault(room, {})
        targets[target.endpoint] = target
        if problem is not None:
            logger.error("kvgate: request %s: %s", room, problem)
            self.record_first_failure(room, problem)
            self.update_status(room, KVPoll.Bootstrapping)
            self.update_status(room, KVPoll.Failed)
            self.abort_rooms([key] if key else [], "layout_mismatch")
            return
        if self.was_aborted(room):
            self.abort_rooms([key] if key else [], "aborted")
            return
        if len(targets) >= int(body["required"]):
            self.transfer_infos[room] = targets
            self.req_to_decode_prefix_len[room] = max((t.prefix for t in targets.values()), default=0)
            self.update_status(room, KVPoll.WaitingForInput)

    def on_decode_abort(self, room: int) -> None:
        """The decode side gave up the request (SGLang's ABORT message)."""
        self.note_aborted(room)
        keys = [t.key for t in self.targets.get(room, {}).values() if t.key is not None]
        if room in self.request_status and self.request_status.get(room) != KVPoll.Success:
            failure = Failure("aborted_by_peer", "bootstrap" if room not in self.transfer_infos else "transfer", 0, "aborted by the decode side (its abort message)")
            self.local_failures.setdefault(room, failure)
            self.record_first_failure(room, failure.text)
            self.update_status(room, KVPoll.Failed)
        self.abort_rooms(keys, "aborted_by_decode")

    def forget_room(self, room: int) -> None:
        self.targets.pop(room, None)
        self.local_failures.pop(room, None)

    def teardown(self) -> None:
        self._stopped = True
        self._aborts.shutdown(wait=False)
        self.client.close()


class KvgateKVSender(CommonKVSender):  # type: ignore[misc]
    """Prefill side of one request: its chunks as `SendBatch`es, its outcome from the rooms."""

    kv_mgr: KvgateKVManager
    conclude_state: Any
    _transfer_start_time: float | None

    def __init__(self, mgr: KvgateKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.handles: dict[RoomKey, RoomHandle] = {}
        self.kv_chunks = 0
        self.last_sent = False
        self.failure: Failure | None = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if mgr.was_aborted(bootstrap_room) and self.conclude_state is None:
            self._fail(Failure("aborted_by_peer", "bootstrap", 0, "aborted by the decode side before the request reached this prefill rank"))

    def _targets(self) -> dict[str, DecodeTarget]:
        targets: dict[str, DecodeTarget] = self.kv_mgr.transfer_infos.get(self.bootstrap_room) or {}
        return targets

    def _keys(self) -> list[RoomKey]:
        keys = set(self.handles)
        known = self.kv_mgr.targets.get(self.bootstrap_room) or {}
        keys.update(t.key for t in known.values() if t.key is not None)
        return sorted(keys)

    def _fail(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure
            logger.warning("kvgate: request %s (prefill): %s", self.bootstrap_room, failure.text)
        self.kv_mgr.record_first_failure(self.bootstrap_room, failure.text)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.kv_mgr.abort_rooms(self._keys(), failure.code or "failed")

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        super().init(num_kv_indices, aux_index)
        for target in self._targets().values():
            if not target.dummy and target.pages != num_kv_indices:
                self._fail(
                    Failure(
                        "page_count_mismatch",
                        "bootstrap",
                        0,
                        f"decode {target.endpoint} expects {target.pages} pages, this prefill has {num_kv_indices} to send",
                    )
                )
                return

    def send(self, kv_indices: Any, state_indices: Optional[list[Any]] = None, num_kv_tokens: Optional[int] = None, indices_event: Optional[object] = None) -> None:
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed) or self.failure is not None:
            return
        if self.bootstrap_room in self.kv_mgr.local_failures:
            self._fail(self.kv_mgr.local_failures[self.bootstrap_room])
            return
        kv_indices, _index_slice, is_last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if skip:
            return
        state_indices = self.kv_mgr.prepare_send_state_indices(state_indices)
        if self._transfer_start_time is None:
            self._transfer_start_time = time.perf_counter()
        targets = self._targets()
        if not targets:
            self._fail(Failure("no_metadata", "send", 0, "the decode side's metadata for this request has not arrived"))
            return
        pages = [int(p) for p in kv_indices]
        for attempt in (0, 1):
            sends = self._chunk_sends(targets, pages, is_last, state_indices)
            if sends is None:
                return
            if not sends:
                break
            try:
                results = self.kv_mgr.client.send_batch(sends)
            except KvgateError as e:
                if attempt == 0 and self.kv_mgr.refresh_regions(e):
                    continue
                self._fail(Failure.of_error(e, "SendBatch"))
                return
            refused = [(send, r) for send, r in zip(sends, results) if isinstance(r, KvgateError)]
            if attempt == 0 and refused and len(refused) == len(sends) and self.kv_mgr.refresh_regions(refused[0][1]):
                continue
            for send, result in zip(sends, results):
                if not isinstance(result, KvgateError):
                    self.handles[RoomKey(*send.key)] = result  # type: ignore[misc]
            if refused:
                send, error = refused[0]
                self._fail(Failure.of_error(error, f"send of room {send.key} part {send.part} chunk {send.chunk}"))
                return
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Transferring)
            break
        if pages:
            self.kv_chunks += 1
        if is_last:
            self.last_sent = True
            if not self.handles:
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
        self._record_transfer_indices(kv_indices, state_indices)

    def _chunk_sends(self, targets: dict[str, DecodeTarget], pages: list[int], is_last: bool, state_indices: Any) -> list[ChunkSend] | None:
        """This chunk's sends: per decode target, one per KV part (and on the last chunk one per aux
        and state part). None (and the request failed) when the indices do not fit the buffers."""
        layout = self.kv_mgr.layout
        sends: list[ChunkSend] = []
        try:
            for target in targets.values():
                if target.dummy or target.key is None:
                    continue
                for part, spec in enumerate(target.parts):
                    if spec.kind == KV:
                        if pages or is_last:
                            sends.append(ChunkSend(target.key, part, self.kv_chunks, layout.slices(spec, pages, None, None), last=is_last, peer=target.gateway))
                    elif is_last:
                        aux_index = self.aux_index if spec.kind == AUX else None
                        sends.append(ChunkSend(target.key, part, 0, layout.slices(spec, [], aux_index, state_indices), last=True, peer=target.gateway))
        except (IndexError, ValueError) as e:
            self._fail(Failure("bad_indices", "send", 0, f"cannot map this chunk onto the registered buffers: {e}"))
            return None
        return sends

    def poll(self) -> Any:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.failure is None and self.bootstrap_room in self.kv_mgr.local_failures:
            self._fail(self.kv_mgr.local_failures[self.bootstrap_room])
        if self.failure is None:
            for handle in self.handles.values():
                outcome = handle.poll()
                if outcome is not None and not outcome.succeeded:
                    self._fail(Failure.of_outcome(outcome, "prefill"))
                    break
            else:
                expected = {t.key for t in self._targets().values() if t.key is not None}
                if self.last_sent and expected <= set(self.handles) and all((h.poll() or _PENDING).succeeded for h in self.handles.values()):
                    self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
        return self._poll_with_status(self.kv_mgr.check_status)

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        self.clear()
        with self.kv_mgr.failure_lock:
            text = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        failure = self.failure or Failure("failed", "", 0, text or "failed due to an unknown reason from another rank")
        if text and not self.failure:
            failure = dataclasses.replace(failure, text=text)
        raise KvgateTransferError(self.bootstrap_room, failure, is_from_another_rank=text is None and self.failure is None)

    def abort(self) -> None:
        super().abort()
        if self.failure is None:
            self.failure = Failure("aborted", "engine", 0, "Aborted by AbortReq.")
        self.kv_mgr.note_aborted(self.bootstrap_room)
        self.kv_mgr.abort_rooms(self._keys(), "aborted")

    def get_transfer_metric(self) -> KVTransferMetric:
        metric = super().get_transfer_metric()
        outcomes = [o for o in (h.poll() for h in self.handles.values()) if o is not None]
        if len(outcomes) == len(self.handles):
            _metric(outcomes, metric)
        return metric

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget_room(self.bootstrap_room)


class _Pending:
    succeeded = False


_PENDING = _Pending()


class KvgateKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """Decode side of one request: its rooms' `Expect`s, and its outcome once their destinations
    are reusable."""

    kv_mgr: KvgateKVManager
    conclude_state: Any
    bootstrap_infos: Any
    init_time: float | None

    def __init__(self, mgr: KvgateKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None) -> None:
        self.handles: dict[RoomKey, RoomHandle] = {}
        self.failure: Failure | None = None
        self._failed_at: float | None = None
        self._metadata_sent = False
        super().__init__(mgr, bootstrap_addr, bootstrap_room)

    # -- bootstrap -----------------------------------------------------------------------------------

    def _get_bootstrap_info_from_server(self, prefill_dp_rank: Any, prefill_cp_rank: Any, target_tp_rank: Any, target_pp_rank: Any) -> Any:
        info = super()._get_bootstrap_info_from_server(prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)
        if info is not None:
            info["kvgate_rank"] = [int(prefill_dp_rank), int(prefill_cp_rank), int(target_tp_rank), int(target_pp_rank)]
        return info

    def init(self, prefill_dp_rank: int) -> None:
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is not None and self.conclude_state is None:
            problem = None
            if info.pp_size != 1:
                problem = f"prefill pipeline parallelism ({info.pp_size} stages) is not supported by the kvgate backend"
            elif info.attn_cp_size != 1 or self.kv_mgr.attn_cp_size != 1:
                problem = "attention context parallelism is not supported by the kvgate backend"
            elif not self.kv_mgr.is_mla_backend and info.attn_tp_size != self.kv_mgr.attn_tp_size:
                problem = f"prefill attention TP {info.attn_tp_size} differs from decode's {self.kv_mgr.attn_tp_size}: the kvgate backend moves whole pages"
            if problem is not None:
                self._conclude_failed(Failure("unsupported_topology", "bootstrap", 0, problem))
                return
        super().init(prefill_dp_rank)

    # -- metadata ------------------------------------------------------------------------------------

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: Optional[int] = None,
        state_indices: Optional[list[Any]] = None,
        decode_prefix_len: Optional[int] = None,
        destination: Any = KVTransferDestination.DEVICE,
        device_kv_indices: Any = None,
    ) -> None:
        with self._lifecycle_lock:
            self._send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, destination)

    def _send_metadata(self, kv_indices: Any, aux_index: Optional[int], state_indices: Optional[list[Any]], decode_prefix_len: Optional[int], destination: Any) -> None:
        if self.conclude_state is not None or self.failure is not None:
            return
        if self.bootstrap_infos is None:
            super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("the kvgate backend receives into device (pool) destinations only")
        mgr = self.kv_mgr
        pages = [int(p) for p in kv_indices]
        specs = mgr.layout.part_specs(len(pages), aux_index is not None, state_components(state_indices))
        keys: dict[int, RoomKey] = {}
        for attempt in (0, 1):
            expectations = self._expectations(specs, pages, aux_index, state_indices, keys)
            if expectations is None:
                return
            if not expectations:
                break
            try:
                results = mgr.client.expect_batch(expectations)
            except KvgateError as e:
                if attempt == 0 and mgr.refresh_regions(e):
                    continue
                self._conclude_failed(Failure.of_error(e, "ExpectBatch"))
                return
            refused = [r for r in results if isinstance(r, KvgateError)]
            if attempt == 0 and refused and len(refused) == len(results) and mgr.refresh_regions(refused[0]):
                continue
            for expectation, result in zip(expectations, results):
                if not isinstance(result, KvgateError):
                    self.handles[RoomKey(*expectation.key)] = result  # type: ignore[misc]
            if refused:
                self._note_failure(Failure.of_error(refused[0], "Expect"))
                if not self.handles:
                    self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                    self.conclude_state = KVPoll.Failed
                self.ensure_abort_notified()
                return
            break
        body = {
            "room": self.bootstrap_room,
            "endpoint": mgr.endpoint(),
            "gateway": mgr.gateway_name,
            "decode": list(mgr.decode_rank()),
            "required": self.required_dst_info_num,
            "prefix": int(decode_prefix_len or 0),
            "pages": len(pages),
            "parts": [s.encode() for s in specs],
            "layout": mgr.layout.signature(),
        }
        for n, info in enumerate(self.bootstrap_infos):
            key = keys.get(n)
            message = {**body, "dummy": key is None, "key": key.room if key is not None else None}
            try:
                sock, lock = self._connect_to_bootstrap_server(info)
                with lock:
                    sock.send_multipart([METADATA_TAG, json.dumps(message).encode()])
            except Exception as e:  # noqa: BLE001 - zmq errors: the request fails, its rooms are aborted
                self.invalidate_cached_bootstrap_infos()
                self._note_failure(Failure("prefill_unreachable", "bootstrap", 0, f"metadata to prefill {info.get('rank_ip')}:{info.get('rank_port')} failed: {e}"))
                return
        self._metadata_sent = True
        self.init_time = time.time()

    def _expectations(self, specs: list[PartSpec], pages: list[int], aux_index: Optional[int], state_indices: Any, keys: dict[int, RoomKey]) -> list[Expectation] | None:
        """One expect per prefill rank this request pulls from (dummy ranks send nothing); None (and
        the request failed) when the destination does not fit the buffers or a peer is unknown."""
        mgr = self.kv_mgr
        try:
            parts = [mgr.layout.slices(spec, pages, aux_index, state_indices) for spec in specs]
        except (IndexError, ValueError) as e:
            self._conclude_failed(Failure("bad_indices", "expect", 0, f"cannot map the destination onto the registered buffers: {e}"))
            return None
        expectations: list[Expectation] = []
        for n, info in enumerate(self.bootstrap_infos):
            if info.get("is_dummy"):
                continue
            peer = info.get("kvgate_gateway") or mgr.settings.prefill_peer
            if not peer:
                where = f"{info.get('rank_ip')}:{info.get('rank_port')}"
                self._conclude_failed(Failure("unknown_peer", "expect", 0, f"prefill rank {where} named no kvgate gateway (set KVGATE_SGLANG_PREFILL_PEER)"))
                return None
            keys[n] = room_key(self.bootstrap_room, info["kvgate_rank"], mgr.decode_rank())
            expectations.append(Expectation(keys[n], peer, parts, mgr.settings.room_timeout_ms))
        return expectations

    # -- outcome ----------------------------------------------------------------------------------

    def _note_failure(self, failure: Failure) -> None:
        """The request has failed: abort its rooms now; `poll` says `Failed` once they are reusable."""
        if self.failure is None:
            self.failure = failure
            self._failed_at = time.monotonic()
            logger.warning("kvgate: request %s (decode): %s", self.bootstrap_room, failure.text)
        self.kv_mgr.record_first_failure(self.bootstrap_room, failure.text)
        self.kv_mgr.abort_rooms(sorted(self.handles), failure.code or "failed")

    def _conclude_failed(self, failure: Failure) -> None:
        self._note_failure(failure)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def _released(self) -> bool:
        """No byte can land in the request's pages any more (or the bounded wait for that is over)."""
        if all(h.poll_reusable() is not None for h in self.handles.values()):
            return True
        waited = time.monotonic() - (self._failed_at or time.monotonic())
        if waited >= self.kv_mgr.settings.release_timeout_s:
            logger.error(
                "kvgate: request %s: rooms %s not reusable %.0f s after the failure; releasing its pages anyway",
                self.bootstrap_room,
                [str(k) for k, h in self.handles.items() if h.poll_reusable() is None],
                waited,
            )
            return True
        return False

    def _poll(self) -> Any:
        if self.conclude_state is not None:
            return self.conclude_state
        mgr = self.kv_mgr
        if self.failure is None:
            for handle in self.handles.values():
                outcome = handle.poll()
                if outcome is not None and not outcome.succeeded:
                    self._note_failure(Failure.of_outcome(outcome, "decode"))
                    break
        status = mgr.request_status.get(self.bootstrap_room, KVPoll.Failed)
        if self.failure is None:
            if status == KVPoll.Failed:
                with mgr.failure_lock:
                    text = mgr.failure_records.get(self.bootstrap_room, "failed")
                self._note_failure(Failure("failed", "", 0, text))
            elif self._metadata_sent and all((h.poll() or _PENDING).succeeded for h in self.handles.values()):
                mgr.update_status(self.bootstrap_room, KVPoll.Success)
                self.conclude_state = KVPoll.Success
                return KVPoll.Success
            else:
                started = self.init_time if self._metadata_sent else self._prefill_wait_start
                if started is not None and time.time() - started >= mgr.waiting_timeout:
                    phase = "transfer" if self._metadata_sent else "bootstrap"
                    self._note_failure(Failure("timeout", phase, int((time.time() - started) * 1000), f"timed out after {time.time() - started:.1f} s ({phase})"))
                    self.ensure_abort_notified()
        if self.failure is not None:
            if not self._released():
                return KVPoll.Transferring
            mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return KVPoll.Failed
        if self._metadata_sent:
            return KVPoll.Transferring
        return status

    def abort(self) -> None:
        with self._lifecycle_lock:
            if self.conclude_state is None:
                self._note_failure(Failure("aborted", "engine", 0, "Aborted by AbortReq."))
                if not self.handles:
                    self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                    self.conclude_state = KVPoll.Failed
            self.ensure_abort_notified()

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        self.clear()
        with self.kv_mgr.failure_lock:
            text = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        failure = self.failure or Failure("failed", "", 0, text or "failed due to an unknown reason from another rank")
        raise KvgateTransferError(self.bootstrap_room, failure, is_from_another_rank=text is None and self.failure is None)

    def get_transfer_metric(self) -> KVTransferMetric:
        outcomes = [o for o in (h.poll() for h in self.handles.values()) if o is not None]
        return _metric(outcomes, KVTransferMetric()) if len(outcomes) == len(self.handles) else KVTransferMetric()


class KvgateKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """SGLang's bootstrap server, also serving each prefill rank's kvgate gateway name in its
    `/route` answer (`kvgate_gateway`), so that decode knows whom to expect the KV from."""

    def __init__(self, host: str, port: int) -> None:
        self.kvgate_gateways: dict[tuple[int, int, int, int], str] = {}
        super().__init__(host, port)

    async def _handle_route_put(self, request: Any) -> Any:
        data = await request.json()
        response = await super()._handle_route_put(request)
        if response.status == 200 and data.get("kvgate_gateway"):
            dp = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
            rank = (int(dp), int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
            self.kvgate_gateways[rank] = str(data["kvgate_gateway"])
        return response

    async def _handle_route_get(self, request: Any) -> Any:
        response = await super()._handle_route_get(request)
        query = request.query
        try:
            rank = tuple(int(query.get(k, "-1")) for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"))
        except ValueError:
            return response
        if response.status != 200 or rank == (-1, -1, -1, -1) or rank not in self.kvgate_gateways:
            return response
        body = json.loads(response.text)
        body["kvgate_gateway"] = self.kvgate_gateways[rank]
        return web.json_response(body, status=200)
