"""Stands in for SGLang's launcher module in `test_unit.py`: starts a child process with the spawn
method, as SGLang starts its schedulers, and prints whether the child knows the kvgate backend."""

from __future__ import annotations

import multiprocessing


def child(queue: "multiprocessing.Queue[str]") -> None:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    try:
        queue.put(get_kv_class(TransferBackend("kvgate"), KVClassType.MANAGER).__name__)
    except ValueError as e:
        queue.put(f"not registered: {e}")


if __name__ == "__main__":
    # By its module name, as SGLang's process targets are (this file runs as `__main__` here).
    import spawn_probe

    context = multiprocessing.get_context("spawn")
    queue: "multiprocessing.Queue[str]" = context.Queue()
    process = context.Process(target=spawn_probe.child, args=(queue,))
    process.start()
    print(f"child: {queue.get(timeout=120)}", flush=True)
    process.join(timeout=30)
