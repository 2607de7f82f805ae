"""`python -m kvgate.sglang.launch_server ARGS`: SGLang's `sglang.launch_server` with the kvgate
transfer backend registered.

Registration happens when this module is imported, so it also happens in every process SGLang
starts with `multiprocessing`'s spawn method (schedulers, data-parallel controller, detokenizer):
spawn runs the parent's main module again in each child. Then SGLang's launcher runs with `ARGS`
unchanged; pass `--disaggregation-transfer-backend kvgate`. `KVGATE_SGLANG_LAUNCHER` names another
SGLang entry module to run the same way.
"""

from __future__ import annotations

import os
import runpy
import sys

from . import register

register()


def main(argv: list[str] | None = None) -> None:
    """Run SGLang's launcher module (`KVGATE_SGLANG_LAUNCHER`, default `sglang.launch_server`) as
    `__main__` with `argv` (default: this process's arguments)."""
    launcher = os.environ.get("KVGATE_SGLANG_LAUNCHER") or "sglang.launch_server"
    sys.argv = [launcher, *(sys.argv[1:] if argv is None else argv)]
    # alter_sys=False keeps this module as `__main__`: the processes SGLang spawns import it again
    # (and so register the backend), not the launcher module.
    runpy.run_module(launcher, run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
