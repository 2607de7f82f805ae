"""Faults under a request in flight: the decode gateway killed (and started again), the prefill
engine killed. Each side ends within kvgate's bounds, the decode side only once its pages are safe,
and the engines go on serving."""

from __future__ import annotations

from typing import Callable

from gateways import Pair
from harness import FAILED, GRACE_S, SUCCESS, WAITING, Engines


def half_sent(e: Engines, room: int) -> None:
    e.decode.call("new_receiver", room=room)
    e.prefill.call("new_sender", room=room)
    e.decode.call("send_metadata", room=room, pages=[1, 2, 3, 4], aux=1, prefix=0)
    e.prefill.wait_poll(room, {WAITING}, GRACE_S * 3)
    e.prefill.call("init", room=room, pages=4, aux=2)
    e.prefill.call("send", room=room, pages=[5, 6])


def test_decode_gateway_killed(start_engines: Callable[..., tuple[Pair, Engines]]) -> None:
    pair, e = start_engines()
    half_sent(e, 400)
    pair.decode.kill()
    state, took = e.prefill.wait_poll(400, {FAILED, SUCCESS}, pair.settings.peer_loss_bound_s + GRACE_S)
    assert state == FAILED
    assert e.prefill.call("failure", room=400)["code"] == "peer_lost"
    # The decode engine cannot learn anything while its gateway is gone: it keeps the pages.
    assert e.decode.poll(400) != FAILED
    pair.decode.start()
    pair.decode.wait_ready()
    # The new gateway process does not know the room: the client's reconciliation ends it, and its
    # memory is reusable (no process that could write it is left).
    state, _ = e.decode.wait_poll(400, {FAILED, SUCCESS}, GRACE_S * 2)
    assert state == FAILED
    assert e.decode.call("failure", room=400)["code"] == "unknown_after_reconnect"
    # The engines go on: the decode rank registers its buffers again with the new gateway.
    e.prefill.call("randomize", seed=9)
    e.decode.call("zero")
    e.transfer(401, [3, 4, 5], [6, 7, 8], 1, 2)
    assert e.decode.call("digest", pages=[6, 7, 8], aux=2)["digest"] == e.prefill.call("digest", pages=[3, 4, 5], aux=1)["digest"]


def test_prefill_engine_killed(start_engines: Callable[..., tuple[Pair, Engines]]) -> None:
    # SGLang's own heartbeat to the prefill bootstrap server is slowed down, so that the failure seen
    # is kvgate's: the prefill engine's session ends after its grace, its rooms fail `engine_lost`.
    pair, e = start_engines(engine_env={"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "60"})
    half_sent(e, 410)
    e.prefill.kill()
    grace_s = (pair.settings.session_grace_ms or 0) / 1000
    state, took = e.decode.wait_poll(410, {FAILED, SUCCESS}, grace_s + GRACE_S)
    assert state == FAILED
    assert all(r is not None for r in e.decode.call("reusable", room=410)["reusable"])
    failure = e.decode.call("failure", room=410)
    assert failure["code"] == "aborted_by_peer" and "engine_lost" in str(failure["text"]), failure
