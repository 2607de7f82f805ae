"""`python -m kvgate.bench` runs against real gateways and reports every figure."""

from __future__ import annotations

import json
from pathlib import Path

from gateways import Pair
from helpers import python_script


def test_bench_reports_per_call_and_per_room_figures(pair: Pair, workdir: Path) -> None:
    out = workdir / "bench.json"
    proc = python_script(
        ["-m", "kvgate.bench", "--prefill", pair.prefill.socket, "--decode", pair.decode.socket, "--prefill-name", "prefill",
         "--decode-name", "decode", "--calls", "200", "--rooms", "40", "--concurrency", "8", "--json", str(out)]
    )
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    # Nine over gRPC, and two on the engine fast lane (the gateways open it by default).
    assert len(figures) == 11, list(figures)
    for name, f in figures.items():
        assert f["calls"] > 0 and f["us_per_call"] > 0 and f["calls_per_s"] > 0, name
        assert name in stdout
    assert any(n.startswith("raw gRPC round trip, blocking") for n in figures)
    assert any(n.startswith("minimal room, asyncio") for n in figures)
    assert "kvgate.Client(lane=True).rooms() (ListRooms)" in figures
    assert "minimal room, blocking on the fast lane: expect + send + both outcomes" in figures
    assert pair.decode.wait_rooms_empty(5) == [] and pair.prefill.wait_rooms_empty(5) == []
