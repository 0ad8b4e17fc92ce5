"""A tenant's memfd of the node's DRAM arena mapped into this process: one memcpy per segment, to or from a slot.

The node hands each tenant the memfd holding only that tenant's pages, at the same offsets as
in its arena (kvstore/tiers/dram.py); the other tenants' slabs are holes here. The mapping is
prefaulted only when the memfd holds the whole arena (tenants not told apart): faulting in the
holes of a tenant's memfd would allocate memory the node never gave it (and the node punches it
back).
A page read from here is hashed as it is copied and compared with the checksum the node
recorded at commit, so a page changed through a mapping is never returned as good.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Sequence

import numpy as np

from kvstore_client import checksums, native
from kvstore_client.buffers import PageRows, Segment

_memmove = ctypes.memmove

# Without kvstore_native (write_hashed returns None), the node reads a put's page back right
# after it is written (the checksum at commit). glibc copies large blocks with non-temporal
# stores, which bypass the cache, so such a page is copied in pieces below that switch: the
# bytes are still in the shared L3 cache when the server hashes them, instead of a second
# stream competing for DRAM bandwidth. Measured here with 4 MiB pages: 0.70 of memcpy whole,
# 0.98 in 256 KiB pieces (bench/shm_throughput.py).
CACHED_COPY_BYTES = 256 << 10


class ArenaMapping:
    def __init__(self, fd: int, whole: bool = True):
        """Map `fd` (taken: closed here); `whole`: it holds the whole arena, not one tenant's slabs."""
        try:
            self.nbytes = os.fstat(fd).st_size
            self.whole = whole
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if whole else 0)
            self._mmap = mmap.mmap(fd, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.base = self._array.ctypes.data
        self.view = memoryview(self._array)

    def write(self, offset: int, segments: list[Segment]) -> None:
        """Copy a page's segments into the slot at `offset`, in cache-sized pieces (see below)."""
        dst = self.base + offset
        for src, nbytes in segments:
            for done in range(0, nbytes, CACHED_COPY_BYTES):
                _memmove(dst + done, src + done, min(CACHED_COPY_BYTES, nbytes - done))
            dst += nbytes

    def write_hashed(self, offsets: Sequence[int], pages: Sequence[list[Segment]]) -> Sequence[int] | None:
        """Copy each page's segments into the slot at its offset and return its xxh3, one pass over each
        page and one native call for them all (kvstore_native.copy_hash_into: non-temporal stores,
        nothing read back); None without kvstore_native. Pages back to back in one buffer (PageRows) are
        copied by copy_hash_rows, whose checksums come back as a view of uint64s."""
        if native.module is None:
            return None
        if isinstance(pages, PageRows) and native.copy_hash_rows is not None:
            sums = native.copy_hash_rows(self.base, offsets, pages.base, pages.page_bytes, len(pages))
            return memoryview(sums).cast("Q")
        return native.module.copy_hash_into(self.base, offsets, pages)

    def read(self, offset: int, segments: list[Segment]) -> None:
        """Copy the slot at `offset` out into a page's segments."""
        src = self.base + offset
        for dst, nbytes in segments:
            _memmove(dst, src, nbytes)
            src += nbytes

    def read_pages(self, offsets: Sequence[int], pages: Sequence[list[Segment]]) -> None:
        """read() of each page from the slot at its offset; one native call for them all where kvstore_native is."""
        if native.module is not None:
            native.module.copy_out(self.base, offsets, pages)
            return
        for offset, segments in zip(offsets, pages):
            self.read(offset, segments)

    def read_pages_hashed(self, offsets: Sequence[int], pages: Sequence[list[Segment]]) -> Sequence[int]:
        """read_pages(), returning the xxh3 of the bytes that landed in each page's segments. The destination
        is hashed, not the slot (which a client of the tenant may be changing during the copy), a piece at a
        time right after the piece is copied, while it is still in cache: one native call for them all where
        kvstore_native has copy_out_hashed."""
        if isinstance(pages, PageRows) and native.copy_out_hashed_rows is not None:   # uint64s, as write_hashed
            return memoryview(native.copy_out_hashed_rows(self.base, offsets, pages.base, pages.page_bytes,
                                                          len(pages))).cast("Q")
        copy_out_hashed = getattr(native.module, "copy_out_hashed", None)
        if copy_out_hashed is not None:
            return copy_out_hashed(self.base, offsets, pages)
        sums = []
        for offset, segments in zip(offsets, pages):
            hasher = checksums.page_hasher()
            src = self.base + offset
            for dst, nbytes in segments:
                for done in range(0, nbytes, CACHED_COPY_BYTES):
                    piece = min(CACHED_COPY_BYTES, nbytes - done)
                    _memmove(dst + done, src + done, piece)
                    hasher.update((ctypes.c_char * piece).from_address(dst + done))
                src += nbytes
            sums.append(hasher.intdigest())
        return sums

    def hold(self) -> np.ndarray:
        """A view of the whole mapping that keeps it mapped, even past close(), until the view is dropped
        (memory registered with a GPU must stay mapped until it is unregistered)."""
        return self._array[:]

    def close(self) -> None:
        self.view.release()
        del self._array
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass
