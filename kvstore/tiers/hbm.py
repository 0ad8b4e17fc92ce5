"""HBM tier storage: one GPU's memory pool, allocated whole at start-up and exported over CUDA IPC.

Engines on this host open the pool's IPC handle once (the SDK caches it per client) and read a
page at (pool base + offset) with the same gather/scatter kernel that reads the DRAM arena, so a
page in HBM reaches an engine's cache with a device-to-device copy. The pool is optional: with
hbm.pool_bytes 0 the node has no HBM tier and nothing else changes; with it set and no GPU, the
node does not start.

What goes into the pool, and when, is the HBM tier's (control/store_hbm.py and
control/hbm_mover.py): a page's bytes are written in with `write` from a buffer of the node's own,
after they were checked against the page's commit checksum, and read back with `read` only to check.

The device calls are behind PoolDevice: CudaPool (cupy) on a GPU, HostPool (a memfd whose
"IPC handle" is its /proc path, opened by kvstore_client.gpu_device.HostDevice) in tests
(testing.hbm_on_host): the same seam, so the tier above it runs for real without a GPU.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


class PoolDevice(Protocol):
    nbytes: int
    ipc_handle: bytes
    device_uuid: bytes

    def write(self, offset: int, data: memoryview) -> None:
        """Copy host bytes to [offset, offset + len(data)) of the pool; returns once they are there."""

    def read(self, offset: int, nbytes: int) -> bytes:
        """A host copy of [offset, offset + nbytes) of the pool."""

    def close(self) -> None: ...


class CudaPool:
    """`nbytes` of device memory on CUDA device `index`, with its IPC handle."""

    def __init__(self, index: int, nbytes: int):
        try:
            import cupy
        except ImportError:
            raise OSError("hbm.pool_bytes is set but cupy is not installed (pip install cupy-cuda12x or "
                          "cupy-cuda13x), so the HBM tier has no GPU to use") from None
        runtime = cupy.cuda.runtime
        try:
            count = runtime.getDeviceCount()
        except runtime.CUDARuntimeError as exc:
            raise OSError(f"hbm.pool_bytes is set but no CUDA device is usable: {exc}") from None
        if index >= count:
            raise OSError(f"hbm.device is {index} but this process sees {count} CUDA device(s)")
        self._runtime, self.index, self.nbytes = runtime, index, nbytes
        with cupy.cuda.Device(index):
            try:
                self.address = runtime.malloc(nbytes)
            except runtime.CUDARuntimeError as exc:
                raise OSError(f"cannot allocate the HBM pool of {nbytes} bytes on CUDA device {index} "
                              f"(hbm.pool_bytes): {exc}") from None
            self.ipc_handle = bytes(runtime.ipcGetMemHandle(self.address))
        self.device_uuid = bytes(runtime.getDeviceProperties(index).get("uuid", b""))
        self._cupy = cupy

    def write(self, offset: int, data: memoryview) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        with self._cupy.cuda.Device(self.index):
            self._runtime.memcpy(self.address + offset, source.ctypes.data, source.nbytes,
                                 self._runtime.memcpyHostToDevice)
            # From pageable memory cudaMemcpy may return once the bytes are staged, before the DMA lands: the
            # copy is published when this returns, so wait for the device.
            self._runtime.deviceSynchronize()

    def read(self, offset: int, nbytes: int) -> bytes:
        out = np.empty(nbytes, dtype=np.uint8)
        with self._cupy.cuda.Device(self.index):
            self._runtime.memcpy(out.ctypes.data, self.address + offset, nbytes, self._runtime.memcpyDeviceToHost)
        return out.tobytes()

    def close(self) -> None:
        self._runtime.free(self.address)


class HostPool:
    """A memfd standing in for device memory (testing.hbm_on_host); its handle is a path this host can open."""

    def __init__(self, index: int, nbytes: int):
        self.fd = os.memfd_create("kvstore-hbm-on-host", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.nbytes = nbytes
        self.ipc_handle = f"/proc/{os.getpid()}/fd/{self.fd}".encode()
        self.device_uuid = b"host-%d" % index

    def write(self, offset: int, data: memoryview) -> None:
        os.pwrite(self.fd, data, offset)

    def read(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self.fd, nbytes, offset)

    def close(self) -> None:
        os.close(self.fd)


def open_pool(index: int, nbytes: int, on_host: bool) -> PoolDevice:
    pool = (HostPool if on_host else CudaPool)(index, nbytes)
    log.info("HBM pool: %d bytes on %s, exported over %s", nbytes,
             "a host memfd" if on_host else f"CUDA device {index}", "a /proc path" if on_host else "CUDA IPC")
    return pool
