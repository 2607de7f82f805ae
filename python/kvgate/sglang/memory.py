"""SGLang's buffers as kvgate regions.

SGLang hands a transfer backend raw pointers (`KVArgs.kv_data_ptrs`, `aux_data_ptrs`,
`state_data_ptrs`). `RegionMap.locate(ptr, length)` finds what memory each lies in and registers it
with the gateway once, by reference:

* **Host memory** must be shared: a mapping of a `/dev/shm` file (found in `/proc/self/maps`), or an
  allocation made inside `shared_allocation()` (a memfd, named to the gateway as
  `/proc/<pid>/fd/<n>`). Ordinary (anonymous) host memory cannot be mapped by another process and
  is refused, saying which buffer.
* **CUDA memory** is registered by the IPC handle of its allocation (`cuIpcGetMemHandle` on the
  base `cuMemGetAddressRange` reports), with the pointer's offset in it. A VMM allocation
  (`cuMemCreate`, PyTorch's expandable segments), which has no IPC handle, is registered by the
  POSIX descriptor of its allocation instead (`cuMemRetainAllocationHandle` +
  `cuMemExportToShareableHandle`), passed to the gateway on its fd socket; the buffer must then lie
  inside one allocation (one mapping of the segment).

`shared_allocation()` is what puts SGLang's host buffers into shared memory without changing
SGLang: while it is active, `torch.zeros`, `torch.empty`, `torch.ones` and `torch.full` on the CPU
return tensors backed by a memfd each. `kvgate.sglang.register()` runs SGLang's metadata buffers
(always host memory) and, on a CPU server, its KV pools inside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .. import SharedPool
from ..client import Client
from ..types import Region

logger = logging.getLogger(__name__)


class UnsupportedMemory(RuntimeError):
    """A buffer that the gateway cannot map (anonymous host memory, no CUDA driver, ...)."""


@dataclass(frozen=True)
class HostBacking:
    """A shared host mapping: the file the gateway opens, where the mapping starts in it and in the
    address space, and its length."""

    path: str
    file_offset: int
    start: int
    length: int


@dataclass(frozen=True)
class CudaBacking:
    """A CUDA allocation: device, IPC handle, base address and size."""

    device: int
    handle: bytes
    start: int
    length: int


@dataclass(frozen=True)
class CudaVmmBacking:
    """A CUDA VMM allocation: device, a POSIX descriptor of it (owned by the caller, who closes it once
    the gateway has its copy), base address and size."""

    device: int
    fd: int
    start: int
    length: int


# -- shared host allocations ---------------------------------------------------------------------

_pools_lock = threading.Lock()
#: Pools made by `shared_allocation()` (or added with `add_pool`), kept for the life of the process.
_pools: list[tuple[int, SharedPool]] = []


def _address(pool: SharedPool) -> int:
    buf = (ctypes.c_char * pool.size).from_buffer(pool.buffer)
    address = ctypes.addressof(buf)
    del buf
    return address


def add_pool(pool: SharedPool) -> int:
    """Make a `SharedPool` known to `RegionMap` (needed for a memfd pool, whose mapping names no
    file the gateway could open). Returns its address."""
    address = _address(pool)
    with _pools_lock:
        _pools.append((address, pool))
    return address


def _shared_tensor(shape: tuple[int, ...], dtype: Any, fill: Any) -> Any:
    import torch

    count = 1
    for d in shape:
        count *= int(d)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = count * itemsize
    pool = SharedPool(max(nbytes, 1), memfd=True, name="kvgate-sglang")
    add_pool(pool)
    tensor = torch.frombuffer(pool.buffer, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
    if fill is not None and fill != 0:
        tensor.fill_(fill)  # a memfd starts zeroed
    return tensor


def _shape_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    size = kwargs.get("size")
    if size is None:
        if not args:
            return None
        size = args[0] if len(args) == 1 or not isinstance(args[0], int) else args
    if isinstance(size, int):
        return (size,)
    try:
        return tuple(int(s) for s in size)
    except TypeError:
        return None


def _make_mode() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    factories: dict[Callable[..., Any], Any] = {torch.zeros: 0.0, torch.empty: 0.0, torch.ones: 1.0, torch.full: None}

    class SharedAllocation(TorchFunctionMode):  # type: ignore[misc]
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = dict(kwargs or {})
            if func in factories:
                device = kwargs.get("device")
                on_cpu = device is None or torch.device(device).type == "cpu"
                plain = not kwargs.get("pin_memory") and not kwargs.get("requires_grad") and kwargs.get("out") is None
                if on_cpu and plain and kwargs.get("layout") in (None, torch.strided):
                    if func is torch.full:
                        shape = _shape_of(args[:1], kwargs)
                        fill = kwargs.get("fill_value", args[1] if len(args) > 1 else None)
                    else:
                        shape = _shape_of(args, kwargs)
                        fill = factories[func]
                    if shape is not None and fill is not None:
                        dtype = kwargs.get("dtype")
                        if dtype is None:
                            dtype = torch.full((), fill).dtype if func is torch.full else torch.get_default_dtype()
                        return _shared_tensor(shape, dtype, fill)
            return func(*args, **kwargs)

    return SharedAllocation()


@contextlib.contextmanager
def shared_allocation() -> Iterator[None]:
    """While active, CPU tensors made by `torch.zeros/empty/ones/full` live in shared memory (one memfd
    each, kept for the life of the process) that `RegionMap` can register."""
    with _make_mode():
        yield


# -- finding a pointer's backing -------------------------------------------------------------------


def _from_pools(ptr: int, length: int) -> HostBacking | None:
    with _pools_lock:
        pools = list(_pools)
    for address, pool in pools:
        if address <= ptr and ptr + length <= address + pool.size:
            return HostBacking(pool.path, pool.offset, address, pool.size)
    return None


def _from_maps(ptr: int, length: int) -> HostBacking | None:
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        start_s, end_s = fields[0].split("-")
        start, end = int(start_s, 16), int(end_s, 16)
        if not (start <= ptr < end):
            continue
        path = fields[5].strip()
        shared = fields[1][3] == "s"
        if not shared or not path.startswith("/") or path.endswith("(deleted)") or ptr + length > end:
            return None
        return HostBacking(path, int(fields[2], 16), start, end - start)
    return None


def host_backing(ptr: int, length: int) -> HostBacking | None:
    """The shared host mapping holding `[ptr, ptr + length)`, or None."""
    return _from_pools(ptr, length) or _from_maps(ptr, length)


_cuda_lock = threading.Lock()
_cuda: Any = None


def _libcuda() -> Any:
    global _cuda
    with _cuda_lock:
        if _cuda is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise UnsupportedMemory(f"no CUDA driver (libcuda.so.1: {e})") from e
            if lib.cuInit(0) != 0:
                raise UnsupportedMemory("cuInit failed")
            _cuda = lib
        return _cuda


CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1


def _vmm_descriptor(lib: Any, base: int) -> int:
    """A POSIX descriptor of the VMM allocation mapped at `base` (raises `UnsupportedMemory` with the
    failing call and its CUDA error code)."""
    handle = ctypes.c_uint64(0)
    rc = lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(base))
    if rc != 0:
        raise UnsupportedMemory(f"cuMemRetainAllocationHandle failed ({rc}): not a VMM allocation")
    try:
        fd = ctypes.c_int(-1)
        rc = lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), ctypes.c_uint64(0))
        if rc != 0 or fd.value < 0:
            raise UnsupportedMemory(
                f"cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) failed ({rc}): the allocation was not created "
                "with requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
            )
        return fd.value
    finally:
        lib.cuMemRelease(handle)


def cuda_backing(ptr: int) -> CudaBacking | CudaVmmBacking:
    """The CUDA allocation holding device pointer `ptr`: by IPC handle, or, for a VMM allocation, by a
    POSIX descriptor the caller must close (raises `UnsupportedMemory` otherwise)."""
    lib = _libcuda()
    device = ctypes.c_int(-1)
    if lib.cuPointerGetAttribute(ctypes.byref(device), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(ptr)) != 0:
        raise UnsupportedMemory(f"0x{ptr:x} is neither shared host memory nor CUDA device memory")
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise UnsupportedMemory(f"cuMemGetAddressRange failed ({rc}) for 0x{ptr:x}")
    handle = (ctypes.c_char * 64)()
    rc = lib.cuIpcGetMemHandle(handle, base)
    if rc == 0:
        return CudaBacking(device.value, bytes(handle), base.value, size.value)
    try:
        fd = _vmm_descriptor(lib, base.value)
    except UnsupportedMemory as vmm:
        raise UnsupportedMemory(
            f"the allocation at 0x{base.value:x} can be exported neither by a legacy IPC handle (cuIpcGetMemHandle "
            f"failed ({rc}): VMM, stream-ordered and expandable-segment allocations have none) nor as a VMM "
            f"descriptor ({vmm}); stream-ordered (cudaMallocAsync) pools are not served"
        ) from None
    return CudaVmmBacking(device.value, fd, base.value, size.value)


# -- registering ---------------------------------------------------------------------------------


class RegionMap:
    """Each distinct backing of an engine's buffers registered once with the gateway."""

    def __init__(self, client: Client, label: str = "sglang") -> None:
        self.client = client
        self.label = label
        self._regions: dict[tuple[object, ...], tuple[Region, int]] = {}

    def locate(self, ptr: int, length: int, what: str = "buffer") -> tuple[int, int]:
        """(region id, offset of `ptr` in it) of the `length` bytes at `ptr`, registering the region
        the first time."""
        host = host_backing(ptr, length)
        if host is not None:
            key: tuple[object, ...] = ("host", host.path, host.file_offset, host.length)
            if key not in self._regions:
                region = self.client.register_shared_memory(host.path, offset=host.file_offset, length=host.length, label=f"{self.label} {what}")
                self._regions[key] = (region, host.start)
            region, start = self._regions[key]
            return region.id, ptr - start
        try:
            cuda = cuda_backing(ptr)
        except UnsupportedMemory as e:
            raise UnsupportedMemory(
                f"{what} at 0x{ptr:x} ({length} bytes) is not memory the gateway can map: {e}. Host buffers must be "
                "shared memory: start SGLang with `python -m kvgate.sglang.launch_server` (it allocates SGLang's host "
                "buffers in shared memory), or allocate them from /dev/shm yourself"
            ) from None
        key = ("cuda", cuda.device, cuda.start)
        if isinstance(cuda, CudaVmmBacking):
            try:
                if ptr + length > cuda.start + cuda.length:
                    raise UnsupportedMemory(
                        f"{what} at 0x{ptr:x} ({length} bytes) runs past the end of its CUDA VMM allocation "
                        f"(0x{cuda.start:x}, {cuda.length} bytes): a buffer spread over several allocations (PyTorch "
                        "maps an expandable segment in pieces) cannot be one region; allocate it in one piece"
                    )
                if key not in self._regions:
                    region = self.client.register_cuda_vmm_fd(
                        cuda.fd, device=cuda.device, length=cuda.length, allocation_size=cuda.length, label=f"{self.label} {what}"
                    )
                    self._regions[key] = (region, cuda.start)
            finally:
                os.close(cuda.fd)
        elif key not in self._regions:
            region = self.client.register_cuda_ipc(cuda.device, cuda.handle, cuda.length, label=f"{self.label} {what}")
            self._regions[key] = (region, cuda.start)
        region, start = self._regions[key]
        return region.id, ptr - start

    @property
    def regions(self) -> list[Region]:
        return [r for r, _ in self._regions.values()]

    def release(self) -> None:
        """Unregister every region (refusals, e.g. `region_in_use`, are logged)."""
        for region, _ in self._regions.values():
            try:
                self.client.unregister_memory(region)
            except Exception as e:  # noqa: BLE001 - best effort at teardown
                logger.warning("kvgate: could not unregister region %s: %s", region.id, e)
        self._regions.clear()


def process_label() -> str:
    return f"pid {os.getpid()}"
