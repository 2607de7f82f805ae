"""The backend's parts that need no gateway: room ids, page slices, shared host buffers, and its
registration into SGLang (enum, argument choices, `get_kv_class` wherever SGLang imported it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import REPO
from kvgate.sglang.layout import AUX, KV, STATE, Buffer, DecodeRank, Layout, PartSpec, PrefillRank, room_id
from kvgate.types import Slice


def test_room_ids_are_stable_and_distinct_per_rank_pair() -> None:
    # The formula is part of the wire contract between the two sides: this value must not change.
    assert room_id(12345, PrefillRank(0, 0, 0, 0), DecodeRank(0, 0, 0, 0, 0)) == room_id(12345, (0, 0, 0, 0), (0, 0, 0, 0, 0))
    seen = set()
    for p_tp in range(4):
        for p_dp in range(2):
            for d_tp in range(4):
                for d_dp in range(2):
                    seen.add(room_id(7, PrefillRank(p_dp, 0, p_tp, 0), DecodeRank(d_dp, d_dp, 0, d_tp, 0)))
    assert len(seen) == 64
    assert all(0 <= r < 1 << 63 for r in seen)
    assert room_id(7, PrefillRank(), DecodeRank()) != room_id(8, PrefillRank(), DecodeRank())
    assert room_id(-1, PrefillRank(), DecodeRank()) == room_id((1 << 64) - 1, PrefillRank(), DecodeRank())


def test_pages_become_merged_slices() -> None:
    b = Buffer(region=3, offset=1000, length=64 * 10, item_len=64)
    assert b.items([2, 3, 4, 7, 8, 1]) == [Slice(3, 1128, 192), Slice(3, 1448, 128), Slice(3, 1064, 64)]
    assert b.items([]) == []
    with pytest.raises(IndexError):
        b.items([10])
    layout = Layout(kv=[b, Buffer(4, 0, 640, 64)], aux=[Buffer(5, 0, 80, 8)], state=[[Buffer(6, 0, 320, 32)]])
    specs = layout.part_specs(3, aux=True, state_components=[0])
    assert specs == [PartSpec(KV, 0), PartSpec(KV, 1), PartSpec(AUX, 0), PartSpec(STATE, 0, 0)]
    assert layout.part_specs(0, aux=False, state_components=[]) == []
    assert [PartSpec.decode(s.encode()) for s in specs] == specs
    assert layout.slices(specs[2], [], 4, None) == [Slice(5, 32, 8)]
    assert layout.slices(specs[3], [], None, [[1, 2]]) == [Slice(6, 32, 64)]


def test_shared_allocation_puts_cpu_tensors_in_shared_memory() -> None:
    torch = pytest.importorskip("torch")
    from kvgate.sglang.memory import host_backing, shared_allocation

    with shared_allocation():
        a = torch.zeros((4, 8), dtype=torch.bfloat16)
        b = torch.full((3,), -1, dtype=torch.int64)
        c = torch.empty(5)
    plain = torch.zeros(16)
    assert float(a.abs().sum()) == 0 and b.tolist() == [-1, -1, -1] and c.dtype == torch.get_default_dtype()
    for t in (a, b, c):
        backing = host_backing(t.data_ptr(), t.nbytes)
        assert backing is not None and backing.path.startswith("/proc/")
    assert host_backing(plain.data_ptr(), plain.nbytes) is None


def test_registered_into_sglang() -> None:
    pytest.importorskip("sglang")
    import kvgate.sglang
    from kvgate.sglang import conn

    kvgate.sglang.register()
    kvgate.sglang.register()
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.managers.disagg_service as disagg_service
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    backend = TransferBackend("kvgate")
    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("kvgate") == 1
    assert [m.value for m in TransferBackend].count("kvgate") == 1
    for module in (prefill, decode, disagg_service):
        assert module.get_kv_class(backend, KVClassType.MANAGER) is conn.KvgateKVManager
        assert module.get_kv_class(backend, KVClassType.SENDER) is conn.KvgateKVSender
        assert module.get_kv_class(backend, KVClassType.RECEIVER) is conn.KvgateKVReceiver
        assert module.get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER) is conn.KvgateKVBootstrapServer
        assert module.get_kv_class(backend, KVClassType.KVARGS) is KVArgs
        assert module.get_kv_class(TransferBackend.FAKE, KVClassType.KVARGS) is KVArgs
    # Under SGLANG_RUST_SERVER, SGLang's Rust registry stands in for any bootstrap server derived from
    # its own, this one included (it then carries no gateway names: KVGATE_SGLANG_PREFILL_PEER).
    assert disagg_service.rust_server_serves_kv_bootstrap("kvgate")


def test_launcher_offers_the_backend() -> None:
    pytest.importorskip("sglang")
    env = {"PYTHONPATH": str(REPO / "python"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "kvgate.sglang.launch_server", "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mooncake_tcp,kvgate}" in done.stdout


def test_spawned_processes_are_registered_too() -> None:
    """SGLang starts its schedulers with the spawn method: under the launcher they know the backend."""
    pytest.importorskip("sglang")
    here = REPO / "python" / "tests_sglang"
    env = {"PYTHONPATH": f"{REPO / 'python'}:{here}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "KVGATE_SGLANG_LAUNCHER": "spawn_probe"}
    done = subprocess.run([sys.executable, "-m", "kvgate.sglang.launch_server"], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child: KvgateKVManager" in done.stdout, done.stdout + done.stderr[-2000:]


def test_the_room_timeout_is_read_under_its_earlier_name_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvgate.sglang.conn import Settings

    monkeypatch.delenv("KVGATE_SGLANG_ROOM_TIMEOUT_MS", raising=False)
    monkeypatch.setenv("KVGATE_SGLANG_ROOM_DEADLINE_MS", "1500")
    assert Settings.from_env().room_timeout_ms == 1500
    assert any("KVGATE_SGLANG_ROOM_DEADLINE_MS is the earlier name" in r.message for r in caplog.records)
    # The current name wins when both are set, and then nothing is said.
    caplog.clear()
    monkeypatch.setenv("KVGATE_SGLANG_ROOM_TIMEOUT_MS", "2500")
    assert Settings.from_env().room_timeout_ms == 2500
    assert not caplog.records


def test_the_lane_setting_is_read_and_a_bad_value_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgate.sglang.conn import Settings

    monkeypatch.delenv("KVGATE_SGLANG_LANE", raising=False)
    assert Settings.from_env().lane is False
    for on in ("1", "true", "YES", "on"):
        monkeypatch.setenv("KVGATE_SGLANG_LANE", on)
        assert Settings.from_env().lane is True, on
    monkeypatch.setenv("KVGATE_SGLANG_LANE", "0")
    assert Settings.from_env().lane is False
    monkeypatch.setenv("KVGATE_SGLANG_LANE", "maybe")
    with pytest.raises(ValueError, match="KVGATE_SGLANG_LANE='maybe'"):
        Settings.from_env()
