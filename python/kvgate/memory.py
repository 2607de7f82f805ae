"""Memory an engine registers with its gateway, by reference (the engine API never carries bytes).

* `SharedPool`: host memory both the engine and the gateway map, a `/dev/shm` file or a memfd (the
  gateway opens it through `/proc/<pid>/fd/<n>`). `numpy()` and `torch()` are views of it, no copy.
* `cuda_ipc_export(tensor)`: what the gateway needs to map a PyTorch CUDA tensor (its allocation's
  IPC handle, and where the tensor starts in it); `Client.register_cuda_tensor` registers it.
  Without CUDA it raises `CudaUnavailable`, saying why.
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import CudaUnavailable

if TYPE_CHECKING:
    import numpy
    import numpy.typing

#: Where `SharedPool` files go by default: a tmpfs that the gateway's shm plugin can map.
DEFAULT_DIRECTORY = "/dev/shm"


class SharedPool:
    """A shared host-memory pool of `size` bytes.

    `SharedPool(size)` creates a file in `/dev/shm` (or `directory`, or at `path`), removed again by
    `close()`; `SharedPool(size, memfd=True)` an anonymous memfd, named to the gateway as
    `/proc/<pid>/fd/<n>` (it lives as long as a process holds or maps it). `SharedPool.open(path)`
    maps an existing file without taking ownership of it.
    """

    def __init__(
        self,
        size: int,
        *,
        memfd: bool = False,
        path: str | os.PathLike[str] | None = None,
        directory: str | os.PathLike[str] | None = None,
        name: str = "kvgate-pool",
    ) -> None:
        if size <= 0:
            raise ValueError(f"a pool needs size > 0, not {size}")
        self.size = size
        self.offset = 0
        self.owner = True
        if memfd:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
            self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
            self.memfd = True
        else:
            if path is None:
                folder = os.fspath(directory) if directory is not None else DEFAULT_DIRECTORY
                path = os.path.join(folder, f"{name}-{os.getpid()}-{secrets.token_hex(4)}")
            self.path = os.fspath(path)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self.memfd = False
        try:
            os.ftruncate(self.fd, size)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self._release_file()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, length: int | None = None) -> SharedPool:
        """Map an existing shared-memory file (not removed by `close()`)."""
        pool = cls.__new__(cls)
        pool.path = os.fspath(path)
        pool.fd = os.open(pool.path, os.O_RDWR | os.O_CLOEXEC)
        pool.size = length if length is not None else os.fstat(pool.fd).st_size
        pool.offset = 0
        pool.owner = False
        pool.memfd = False
        pool._map = mmap.mmap(pool.fd, pool.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return pool

    def __repr__(self) -> str:
        return f"SharedPool({self.path!r}, size={self.size})"

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def buffer(self) -> mmap.mmap:
        """The mapping itself (a writable buffer)."""
        if self._map is None:
            raise ValueError("the pool is closed")
        return self._map

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A memoryview of `[offset, offset + length)`, no copy."""
        end = self.size if length is None else offset + length
        return memoryview(self.buffer)[offset:end]

    def numpy(self, dtype: Any = "uint8", shape: tuple[int, ...] | None = None, offset: int = 0) -> numpy.typing.NDArray[Any]:
        """The pool (from `offset`) as a NumPy array of `dtype`, no copy; `shape` None: one dimension."""
        import numpy as np

        dt = np.dtype(dtype)
        count = (self.size - offset) // dt.itemsize if shape is None else int(np.prod(shape))
        array = np.frombuffer(self.buffer, dtype=dt, count=count, offset=offset)
        return array if shape is None else array.reshape(shape)

    def torch(self, dtype: Any = None) -> Any:
        """The pool as a 1-D `torch.Tensor` on the CPU sharing its memory (no copy), as `dtype` if given
        (default `torch.uint8`). Needs PyTorch."""
        try:
            import torch
        except ImportError as e:
            raise ModuleNotFoundError(f"SharedPool.torch() needs PyTorch (pip install torch): {e}", name="torch") from e
        tensor = torch.frombuffer(self.buffer, dtype=torch.uint8)
        return tensor if dtype is None or dtype == torch.uint8 else tensor.view(dtype)

    def close(self) -> None:
        """Unmap (when no view of the pool is left; otherwise the mapping goes with the last view), close,
        and remove the file if this pool created it. The gateway keeps its own mapping until the
        region is unregistered."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # NumPy or torch views still use it; it is unmapped when they are gone
            self._map = None
        self._release_file()

    def _release_file(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.owner and not self.memfd:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.owner = False


class CudaIpcExport(NamedTuple):
    """A CUDA tensor as the gateway maps it: its device, its allocation's IPC handle, how many bytes
    from the allocation's start to the tensor's end (`length`), and where the tensor starts (`base`)."""

    device: int
    handle: bytes
    length: int
    base: int


def _torch_with_cuda() -> Any:
    try:
        import torch
    except ImportError as e:
        raise CudaUnavailable(f"registering a CUDA tensor needs PyTorch with CUDA, and PyTorch is not installed ({e})") from e
    if torch.version.cuda is None:
        raise CudaUnavailable(f"this PyTorch ({torch.__version__}) was built without CUDA")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise CudaUnavailable(f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device{where}")
    return torch


def cuda_available() -> tuple[bool, str]:
    """(True, "") when a CUDA tensor can be registered from here, else (False, why)."""
    try:
        _torch_with_cuda()
    except CudaUnavailable as e:
        return False, e.details
    return True, ""


def cuda_ipc_export(tensor: Any) -> CudaIpcExport:
    """The IPC handle of the allocation holding a contiguous PyTorch CUDA tensor, and the tensor's offset
    in it. The tensor must stay alive (and in place) while the gateway has it registered."""
    torch = _torch_with_cuda()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, not {type(tensor).__name__}")
    if not tensor.is_cuda:
        raise ValueError(f"the tensor is on {tensor.device}, not on a CUDA device")
    if not tensor.is_contiguous():
        raise ValueError("the tensor is not contiguous: register its contiguous base, or a .contiguous() copy")
    shared = tensor.untyped_storage()._share_cuda_()
    device, handle, storage_offset_bytes = int(shared[0]), bytes(shared[1]), int(shared[3])
    base = storage_offset_bytes + tensor.storage_offset() * tensor.element_size()
    return CudaIpcExport(device, handle, base + tensor.numel() * tensor.element_size(), base)
