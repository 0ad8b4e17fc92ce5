"""DRAM tier storage: the arena, one memfd per tenant, carved into slabs of slots of one page size.

The arena is shared memory so that a client on the same host can map it (a memfd travels
over the Unix socket) and copy pages with one memcpy. With tenants told apart (auth
configured), each tenant's pages live in a memfd of its own, so the fd a local client is
handed exposes only its tenant's pages:

- The node reserves one virtual range of dram.arena_bytes and maps each slab at
  base + O from its tenant's memfd at file offset O. Every tenant's memfd is arena_bytes
  long and sparse (holes read zeros and cost nothing), so a slot keeps one offset, the same
  in the node's view and in a client's mapping of its own memfd: store offsets, slot views
  and the clients' mappings are exactly what they were with one memfd.
- A slab is held whole by one tenant, so a slot's bytes are only ever in its tenant's memfd.
  A slab moves to another tenant only while it is free: the old tenant's range is
  hole-punched (fallocate PUNCH_HOLE|KEEP_SIZE: its old pages are gone from that fd and their
  memory freed) before the new tenant's range is allocated and mapped over it (MAP_FIXED). A
  free slab stays with its last tenant and goes back to it first, so a slab moves only when
  memory flows between tenants (a punch, an allocation and a prefault of slab_bytes, under
  the store's lock: bench/tenant_shm.py measures it).
- At start-up every slab belongs to the default tenant "" (the only one without
  authentication), whose memfd is allocated whole (posix_fallocate): a machine short of
  memory fails there, as it always did. A move frees the old copy before it allocates the
  new, so the arena never holds more than arena_bytes. With one tenant nothing ever moves.
- A client may touch the holes of its own memfd and so allocate memory the node did not
  give it; trim() punches a memfd back to the slabs its tenant holds (the lease reaper
  calls it), so such memory lives at most one reaper pass.
- A mapping cannot be taken back from a process, so when one that was handed a tenant's memfd
  loses its right to it (its token revoked), replace_memfd() moves the tenant's slabs into a
  fresh memfd and empties the old one: what that process still maps shows none of the
  tenant's pages, old or new. The old fd is kept, and punched empty on every trim().
- With tenants not told apart (no authentication, or RDMA on: a registered memory region
  pins the pages it was given, and a slab remapped under it would leave the NIC reading
  and writing the old pages), every tenant's slabs stay in the one memfd of tenant "".

A slot is its page's size rounded up to SLOT_ALIGN (64 bytes, a cache line), so a page of N
bytes costs under N + 64 bytes of the arena: a 448-byte Mamba state or a 1 KiB indexer page
takes its own size, not a 4 KiB page of memory. Nothing needs more: clients copy at
base + offset with unaligned loads (the C copy, memcpy, recv_into), the GPU gather's widest
word is 16 bytes (kv_layout.cu), RDMA and CUDA register the whole arena, O_DIRECT reads land in a bounce buffer (tiers/nvme.py), and mapping, sealing
and hole punching work on whole slabs (multiples of 4 KiB). A cache line apart, slots written at
once by different writers never share one. Pages whose size is a multiple of 4 KiB still start
on 4 KiB boundaries (slab bases are).

The allocator only hands out and takes back slots; which page to evict when a size class is
full is the index's decision. A slab belongs to one (tenant, slot size) while it holds any
slot; when its last slot is freed it returns to the free pool, so memory flows between page
sizes and tenants as pages come and go.
"""

from __future__ import annotations

import array
import collections
import ctypes
import fcntl
import logging
import mmap
import os
import threading
import time
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

SLOT_ALIGN = 64   # a cache line: see the module docstring for why no more is needed
DEFAULT_TENANT = ""

# Linux values (the same on x86-64 and arm64); Python's mmap module cannot map at a fixed address.
_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED = 0x01
_MAP_FIXED = 0x10
_MAP_POPULATE = 0x8000
_MAP_NORESERVE = 0x4000
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_STEP_BYTES = 1 << 30   # the arena is allocated and mapped a step at a time, so start-up can show progress
_PROGRESS_S = 2.0           # at most one progress line this often

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def slot_bytes_for(page_bytes: int) -> int:
    """The page's size rounded up to SLOT_ALIGN: a slot wastes under 64 bytes."""
    return (page_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def _map_fixed(address: int, nbytes: int, fd: int, offset: int, populate: bool) -> None:
    flags = _MAP_SHARED | _MAP_FIXED | (_MAP_POPULATE if populate else 0)
    if _libc.mmap(address, nbytes, _PROT_READ_WRITE, flags, fd, offset) == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {nbytes} bytes at arena offset {offset}: {os.strerror(errno)}")


def _punch(fd: int, offset: int, nbytes: int) -> None:
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"punching {nbytes} bytes at offset {offset}: {os.strerror(errno)}")


