"""The server's DRAM arena mapped into this process: one memcpy per segment, to or from a slot."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from kvstore_client.buffers import Segment

try:  # optional: lets the server verify, at commit, the bytes this process meant to write
    import xxhash

    def checksum(view: memoryview) -> int:
        return xxhash.xxh3_64_intdigest(view)
except ImportError:  # pragma: no cover - exercised where xxhash is absent
    checksum = None  # type: ignore[assignment]

_memmove = ctypes.memmove


class ArenaMapping:
    def __init__(self, fd: int):
        try:
            self.nbytes = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.base = self._array.ctypes.data
        self.view = memoryview(self._array)

    def write(self, offset: int, segments: list[Segment]) -> None:
        """Copy a page's segments into the slot at `offset`."""
        dst = self.base + offset
        for src, nbytes in segments:
            _memmove(dst, src, nbytes)
            dst += nbytes

    def read(self, offset: int, segments: list[Segment]) -> None:
        """Copy the slot at `offset` out into a page's segments."""
        src = self.base + offset
        for dst, nbytes in segments:
            _memmove(dst, src, nbytes)
            src += nbytes

    def checksum(self, offset: int, nbytes: int) -> int | None:
        return checksum(self.view[offset:offset + nbytes]) if checksum else None

    def close(self) -> None:
        self.view.release()
        del self._array
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass
