"""The silent pin, driven through SGLang's own prefill queue logic: `process_disagg_prefill_inflight_queue`
(the real method, on a minimal scheduler stand-in) polls a request whose decode side is gone until it
leaves the inflight queue as failed. The queue's length, the gauge that stayed at 1.0, returns to 0
within kvgate's bound, and SGLang logs the failure with kvgate's reason."""

from __future__ import annotations

import time
from typing import Callable

import pytest

import kvgate
from gateways import Pair
from harness import FAILED, GRACE_S, SUCCESS, WAITING, Engines
from kvgate.sglang.layout import DecodeRank, PrefillRank, room_key


def prefill_ready_to_send(e: Engines, room: int, pages: list[int]) -> None:
    e.decode.call("new_receiver", room=room)
    e.prefill.call("new_sender", room=room)
    e.decode.call("send_metadata", room=room, pages=pages, aux=2, prefix=0)
    e.prefill.wait_poll(room, {WAITING}, GRACE_S * 3)
    e.prefill.call("init", room=room, pages=len(pages), aux=3)


def drain(e: Engines, room: int, within: float) -> tuple[float, list[int]]:
    """Send the request's KV (as the scheduler does when its forward ends), put it in the inflight
    queue and run SGLang's queue step until it leaves; (seconds, queue lengths seen)."""
    e.prefill.call("send", room=room, pages=[20, 21, 22, 23])
    lengths = [e.prefill.call("inflight_add", room=room)["queue"]]
    started = time.monotonic()
    while lengths[-1] > 0:
        assert time.monotonic() - started < within, f"request {room} still in the inflight queue after {within} s: {lengths[-8:]}"
        step = e.prefill.call("inflight_step")
        lengths.append(step["queue"])
        if step["queue"]:
            time.sleep(0.02)
        else:
            assert step["done"] == [f"req-{room}"]
    return time.monotonic() - started, lengths


def test_decode_abort_before_the_prefill_side_registered_the_room(shared: tuple[Pair, Engines]) -> None:
    pair, e = shared
    # 1. The decode engine aborts (kvgate Abort and SGLang's abort message) before the prefill rank
    #    has sent anything: its gateway has no sender room yet.
    prefill_ready_to_send(e, 300, [30, 31, 32, 33])
    e.decode.call("abort", room=300)
    took, lengths = drain(e, 300, GRACE_S)
    assert lengths[0] == 1 and lengths[-1] == 0
    # 2. The abort reaches only the decode gateway (no SGLang message): kvgate alone must end it.
    prefill_ready_to_send(e, 301, [34, 35, 36, 37])
    with kvgate.Client(pair.decode.socket, session=False) as client:
        assert client.abort(room_key(301, PrefillRank(), DecodeRank()), "decode gone")
    took, lengths = drain(e, 301, GRACE_S)
    assert lengths[0] == 1 and lengths[-1] == 0
    logged = e.prefill.call("logs", grep="Prefill transfer failed")["logs"]
    # Room 300 had both messages: SGLang's abort (`aborted`), or kvgate's, which may reach the prefill
    # gateway before its Send (`room_terminal`) or after it (`aborted_by_peer`).
    assert any("bootstrap_room=300" in line and ("aborted" in line or "room_terminal" in line) for line in logged), logged
    # Room 301 had kvgate's only, which travels over the peer link while the prefill rank sends: it
    # fails `room_terminal` or `aborted_by_peer`, or, when the abort arrived after the prefill
    # gateway had written every byte into the decode pool (same host, shared memory), succeeds,
    # and then the decode side's abort still stands.
    lines_301 = [line for line in logged if "bootstrap_room=301" in line]
    if lines_301:
        assert any("aborted_by_peer" in line or "room_terminal" in line for line in lines_301), lines_301
    else:
        assert e.prefill.poll(301) == SUCCESS, e.prefill.call("logs", grep="301")["logs"][-12:]
        e.decode.wait_poll(301, {FAILED}, GRACE_S)


@pytest.mark.parametrize("plugin", ["quic", "shm"])
def test_frozen_decode_gateway(start_engines: Callable[..., tuple[Pair, Engines]], plugin: str) -> None:
    """The decode gateway is frozen (SIGSTOP) as the prefill rank sends. Through QUIC the bytes need
    the frozen gateway: the prefill gateway declares it lost after its heartbeat bound and the
    request leaves the queue failed `peer_lost`. Through shared memory (one host) the prefill
    gateway writes the decode pool itself: the request leaves the queue succeeded. Either way the
    queue empties within the bound; after the thaw the decode side ends too."""
    pair, e = start_engines(env={"KVGATE__PLUGINS__PREFERENCE": plugin})
    prefill_ready_to_send(e, 310, [40, 41, 42, 43])
    pair.decode.freeze()
    try:
        took, lengths = drain(e, 310, pair.settings.peer_loss_bound_s + GRACE_S)
        assert lengths[-1] == 0
        logged = e.prefill.call("logs", grep="Prefill transfer failed")["logs"]
        if plugin == "quic":
            assert any("bootstrap_room=310" in line and "peer_lost" in line for line in logged), logged
        else:
            assert not logged, logged
    finally:
        pair.decode.thaw()
    state, _ = e.decode.wait_poll(310, {0, 4}, pair.settings.quarantine_timeout_ms / 1000 + GRACE_S * 2)
    assert state == (0 if plugin == "quic" else 4)
