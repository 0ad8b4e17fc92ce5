"""HBM tier storage: one GPU's memory pool, allocated whole at start-up and exported over CUDA IPC.

Engines on this host open the pool's IPC handle once (the SDK caches it per client) and read a
page at (pool base + offset) with the same gather/scatter kernel that reads the DRAM arena, so a
page in HBM reaches an engine's cache with a device-to-device copy. The pool is optional: with
hbm.pool_bytes 0 the node has no HBM tier and nothing else changes; with it set and no GPU, the
node does not start.

Built so far: the pool, its export (HelloResponse.hbm) and the per-page descriptor clients read
(AcquireResponse.hbm_offsets). Not built yet: the controller's promotion into the pool and
demotion out of it; until then no page is placed in HBM and every read comes from the arena.

The device calls are behind PoolDevice: CudaPool (cupy) on a GPU, HostPool (a memfd whose
"IPC handle" is its /proc path, opened by kvstore_client.gpu_device.HostDevice) in tests.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

log = logging.getLogger(__name__)


class PoolDevice(Protocol):
    nbytes: int
    ipc_handle: bytes
    device_uuid: bytes

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

    def close(self) -> None:
        os.close(self.fd)


def open_pool(index: int, nbytes: int, on_host: bool) -> PoolDevice:
    pool = (HostPool if on_host else CudaPool)(index, nbytes)
    log.info("HBM pool: %d bytes on %s, exported over %s", nbytes,
             "a host memfd" if on_host else f"CUDA device {index}", "a /proc path" if on_host else "CUDA IPC")
    return pool
