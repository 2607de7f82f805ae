"""Making `kvgate` a transfer backend of an SGLang process, without changing SGLang's source.

SGLang 0.5.23 picks its transfer backend from a closed enum (`TransferBackend`) and a hard-coded
`get_kv_class`, and has no `dynamic` backend. `register()` does, in the calling process:

1. adds `kvgate` to the choices of `--disaggregation-transfer-backend`
   (`sglang.srt.arg_groups.choices.add_disagg_transfer_backend_choices`, SGLang's own hook);
2. adds the member `TransferBackend.KVGATE = "kvgate"`;
3. wraps `get_kv_class` (in `disaggregation.utils` and in each module that imported it by name:
   `disaggregation.prefill`, `disaggregation.decode`, `managers.disagg_service`) so that `kvgate`
   gives the classes of `kvgate.sglang.conn`;
4. allocates SGLang's host buffers in shared memory (`memory.shared_allocation`): its metadata
   buffers always (they are host memory even on a GPU server), and the KV pools of
   `mem_cache.memory_pool` when they are on the CPU. `KVGATE_SGLANG_SHARED_POOLS=0` turns this off.

It must run in every SGLang process that builds a KV manager (the schedulers) and in the one that
parses the arguments and starts the bootstrap server: `python -m kvgate.sglang.launch_server`
does so (its module runs again in each process SGLang spawns).
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.metadata
import logging
import os
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

BACKEND = "kvgate"
#: SGLang releases this backend is written and tested against (the interface changes between releases).
SUPPORTED = ("0.5.23",)
_MODULES_WITH_GET_KV_CLASS = (
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.disagg_service",
)

_lock = threading.Lock()
_registered = False


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ""


def check_version() -> str:
    """The installed SGLang's version; raises unless it is a supported release (or
    `KVGATE_SGLANG_ANY_VERSION=1`)."""
    version = sglang_version()
    if not version:
        raise ImportError("kvgate.sglang needs SGLang (pip install 'kvgate[sglang]')")
    release = version.split("+")[0]
    base = release.split(".post")[0]
    if base not in SUPPORTED and os.environ.get("KVGATE_SGLANG_ANY_VERSION") != "1":
        raise RuntimeError(
            f"kvgate.sglang supports SGLang {', '.join(SUPPORTED)} (and their .post releases), not {version}: "
            "the transfer-backend interface changes between releases (KVGATE_SGLANG_ANY_VERSION=1 tries anyway)"
        )
    return version


def _add_enum_member(cls: Any, name: str, value: str) -> Any:
    """`cls.<name> = value` on a closed `enum.Enum`, as if it had been declared."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    member._sort_order_ = len(cls._member_names_)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    type.__setattr__(cls, name, member)
    return member


def _classes() -> dict[Any, Any]:
    from sglang.srt.disaggregation.utils import KVClassType  # type: ignore[import-not-found, import-untyped, unused-ignore]

    from . import conn

    return {
        KVClassType.MANAGER: conn.KvgateKVManager,
        KVClassType.SENDER: conn.KvgateKVSender,
        KVClassType.RECEIVER: conn.KvgateKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvgateKVBootstrapServer,
    }


def _wrap_get_kv_class(original: Callable[..., Any], member: Any) -> Callable[..., Any]:
    if getattr(original, "__kvgate__", False):
        return original

    @functools.wraps(original)
    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend is member or getattr(transfer_backend, "value", transfer_backend) == BACKEND:
            classes = _classes()
            if class_type in classes:
                return classes[class_type]
            # KVARGS: every backend shares SGLang's KVArgs (answered before the backend is looked at).
            return original(transfer_backend, class_type)
        return original(transfer_backend, class_type)

    get_kv_class.__kvgate__ = True  # type: ignore[attr-defined]
    return get_kv_class


def _in_shared_memory(method: Callable[..., Any], when: Callable[[Any], bool]) -> Callable[..., Any]:
    if getattr(method, "__kvgate__", False):
        return method

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not when(self):
            return method(self, *args, **kwargs)
        from .memory import shared_allocation

        with shared_allocation():
            return method(self, *args, **kwargs)

    wrapper.__kvgate__ = True  # type: ignore[attr-defined]
    return wrapper


def _on_cpu(pool: Any) -> bool:
    return str(getattr(pool, "device", "")).startswith("cpu")


def install_shared_pools() -> None:
    """SGLang's host buffers in shared memory (see module docstring, 4)."""
    from sglang.srt.disaggregation import utils  # type: ignore[import-not-found, import-untyped, unused-ignore]
    from sglang.srt.mem_cache import memory_pool  # type: ignore[import-not-found, import-untyped, unused-ignore]

    utils.MetadataBuffers.__init__ = _in_shared_memory(utils.MetadataBuffers.__init__, lambda _self: True)
    seen: set[type] = set()
    todo = [memory_pool.KVCache]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        if "_create_buffers" in cls.__dict__:
            cls._create_buffers = _in_shared_memory(cls.__dict__["_create_buffers"], _on_cpu)


def register(*, shared_pools: bool | None = None) -> None:
    """Make `--disaggregation-transfer-backend kvgate` work in this process (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        check_version()
        from sglang.srt.arg_groups.choices import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
            DISAGG_TRANSFER_BACKEND_CHOICES,
            add_disagg_transfer_backend_choices,
        )
        from sglang.srt.disaggregation.utils import TransferBackend  # type: ignore[import-not-found, import-untyped, unused-ignore]

        if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
            add_disagg_transfer_backend_choices([BACKEND])
        member = _add_enum_member(TransferBackend, BACKEND.upper(), BACKEND)
        assert isinstance(member, enum.Enum)
        for name in _MODULES_WITH_GET_KV_CLASS:
            module = importlib.import_module(name)
            current = getattr(module, "get_kv_class", None)
            if current is not None:
                setattr(module, "get_kv_class", _wrap_get_kv_class(current, member))
        if shared_pools is None:
            shared_pools = os.environ.get("KVGATE_SGLANG_SHARED_POOLS", "1") != "0"
        if shared_pools:
            install_shared_pools()
        _registered = True
        logger.info("kvgate: SGLang %s transfer backend %r registered", sglang_version(), BACKEND)
