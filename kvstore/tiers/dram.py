"""DRAM tier storage: one memfd arena, carved into slabs, each slab holding slots of one page size.

The arena is a memfd so that a client on the same host can map it (its fd travels over
the Unix socket) and copy pages with one memcpy. The allocator only hands out and takes
back slots; which page to evict when a size class is full is the index's decision.

A slab belongs to one slot size while it holds any slot; when its last slot is freed it
returns to the free pool, so memory flows between page sizes as pages come and go.
"""

from __future__ import annotations

import logging
import mmap
import os
import time

log = logging.getLogger(__name__)

SLOT_ALIGN = 4096


def slot_bytes_for(page_bytes: int) -> int:
    """Slots are page-aligned so every copy starts on a page boundary."""
    return (page_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class Arena:
    """A shared-memory region: a memfd of fixed size, mapped once."""

    def __init__(self, nbytes: int, hugepages: bool = False, prefault: bool = True):
        flags = os.MFD_CLOEXEC | (os.MFD_HUGETLB if hugepages else 0)
        self.fd = os.memfd_create("kvstore-dram-arena", flags)
        self.nbytes = nbytes
        try:
            os.ftruncate(self.fd, nbytes)
            if prefault:
                started = time.perf_counter()
                # Allocate every page now: a short machine fails at start-up, not mid-put.
                os.posix_fallocate(self.fd, 0, nbytes)
                log.info("arena prefaulted bytes=%d duration_ms=%.1f", nbytes, (time.perf_counter() - started) * 1e3)
            # MAP_POPULATE: no page fault on the first touch of a slot (the server hashes every commit).
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            self.mmap = mmap.mmap(self.fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mmap)

    def close(self) -> None:
        self.view.release()
        try:
            self.mmap.close()
        except BufferError:
            pass
        os.close(self.fd)


class _Slab:
    __slots__ = ("base", "slot_bytes", "free", "capacity")

    def __init__(self, base: int, slab_bytes: int, slot_bytes: int):
        self.base = base
        self.slot_bytes = slot_bytes
        self.capacity = slab_bytes // slot_bytes
        # Popped from the end: hand out low offsets first.
        self.free = list(range(base + (self.capacity - 1) * slot_bytes, base - 1, -slot_bytes))


class SlabAllocator:
    """Slots of a few fixed sizes over one arena. Not thread-safe: the index's lock guards it."""

    def __init__(self, arena_bytes: int, slab_bytes: int):
        self.slab_bytes = slab_bytes
        self._free_slabs = [i * slab_bytes for i in range(arena_bytes // slab_bytes - 1, -1, -1)]
        self._slabs: dict[int, _Slab] = {}                 # slab base -> slab in use
        self._partial: dict[int, dict[int, _Slab]] = {}    # slot size -> slabs with a free slot
        self.used_bytes = 0
        self.capacity_bytes = arena_bytes // slab_bytes * slab_bytes

    def allocate(self, slot_bytes: int) -> int | None:
        """Offset of a free slot of this size, or None when the size is full and no slab is free."""
        partial = self._partial.setdefault(slot_bytes, {})
        if not partial:
            if not self._free_slabs:
                return None
            slab = _Slab(self._free_slabs.pop(), self.slab_bytes, slot_bytes)
            self._slabs[slab.base] = slab
            partial[slab.base] = slab
        slab = next(iter(partial.values()))
        offset = slab.free.pop()
        if not slab.free:
            del partial[slab.base]
        self.used_bytes += slot_bytes
        return offset

    def allocate_many(self, slot_bytes: int, count: int) -> list[int]:
        """Up to `count` free slots of this size, taken a slab at a time (fewer when full)."""
        partial = self._partial.setdefault(slot_bytes, {})
        offsets: list[int] = []
        while len(offsets) < count:
            if not partial:
                if not self._free_slabs:
                    break
                slab = _Slab(self._free_slabs.pop(), self.slab_bytes, slot_bytes)
                self._slabs[slab.base] = slab
                partial[slab.base] = slab
            slab = next(iter(partial.values()))
            take = min(count - len(offsets), len(slab.free))
            offsets.extend(slab.free[-take:][::-1])
            del slab.free[-take:]
            if not slab.free:
                del partial[slab.base]
        self.used_bytes += len(offsets) * slot_bytes
        return offsets

    def free(self, offset: int) -> None:
        slab = self._slabs[offset - offset % self.slab_bytes]
        assert (offset - slab.base) % slab.slot_bytes == 0, f"offset {offset} is not a slot start"
        slab.free.append(offset)
        self.used_bytes -= slab.slot_bytes
        partial = self._partial[slab.slot_bytes]
        if len(slab.free) == slab.capacity:
            partial.pop(slab.base, None)
            del self._slabs[slab.base]
            self._free_slabs.append(slab.base)
        else:
            partial[slab.base] = slab

    def has_free_slab(self) -> bool:
        return bool(self._free_slabs)
