"""KV cache in GPU memory moved between two real gateways by the NVLink plugin: PyTorch CUDA tensors on
both sides, registered the way the SGLang backend registers them (`RegionMap.locate`: by IPC handle,
or, for PyTorch's expandable segments, which have none, by the VMM allocation's descriptor), a room
expected and sent through the engine API, and the decode tensor compared with the prefill tensor.

Needs an NVIDIA GPU, PyTorch with CUDA and the plugin library (`target/release/libkvgate_nvlink.so`, or
`KVGATE_NVLINK_PLUGIN`); without them every test is skipped with the reason, never passed. Each case
runs in a fresh Python process, because PyTorch reads its allocator settings once, at its first CUDA
allocation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import kvgate
from gateways import Pair

REPO = Path(__file__).resolve().parents[2]
#: How long one case's engine process may run.
CASE_TIMEOUT_S = 120.0


def nvlink_plugin() -> Path:
    explicit = os.environ.get("KVGATE_NVLINK_PLUGIN")
    return Path(explicit) if explicit else REPO / "target" / "release" / "libkvgate_nvlink.so"


def needs_gpu() -> None:
    ok, why = kvgate.cuda_available()
    if not ok:
        pytest.skip(f"needs a CUDA GPU and PyTorch with CUDA: {why}")
    if not nvlink_plugin().exists():
        pytest.skip(f"needs the NVLink plugin library at {nvlink_plugin()} (cargo build --release -p kvgate-plugin-nvlink-so)")


#: The engine side of one case, run as `python -c ENGINE <prefill socket> <decode socket> <room>`:
#: allocates, registers through RegionMap, moves one room of two parts and prints a JSON verdict.
ENGINE = r"""
import json, sys, torch, kvgate
from kvgate.sglang.memory import CudaVmmBacking, RegionMap, cuda_backing
from kvgate.types import Slice

prefill_socket, decode_socket, room = sys.argv[1], sys.argv[2], int(sys.argv[3])
part_bytes = 8 << 20
# Odd offsets inside bigger allocations, as PyTorch's caching allocator hands tensors out.
src_block = torch.empty(2 * part_bytes + 4096, dtype=torch.uint8, device="cuda")
dst_block = torch.zeros(2 * part_bytes + 8192, dtype=torch.uint8, device="cuda")
src = src_block[1024:1024 + 2 * part_bytes]
dst = dst_block[3072:3072 + 2 * part_bytes]
src.copy_(torch.randint(0, 256, (2 * part_bytes,), dtype=torch.uint8, device="cuda"))
torch.cuda.synchronize()
backings = []
for t in (src, dst):
    b = cuda_backing(t.data_ptr())
    backings.append(type(b).__name__)
    if isinstance(b, CudaVmmBacking):
        __import__("os").close(b.fd)
with kvgate.Client(prefill_socket) as prefill, kvgate.Client(decode_socket) as decode:
    p_map, d_map = RegionMap(prefill, "prefill"), RegionMap(decode, "decode")
    s_region, s_off = p_map.locate(src.data_ptr(), src.numel(), "kv")
    d_region, d_off = d_map.locate(dst.data_ptr(), dst.numel(), "kv")
    key = kvgate.RoomKey(room, 0)
    parts = [[Slice(d_region, d_off + i * part_bytes, part_bytes)] for i in range(2)]
    receiver = decode.expect(key, "prefill", parts, source_kinds=["cuda_device", "cuda_device"])
    sender = None
    for i in range(2):
        sender = prefill.send(key, i, 0, [Slice(s_region, s_off + i * part_bytes, part_bytes)], last=True, peer="decode")
    got = receiver.result(timeout=30)
    sent = sender.result(timeout=30)
    info = decode.room(key)
    torch.cuda.synchronize()
    print(json.dumps({
        "succeeded": bool(got.succeeded), "bytes": got.bytes, "sender_bytes": sent.bytes,
        "plugin": info.plugin, "equal": bool(torch.equal(src, dst)),
        "untouched_around": bool(dst_block[:3072].eq(0).all() and dst_block[3072 + 2 * part_bytes:].eq(0).all()),
        "plugins": sorted({name for r in p_map.regions + d_map.regions for name in r.plugins}),
        "backings": backings,
        "expandable": "expandable_segments:True" in (__import__("os").environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""),
    }))
"""


@pytest.fixture
def gpu_pair(start_pair: Callable[..., Pair]) -> Pair:
    needs_gpu()
    env = {"KVGATE__PLUGINS__PREFERENCE": "nvlink,shm", "KVGATE__PLUGINS__LIBRARIES": str(nvlink_plugin())}
    return start_pair(env=env)


@pytest.mark.parametrize("allocator", ["cudaMalloc", "expandable_segments"])
def test_a_room_of_gpu_kv_moves_through_nvlink_and_the_bytes_match(gpu_pair: Pair, allocator: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    if allocator == "expandable_segments":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    room = 700 if allocator == "cudaMalloc" else 701
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, gpu_pair.prefill.socket, gpu_pair.decode.socket, str(room)],
        env=env, capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
    )
    assert done.returncode == 0, f"engine process failed:\n{done.stdout}\n{done.stderr}\n{gpu_pair.decode.log()[-3000:]}"
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["succeeded"] and verdict["bytes"] == 16 << 20 and verdict["sender_bytes"] == 16 << 20, verdict
    assert verdict["plugin"] == "nvlink", verdict
    assert verdict["equal"], f"the decode tensor differs from the prefill tensor: {verdict}"
    assert verdict["untouched_around"], f"bytes landed outside the destination slices: {verdict}"
    assert verdict["expandable"] == (allocator == "expandable_segments")
    # How the SGLang backend registered the memory: by IPC handle, or (expandable segments) by descriptor.
    expected = "CudaVmmBacking" if allocator == "expandable_segments" else "CudaBacking"
    assert verdict["backings"] == [expected, expected], verdict
    assert "nvlink" in verdict["plugins"], verdict
    assert gpu_pair.decode.wait_rooms_empty(10) == [] and gpu_pair.prefill.wait_rooms_empty(10) == []
