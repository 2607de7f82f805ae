"""An SGLang engine rank for the tests, in a process of its own, driven over stdin/stdout (one JSON
command per line, one JSON answer per line).

It is as much of SGLang's prefill or decode scheduler as the transfer backend sees: the real
`ServerArgs` published into SGLang's runtime context (a tiny model config, CPU), SGLang's own KV
pool (`MHATokenToKVPool`: one buffer per layer for K and V, `page_size` tokens a page) and
metadata buffers (`MetadataBuffers`), the `KVArgs` built from them as `prefill.py` builds them,
the backend found through SGLang's `get_kv_class`, and on the prefill side the bootstrap server
SGLang's `start_disagg_service` would start. The host buffers land in shared memory through
`kvgate.sglang.register()`, as under `python -m kvgate.sglang.launch_server`.

    python engine.py prefill|decode MODEL_DIR BOOTSTRAP_PORT
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Any
from unittest import mock

import numpy as np


class Captured(logging.Handler):
    """Every log record of SGLang and kvgate, for the test to read (`logs`)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()}")


CAPTURED = Captured()


def main() -> None:
    role, model_dir, bootstrap_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    root = logging.getLogger()
    root.addHandler(CAPTURED)
    root.setLevel(logging.INFO)
    import torch

    import kvgate.sglang

    kvgate.sglang.register()
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        get_kv_class,
        get_kv_transfer_buf_infos,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.server_args import ServerArgs

    page_size = int(os.environ.get("TEST_PAGE_SIZE", "4"))
    layers = int(os.environ.get("TEST_LAYERS", "2"))
    pool_tokens = int(os.environ.get("TEST_POOL_TOKENS", "256"))
    server_args = ServerArgs(
        model_path=model_dir,
        disaggregation_mode=role,
        disaggregation_transfer_backend="kvgate",
        disaggregation_bootstrap_port=bootstrap_port,
        host="127.0.0.1",
        device="cpu",
        page_size=page_size,
        skip_tokenizer_init=True,
    )
    rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    # The process groups a scheduler builds with torch.distributed; one rank, none needed here.
    rc.get_parallel().override_permanently(pp_group=None)
    backend = TransferBackend(server_args.disaggregation_transfer_backend)
    pool = MHATokenToKVPool(
        size=pool_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=layers, device="cpu", enable_memory_saver=False
    )
    metadata = MetadataBuffers(size=16, hidden_size=64, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=16)
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = None
    kv_args.prefill_start_layer = 0
    kv_args.prefill_end_layer = layers
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = list(range(layers)) * 2
    kv_args.kv_head_num = 2
    kv_args.total_kv_head_num = 2
    kv_args.page_size = page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = metadata.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    kv_args.state_types = []
    kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = [], [], []
    kv_args.state_layer_ids, kv_args.state_dim_per_tensor = [], []
    kv_args.state_slice_outer_counts, kv_args.state_conv_shard_groups = [], []
    kv_args.is_hybrid_mla_backend = False
    kv_args.swa_kv_cache_layout = None

    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    bootstrap_addr = f"127.0.0.1:{bootstrap_port}"
    server = None
    if mode == DisaggregationMode.PREFILL:
        server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=bootstrap_port)
    manager = get_kv_class(backend, KVClassType.MANAGER)(kv_args, mode, server_args, False)
    if mode == DisaggregationMode.DECODE:
        deadline = time.monotonic() + 30
        while not manager.try_ensure_parallel_info(bootstrap_addr):
            if time.monotonic() > deadline:
                raise RuntimeError("the prefill bootstrap server did not answer")
            time.sleep(0.1)
    sender_cls = get_kv_class(backend, KVClassType.SENDER)
    receiver_cls = get_kv_class(backend, KVClassType.RECEIVER)

    buffers = [(p, n, i) for p, n, i in zip(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens)]
    aux = [(p, n, i) for p, n, i in zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens)]

    def view(ptr: int, length: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return np.frombuffer(memoryview((ctypes.c_ubyte * length).from_address(ptr)).cast("B"), dtype=np.uint8)

    def digest(pages: list[int], aux_index: int | None) -> list[str]:
        out = []
        for ptr, length, item in buffers:
            b = view(ptr, length)
            out.append(hashlib.sha256(b"".join(b[p * item : (p + 1) * item].tobytes() for p in pages)).hexdigest())
        if aux_index is not None:
            for ptr, length, item in aux:
                out.append(hashlib.sha256(view(ptr, length)[aux_index * item : (aux_index + 1) * item].tobytes()).hexdigest())
        return out

    peers: dict[int, Any] = {}
    inflight: dict[str, Any] = {}

    def scheduler_stand_in() -> Any:
        """What `process_disagg_prefill_inflight_queue` reads of a prefill scheduler."""
        if "scheduler" in inflight:
            return inflight["scheduler"]
        import torch.distributed as dist

        if not dist.is_initialized():
            # The rendezvous file goes beside the model config, in the test's work folder.
            rendezvous = os.path.join(os.path.dirname(os.path.abspath(model_dir)), f"gloo-{os.getpid()}")
            dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
        group = dist.new_group([0], backend="gloo")
        scheduler = mock.MagicMock(name="scheduler")
        scheduler.disagg_prefill_inflight_queue = []
        scheduler.attn_cp_cpu_group = group
        scheduler.attn_tp_cpu_group = group
        scheduler.metrics_reporter.enable_metrics = False
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        # SGLang's own failure handling (it logs the sender's failure_exception), not a mock of it.
        scheduler.handle_inflight_transfer_failure = functools.partial(SchedulerDisaggregationPrefillMixin.handle_inflight_transfer_failure, scheduler)
        inflight["scheduler"] = scheduler
        return scheduler

    def do(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        room = int(cmd.get("room", -1))
        if op == "info":
            return {"gateway": manager.gateway_name, "page_size": page_size, "pages": pool_tokens // page_size, "aux_slots": 16, "layers": layers}
        if op == "randomize":
            rng = np.random.default_rng(cmd["seed"])
            for ptr, length, _ in buffers + aux:
                view(ptr, length)[:] = rng.integers(0, 256, length, dtype=np.uint8)
            return {}
        if op == "zero":
            for ptr, length, _ in buffers + aux:
                view(ptr, length)[:] = 0
            return {}
        if op == "digest":
            return {"digest": digest(cmd["pages"], cmd.get("aux"))}
        if op == "new_sender":
            peers[room] = sender_cls(manager, bootstrap_addr, room)
            return {}
        if op == "new_receiver":
            receiver = receiver_cls(manager, bootstrap_addr, room)
            receiver.init(0)
            peers[room] = receiver
            return {}
        if op == "init":
            peers[room].init(cmd["pages"], cmd.get("aux"))
            return {}
        if op == "pop_prefix":
            return {"prefix": peers[room].pop_decode_prefix_len()}
        if op == "send":
            peers[room].send(np.array(cmd["pages"], dtype=np.int32))
            return {}
        if op == "send_metadata":
            peers[room].send_metadata(np.array(cmd["pages"], dtype=np.int32), cmd.get("aux"), None, cmd.get("prefix"))
            return {}
        if op == "poll":
            return {"poll": int(peers[room].poll())}
        if op == "abort":
            started = time.monotonic()
            peers[room].abort()
            return {"poll": int(peers[room].poll()), "abort_s": time.monotonic() - started}
        if op == "failure":
            try:
                peers[room].failure_exception()
            except Exception as e:  # noqa: BLE001 - reported to the test
                return {
                    "type": type(e).__name__,
                    "text": str(e),
                    "code": getattr(e, "code", ""),
                    "phase": getattr(e, "phase", ""),
                    "elapsed_ms": getattr(e, "elapsed_ms", 0),
                    "sglang_error": type(e).__mro__[1].__name__,
                }
            return {"type": ""}
        if op == "metric":
            m = peers[room].get_transfer_metric()
            return {"latency_s": m.transfer_latency_s, "bytes": m.transfer_total_bytes}
        if op == "reusable":
            return {"reusable": [h.poll_reusable() for h in peers[room].handles.values()]}
        if op == "inflight_add":
            scheduler = scheduler_stand_in()
            req = mock.MagicMock(name=f"req-{room}")
            req.rid = f"req-{room}"
            req.bootstrap_room = room
            req.disagg_kv_sender = peers[room]
            req.pending_bootstrap = False
            req.finished_reason = None
            req.metadata_buffer_index = -1
            req.kv.holds_kv = True
            req.kv.is_kv_released = False
            req.return_routed_experts = False
            scheduler.disagg_prefill_inflight_queue.append(req)
            return {"queue": len(scheduler.disagg_prefill_inflight_queue)}
        if op == "inflight_step":
            from sglang.srt.disaggregation import prefill

            scheduler = scheduler_stand_in()
            parallel = mock.MagicMock(name="parallel")
            parallel.tp_rank = 0
            with mock.patch.object(prefill, "release_kv_cache"), mock.patch.object(prefill, "get_parallel", return_value=parallel):
                done = prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue(scheduler)
            return {"queue": len(scheduler.disagg_prefill_inflight_queue), "done": [r.rid for r in done]}
        if op == "logs":
            needle = cmd.get("grep", "")
            return {"logs": [r for r in CAPTURED.records if needle in r]}
        if op == "exit":
            manager.teardown()
            if server is not None:
                server.close()
            return {}
        raise ValueError(f"unknown op {op!r}")

    print(json.dumps({"ready": True, "pid": os.getpid(), "gateway": manager.gateway_name, "KVPoll": {k: getattr(KVPoll, k) for k in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")}}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            answer = {"ok": True, **do(cmd)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print(json.dumps(answer), flush=True)
        if cmd["op"] == "exit":
            break


if __name__ == "__main__":
    main()
