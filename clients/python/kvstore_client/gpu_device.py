"""The device calls GPU transfers make, behind one small seam: register host memory, open an IPC
handle, run a copy plan. Everything above it (gpu.py: leases, which pages come from where, when a
registration or a handle is made and dropped) is the same with either implementation:

- CudaDevice: cupy. Host memory is registered with cudaHostRegister (mapped, portable), so the
  kernel reads and writes the store's arena over PCIe with no staging copy; an HBM pool is opened
  with cudaIpcOpenMemHandle; a plan runs as one launch of the gather/scatter kernel
  (native/kv_layout.cu, compiled by NVRTC on first use) on the current stream, then synchronizes.
- HostDevice: the CPU. Registration is the identity; an "IPC handle" names a host file mapped
  shared; a plan runs through kv_layout's CPU reference. It moves real bytes between the arena and
  CPU tensors laid out as an engine's cache, which is how the protocol above is tested without a GPU.
"""

from __future__ import annotations

import mmap
import os
from importlib import resources
from typing import Any, Protocol

import numpy as np

from kvstore_client import errors, kv_layout

KERNEL_THREADS = 256
# CUDA runtime constants (driver_types.h), named here because cupy does not export them all.
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 0x01, 0x02
_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x01
_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
KERNEL_NAMES = tuple(f"{direction}_w{word}" for direction in ("pages_to_cache", "cache_to_pages")
                     for word in (16, 8, 4, 1))


class Device(Protocol):
    def register_host(self, address: int, nbytes: int) -> int:
        """Make [address, address + nbytes) of host memory reachable by the device; returns its device address."""

    def unregister_host(self, address: int) -> None: ...

    def open_ipc(self, handle: bytes) -> int:
        """Map another process's exported memory; returns its address here."""

    def close_ipc(self, address: int) -> None: ...

    def pages_to_cache(self, plan: kv_layout.CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
        """Copy each page (device addresses) into its block of the cache; returns once done."""

    def cache_to_pages(self, plan: kv_layout.CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
        """Copy each block of the cache out into its page; returns once done."""


def kernel_source() -> str:
    return resources.files("kvstore_client").joinpath("kv_layout.cu").read_text()


class CudaDevice:
    """cupy on the current CUDA device (see the module docstring)."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise errors.InvalidArgument("GPU transfers need cupy (pip install cupy-cuda12x or cupy-cuda13x) "
                                         "and a CUDA device") from exc
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise errors.InvalidArgument("GPU transfers need a CUDA device; none is visible")
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        device = cupy.cuda.runtime.getDevice()
        if not cupy.cuda.runtime.deviceGetAttribute(_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device):
            # Registered memory then has a device address of its own (cudaHostGetDevicePointer),
            # which cupy does not expose.
            raise errors.InvalidArgument(f"CUDA device {device} cannot use host pointers of registered memory")
        self._module = cupy.RawModule(code=kernel_source(), options=("-std=c++17",))
        self._kernels = {name: self._module.get_function(name) for name in KERNEL_NAMES}

    def register_host(self, address: int, nbytes: int) -> int:
        self._runtime.hostRegister(address, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
        return address     # the device uses the host address (checked at start)

    def unregister_host(self, address: int) -> None:
        self._runtime.hostUnregister(address)

    def open_ipc(self, handle: bytes) -> int:
        return self._runtime.ipcOpenMemHandle(handle, _IPC_MEM_LAZY_ENABLE_PEER_ACCESS)

    def close_ipc(self, address: int) -> None:
        self._runtime.ipcCloseMemHandle(address)

    def pages_to_cache(self, plan: kv_layout.CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
        self._launch("pages_to_cache", plan, page_addrs, block_ids)

    def cache_to_pages(self, plan: kv_layout.CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
        self._launch("cache_to_pages", plan, page_addrs, block_ids)

    def _launch(self, direction: str, plan: kv_layout.CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
        if not plan.cache_device.startswith("cuda"):
            raise errors.InvalidArgument(f"the cache is on {plan.cache_device}; GPU transfers copy into a CUDA cache")
        plan.check_blocks(block_ids)
        if not len(page_addrs):
            return
        cp = self._cupy
        word = plan.word_bytes(page_addrs)
        grid = kv_layout.launch_grid(plan, len(page_addrs), word, KERNEL_THREADS)
        args = tuple(np.int64(v) for v in plan.kernel_args(word)) + (
            cp.asarray(page_addrs, dtype=cp.uint64), cp.asarray(block_ids, dtype=cp.int64),
            cp.asarray(plan.cache_bases, dtype=cp.uint64))
        self._kernels[f"{direction}_w{word}"](grid, (KERNEL_THREADS,), args)
        cp.cuda.get_current_stream().synchronize()


class HostDevice:
    """The CPU behind the same seam (see the module docstring); counts what it was asked to do."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}       # address -> nbytes
        self.opened: dict[int, Any] = {}           # address -> mapping
        self.register_calls = 0
        self.open_calls = 0

    def register_host(self, address: int, nbytes: int) -> int:
        if address in self.registered:
            raise errors.InvalidArgument(f"host memory at {address:#x} is already registered")
        self.registered[address] = nbytes
        self.register_calls += 1
        return address

    def unregister_host(self, address: int) -> None:
        del self.registered[address]

    def open_ipc(self, handle: bytes) -> int:
        """`handle` is a host path (see export_host_region), mapped shared."""
        fd = os.open(handle.decode(), os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
        self.opened[address] = mapping
        self.open_calls += 1
        return address

    def close_ipc(self, address: int) -> None:
        self.opened.pop(address).close()

    def pages_to_cache(self, plan: kv_layout.CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
        kv_layout.reference_pages_to_cache(plan, page_addrs, block_ids)

    def cache_to_pages(self, plan: kv_layout.CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
        kv_layout.reference_cache_to_pages(plan, page_addrs, block_ids)
