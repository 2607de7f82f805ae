"""Aborts on either side in every phase of a request. An abort never blocks and fails the request
locally at once; the other side fails within kvgate's bounds; the decode side reports `Failed` only
once its pages can no longer be written (every room reusable)."""

from __future__ import annotations

from harness import FAILED, GRACE_S, SUCCESS, TRANSFERRING, WAITING, Engine, Engines

#: An abort call returns at once (the gateway's answer is not waited for).
ABORT_RETURNS_S = 1.0


def start(e: Engines, room: int, phase: str) -> None:
    """Bring request `room` to `phase`: `created` (both sides made), `bootstrapped` (decode sent its
    metadata, prefill is WaitingForInput), `transferring` (prefill sent its first chunk)."""
    e.decode.call("new_receiver", room=room)
    e.prefill.call("new_sender", room=room)
    if phase == "created":
        return
    e.decode.call("send_metadata", room=room, pages=[1, 2, 3, 4], aux=1, prefix=0)
    e.prefill.wait_poll(room, {WAITING}, GRACE_S * 3)
    e.prefill.call("init", room=room, pages=4, aux=2)
    if phase == "bootstrapped":
        return
    e.prefill.call("send", room=room, pages=[5, 6])


def failed_decode(e: Engines, room: int, within: float) -> dict[str, object]:
    """Wait for the decode side's Failed; check that its rooms were reusable by then."""
    state, _ = e.decode.wait_poll(room, {FAILED, SUCCESS}, within)
    assert state == FAILED
    reusable = e.decode.call("reusable", room=room)["reusable"]
    assert all(r is not None for r in reusable), f"decode reported Failed with a room not reusable: {reusable}"
    return e.decode.call("failure", room=room)


def failed(engine: Engine, room: int, within: float) -> dict[str, object]:
    state, _ = engine.wait_poll(room, {FAILED, SUCCESS}, within)
    assert state == FAILED
    return engine.call("failure", room=room)


def test_decode_aborts_in_every_phase(engines: Engines) -> None:
    e = engines
    for room, phase in ((100, "created"), (101, "bootstrapped"), (102, "transferring")):
        start(e, room, phase)
        answer = e.decode.call("abort", room=room)
        assert answer["abort_s"] < ABORT_RETURNS_S, phase
        # No room posted yet: Failed at once. Otherwise Failed once the rooms are reusable.
        assert answer["poll"] in ((FAILED,) if phase == "created" else (FAILED, TRANSFERRING)), phase
        decode = failed_decode(e, room, GRACE_S)
        assert decode["code"] == "aborted" and decode["sglang_error"] == "KVTransferError", decode
        prefill = failed(e.prefill, room, GRACE_S)
        print(f"decode abort while {phase}: decode {decode['text']!r}; prefill {prefill['code']}: {prefill['text']!r}")
        assert prefill["code"] in ("aborted_by_peer", "aborted_by_decode", "room_terminal", "aborted") or "aborted by the decode side" in str(prefill["text"]), (phase, prefill)


def test_prefill_aborts_in_every_phase(engines: Engines) -> None:
    e = engines
    for room, phase in ((110, "created"), (111, "bootstrapped"), (112, "transferring")):
        start(e, room, phase)
        answer = e.prefill.call("abort", room=room)
        assert answer["abort_s"] < ABORT_RETURNS_S and answer["poll"] == FAILED, (phase, answer)
        assert e.prefill.call("failure", room=room)["code"] == "aborted"
        if phase == "created":
            # The decode side posts its rooms after the abort: the prefill rank aborts them on arrival.
            e.decode.call("send_metadata", room=room, pages=[1, 2, 3, 4], aux=1, prefix=0)
        decode = failed_decode(e, room, GRACE_S)
        print(f"prefill abort while {phase}: decode {decode['code']}: {decode['text']!r}")
        assert decode["code"] == "aborted_by_peer", (phase, decode)
        assert "aborted_by_peer" in str(decode["text"]) and "phase" in str(decode["text"])


def test_a_request_after_aborts_still_succeeds(engines: Engines) -> None:
    e = engines
    e.prefill.call("randomize", seed=5)
    e.decode.call("zero")
    e.transfer(120, [7, 8, 9], [10, 11, 12], 4, 5)
    assert e.decode.call("digest", pages=[10, 11, 12], aux=5)["digest"] == e.prefill.call("digest", pages=[7, 8, 9], aux=4)["digest"]