class Arena:
    """The DRAM arena: one virtual range of `nbytes`, each slab mapped from its tenant's memfd."""

    def __init__(self, nbytes: int, slab_bytes: int = 64 << 20, hugepages: bool = False, prefault: bool = True,
                 tenants_apart: bool = False):
        self.nbytes = nbytes
        self.slab_bytes = slab_bytes
        self.tenants_apart = tenants_apart
        self._hugepages = hugepages
        self._prefault = prefault
        self._fds: dict[str, int] = {}
        self._retired: list[int] = []         # replaced memfds (replace_memfd), kept empty
        self._fds_lock = threading.Lock()     # local connections ask for fds while the store moves slabs
        self._holders: list[str] = [DEFAULT_TENANT] * -(-nbytes // slab_bytes)   # slab index -> tenant
        self.slab_moves = 0
        self.slab_move_s = 0.0
        self.trimmed_bytes = 0
        fd = self.fd_of(DEFAULT_TENANT)
        try:
            # The range is reserved by an anonymous mapping (so the mmap object owns and unmaps it),
            # then replaced by the default tenant's memfd a step at a time. With prefault, each step's
            # pages are allocated first (a short machine fails at start-up, not mid-put; the node
            # checks the host first: tiers/host_memory.py) and mapped with MAP_POPULATE, so the first
            # touch of a slot takes no page fault (the server hashes every commit).
            self.mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                                  prot=_PROT_READ_WRITE)
            probe = (ctypes.c_char * 1).from_buffer(self.mmap)
            self.address = ctypes.addressof(probe)
            del probe
            started = shown = time.perf_counter()
            for offset in range(0, nbytes, _MAP_STEP_BYTES):
                step = min(_MAP_STEP_BYTES, nbytes - offset)
                if prefault:
                    os.posix_fallocate(fd, offset, step)
                _map_fixed(self.address + offset, step, fd, offset, prefault)
                if prefault and time.perf_counter() - shown >= _PROGRESS_S and offset + step < nbytes:
                    shown = time.perf_counter()
                    log.info("arena prefaulting done_bytes=%d bytes=%d elapsed_s=%.1f", offset + step, nbytes,
                             shown - started)
            if prefault:
                log.info("arena prefaulted bytes=%d duration_ms=%.1f", nbytes, (time.perf_counter() - started) * 1e3)
        except OSError:
            self._close_fds()
            raise
        self.view = memoryview(self.mmap)

    @property
    def fd(self) -> int:
        """The default tenant's memfd (the whole arena when tenants are not told apart)."""
        return self._fds[DEFAULT_TENANT]

    def key(self, tenant: str) -> str:
        """Whose memfd holds this tenant's pages."""
        return tenant if self.tenants_apart else DEFAULT_TENANT

    def fd_of(self, tenant: str) -> int:
        """The memfd holding `tenant`'s pages (created, arena-sized and empty, on first use)."""
        key = self.key(tenant)
        with self._fds_lock:
            fd = self._fds.get(key)
            if fd is None:
                flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if self._hugepages else 0)
                fd = os.memfd_create(f"kvstore-dram:{key}"[:240], flags)
                try:
                    os.ftruncate(fd, self.nbytes)
                    # Clients map this fd read-write: sealed, none can shrink it (the node's next touch of
                    # a truncated slot would die of SIGBUS) or grow it (memory beyond the arena).
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                except OSError:
                    os.close(fd)
                    raise
                self._fds[key] = fd
            return fd

    def holder(self, slab_base: int) -> str:
        return self._holders[slab_base // self.slab_bytes]

    def place(self, slab_base: int, tenant: str) -> bool:
        """Make a free slab `tenant`'s: its old tenant's copy is punched out, then the range is mapped from
        `tenant`'s memfd. False (the slab stays with its old tenant) when the memory cannot be allocated."""
        index, key = slab_base // self.slab_bytes, self.key(tenant)
        old = self._holders[index]
        if old == key:
            return True
        started = time.perf_counter()
        fd, nbytes = self.fd_of(key), min(self.slab_bytes, self.nbytes - slab_base)
        _punch(self._fds[old], slab_base, nbytes)    # first: the arena never holds a slab twice
        if self._prefault:
            try:
                os.posix_fallocate(fd, slab_base, nbytes)
            except OSError as exc:
                log.error("slab at offset %d not moved to tenant %r: %s", slab_base, key, exc)
                return False
        _map_fixed(self.address + slab_base, nbytes, fd, slab_base, self._prefault)
        self._holders[index] = key
        self.slab_moves += 1
        self.slab_move_s += time.perf_counter() - started
        log.debug("slab moved offset=%d from=%r to=%r", slab_base, old, key)
        return True

    def replace_memfd(self, tenant: str) -> None:
        """Give `tenant` a fresh memfd holding the same pages and empty the old one. The caller sees that
        nothing writes the tenant's slabs meanwhile (no lease of it open, no promotion under way)."""
        assert self.tenants_apart, "tenants sharing one memfd have none of their own to replace"
        with self._fds_lock:
            old = self._fds.pop(tenant)
        new = self.fd_of(tenant)
        for index, holder in enumerate(self._holders):
            if holder != tenant:
                continue
            base = index * self.slab_bytes
            nbytes = min(self.slab_bytes, self.nbytes - base)
            staging = mmap.mmap(new, nbytes, offset=base)
            try:
                staging[:] = self.view[base:base + nbytes]
            finally:
                staging.close()
            _map_fixed(self.address + base, nbytes, new, base, self._prefault)   # the same bytes, from `new`
        _punch(old, 0, self.nbytes)
        with self._fds_lock:
            self._retired.append(old)

    def trim(self) -> int:
        """Punch each memfd back to the slabs its tenant holds (a client may have touched holes of its own
        memfd, allocating memory nobody gave it). Returns the bytes freed."""
        freed = 0
        with self._fds_lock:
            fds = dict(self._fds)
        for key, fd in fds.items():
            held = self._holders.count(key) * self.slab_bytes
            allocated = os.fstat(fd).st_blocks * 512
            if allocated <= held:
                continue
            for index, holder in enumerate(self._holders):
                if holder != key:
                    base = index * self.slab_bytes
                    _punch(fd, base, min(self.slab_bytes, self.nbytes - base))
            now = os.fstat(fd).st_blocks * 512
            freed += max(allocated - now, 0)
            log.warning("tenant %r's memfd held %d bytes beyond its slabs (touched by a client): punched out",
                        key, allocated - held)
        with self._fds_lock:
            retired = list(self._retired)
        for fd in retired:
            allocated = os.fstat(fd).st_blocks * 512
            if allocated:
                _punch(fd, 0, self.nbytes)
                freed += allocated
                log.warning("a replaced memfd held %d bytes (touched by a process that kept it): punched out",
                            allocated)
        self.trimmed_bytes += freed
        return freed

    def close(self) -> None:
        self.view.release()
        try:
            self.mmap.close()
        except BufferError:
            pass
        self._close_fds()

    def _close_fds(self) -> None:
        with self._fds_lock:
            for fd in [*self._fds.values(), *self._retired]:
                os.close(fd)
            self._fds.clear()
            self._retired.clear()


class _Slab:
    __slots__ = ("base", "tenant", "slot_bytes", "free", "capacity")

    def __init__(self, base: int, tenant: str, slab_bytes: int, slot_bytes: int):
        self.base = base
        self.tenant = tenant
        self.slot_bytes = slot_bytes
        self.capacity = slab_bytes // slot_bytes
        # Popped from the end: hand out low offsets first. Eight bytes a slot, where a list of ints
        # cost 36 (a slab of 448-byte slots holds a hundred and fifty thousand). Filled from numpy's
        # arange in one pass: from a range, an int object a slot made it 40x slower (127 us for the
        # 1024 slots of a 4 MiB slab of 4 KiB pages, under the store's lock at every slab taken).
        self.free = array.array("q")
        self.free.frombytes(np.arange(base + (self.capacity - 1) * slot_bytes, base - 1, -slot_bytes,
                                      dtype=np.int64).tobytes())


def _always(slab_base: int, tenant: str) -> bool:
    return True


class SlabAllocator:
    """Slots of a few fixed sizes over one arena, each slab held whole by one tenant.

    `place(slab_base, tenant)` gives a free slab's memory to a tenant (Arena.place) and may
    refuse. Not thread-safe: the store's lock guards it.
    """

    def __init__(self, arena_bytes: int, slab_bytes: int, place: Callable[[int, str], bool] = _always):
        self.slab_bytes = slab_bytes
        self._place = place
        # Free slabs by the tenant that last held them: a tenant takes its own back first (no move).
        self._free_slabs: dict[str, list[int]] = {
            DEFAULT_TENANT: [i * slab_bytes for i in range(arena_bytes // slab_bytes - 1, -1, -1)]}
        self._slabs: dict[int, _Slab] = {}                            # slab base -> slab in use
        self._partial: dict[tuple[str, int], dict[int, _Slab]] = {}   # (tenant, slot size) -> slabs with a free slot
        self.slabs_held: collections.Counter[str] = collections.Counter()   # tenant -> slabs with a used slot
        self.used_bytes = 0
        self.capacity_bytes = arena_bytes // slab_bytes * slab_bytes

    def allocate(self, slot_bytes: int, tenant: str = DEFAULT_TENANT) -> int | None:
        """Offset of a free slot of this size for `tenant`, or None when its size is full and no slab is free."""
        offsets = self.allocate_many(slot_bytes, 1, tenant)
        return offsets[0] if offsets else None

    def allocate_many(self, slot_bytes: int, count: int, tenant: str = DEFAULT_TENANT,
                      new_slabs_max: int | None = None) -> list[int]:
        """Up to `count` free slots of this size in `tenant`'s slabs, taken a slab at a time (fewer when full,
        or past `new_slabs_max` more slabs; None: no limit)."""
        partial = self._partial.setdefault((tenant, slot_bytes), {})
        offsets: list[int] = []
        new_slabs = 0
        while len(offsets) < count:
            if not partial:
                base = None if new_slabs_max is not None and new_slabs >= new_slabs_max else self._take_slab(tenant)
                if base is None:
                    break
                new_slabs += 1
                slab = _Slab(base, tenant, self.slab_bytes, slot_bytes)
                self._slabs[base] = slab
                self.slabs_held[tenant] += 1
                partial[base] = slab
            slab = next(iter(partial.values()))
            take = min(count - len(offsets), len(slab.free))
            offsets.extend(slab.free[-take:][::-1])
            del slab.free[-take:]
            if not slab.free:
                del partial[slab.base]
        self.used_bytes += len(offsets) * slot_bytes
        return offsets

    def slot_bytes_of(self, offset: int) -> int:
        return self._slabs[offset - offset % self.slab_bytes].slot_bytes

    def slots_used(self, offset: int) -> int:
        """How many slots of the slab holding `offset` are in use."""
        slab = self._slabs[offset - offset % self.slab_bytes]
        return slab.capacity - len(slab.free)

    def free(self, offset: int) -> int:
        """Take the slot back; returns its size."""
        slab = self._slabs[offset - offset % self.slab_bytes]
        assert (offset - slab.base) % slab.slot_bytes == 0, f"offset {offset} is not a slot start"
        slab.free.append(offset)
        self.used_bytes -= slab.slot_bytes
        partial = self._partial[(slab.tenant, slab.slot_bytes)]
        if len(slab.free) == slab.capacity:
            partial.pop(slab.base, None)
            self._release(slab)
        else:
            partial[slab.base] = slab
        return slab.slot_bytes

    def free_many(self, offsets: list[int], slot_bytes: int) -> None:
        """free() of each of these slots, all of size `slot_bytes`, in order. Slots one after another, up
        or down (eviction's usual victims: a commit's pages, leaf first), are taken back a slab at a time."""
        count = len(offsets)
        step = offsets[1] - offsets[0] if count > 1 else 0
        if abs(step) != slot_bytes or offsets != list(range(offsets[0], offsets[0] + step * count, step)):
            for offset in offsets:
                assert self.free(offset) == slot_bytes, f"slot {offset} is not of {slot_bytes} bytes"
            return
        start = 0
        while start < count:
            first = offsets[start]
            base = first - first % self.slab_bytes
            in_slab = (base + self.slab_bytes - first) // slot_bytes if step > 0 else (first - base) // slot_bytes + 1
            end = min(count, start + in_slab)
            slab = self._slabs[base]
            assert slab.slot_bytes == slot_bytes and (first - base) % slot_bytes == 0, \
                f"offset {first} is not the start of a {slot_bytes}-byte slot"
            slab.free.extend(offsets[start:end])
            self.used_bytes -= slot_bytes * (end - start)
            partial = self._partial[(slab.tenant, slot_bytes)]
            if len(slab.free) == slab.capacity:
                partial.pop(base, None)
                self._release(slab)
            else:
                partial[base] = slab
            start = end

    def _release(self, slab: _Slab) -> None:
        """A slab's last slot came back: it is free, and stays with its tenant until another takes it."""
        del self._slabs[slab.base]
        self.slabs_held[slab.tenant] -= 1
        self._free_slabs.setdefault(slab.tenant, []).append(slab.base)

    def free_slabs(self) -> int:
        return sum(map(len, self._free_slabs.values()))

    def tenant_of(self, offset: int) -> str:
        """The tenant whose slab holds this used slot."""
        return self._slabs[offset - offset % self.slab_bytes].tenant

    def _take_slab(self, tenant: str) -> int | None:
        """A free slab for `tenant`: one it held last, else one of the default pool, else anyone's."""
        for holder in (tenant, DEFAULT_TENANT, *self._free_slabs):
            bases = self._free_slabs.get(holder)
            if not bases:
                continue
            base = bases.pop()
            if holder == tenant or self._place(base, tenant):
                return base
            bases.append(base)   # its memory could not be given: it stays with its holder
            return None
        return None
