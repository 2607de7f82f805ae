"""An engine process for the tests: registers a pool, posts its side of some rooms, prints `ready`,
then waits to be killed.

    python engine_proc.py expect SOCKET PEER ROOM...          # decode side: one expect per room
    python engine_proc.py send-first SOCKET PEER ROOM...      # prefill side: the first of two chunks
"""

from __future__ import annotations

import sys
import time

import kvgate

ROOM_BYTES = 64 * 1024


def main(argv: list[str]) -> int:
    mode, socket, peer, rooms = argv[0], argv[1], argv[2], [int(r) for r in argv[3:]]
    client = kvgate.Client(socket)
    # A memfd: nothing is left in /dev/shm when the process is killed (the gateway keeps its mapping).
    pool = kvgate.SharedPool(len(rooms) * ROOM_BYTES, memfd=True, name="kvgate-test-engine-proc")
    region = client.register_pool(pool, label=f"engine process {mode}")
    half = ROOM_BYTES // 2
    for i, room in enumerate(rooms):
        base = i * ROOM_BYTES
        if mode == "expect":
            client.expect(room, peer, [[region.slice(base, ROOM_BYTES)]])
        elif mode == "send-first":
            client.send(room, 0, 0, [region.slice(base, half)], peer=peer)
        else:
            raise SystemExit(f"unknown mode {mode}")
    print("ready", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
