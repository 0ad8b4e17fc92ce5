"""The page buffers one local connection shared with the node, and the node's part of each move in them.

A client's shared page buffer (kvstore_client/shared_buffers.py) is a memfd it hands over on its local
socket (framing.SHARE_BUFFER). The node maps it only if nothing the client does later can make reading or
writing it fault: it must be a memfd sealed against shrinking (a shortened file is SIGBUS in the node), its
size whole pages, all of them allocated (so the node's writes into it take no memory of the node's). A
client can still punch holes in it afterwards; a page the node then writes into costs the node that page's
memory until the client's buffer goes, and no more than BUFFER_BYTES_MAX a buffer.

MOVE_PAGES names pages of one lease by their index in it, with their offsets in one buffer. Everything is
checked before any byte moves: the frame's lengths, the buffer, the claim counter, each offset against the
buffer, the lease against the caller's tenant and its token, and each slot (store.begin_transfer, which also
holds the slot until the move ends, so a lease that expires meanwhile frees nothing under the copy). Then the
node claims pages from the counter the client claims from too and copies each one it claims (a put's page
into its slot, hashed as it is written; a get's out of its slot, hashed where it landed), without the GIL.
It claims at most as many pages as the frame names, whatever the client does to the counter, so the work a
frame buys is bounded by its size. SHARE_BUFFER's is bounded by the buffer's: the node fills in its page tables
for it (about 0.06 s a GiB, _populate), and the buffer's memory is the client's own. What the node copied into
a write lease's slots it records with each slot's checksum (Lease.arrived): a put's Commit, sent on the same
connection before the client reads this answer, names those pages copied_by_node and gets them.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import stat

import numpy as np

from kvstore import failpoints
from kvstore.control import tenancy
from kvstore.control.identity import Identity
from kvstore.control.leases import READ, WRITE
from kvstore.control.store import PageStore
from kvstore_client import errors, framing, native
from kvstore_client.shared_buffers import CURSORS, CURSOR_STRIDE, HEADER_BYTES

_MADV_POPULATE_READ = 22   # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

log = logging.getLogger(__name__)

# Buffers one connection may have shared at once, and the largest one.
BUFFERS_MAX = 64
BUFFER_BYTES_MAX = 1 << 40


class PeerBuffers:
    def __init__(self, store: PageStore, pages_max: int):
        """pages_max: the most pages one MOVE_PAGES names (limits.batch_pages_max)."""
        self._store = store
        self._pages_max = pages_max
        self._buffers: dict[int, _Mapped] = {}
        self._next_id = 1

    def share(self, fd: int) -> bytes:
        """Map the memfd `fd` (taken: closed here); the answer: its id on this connection."""
        try:
            if native.copy_claimed is None:
                raise errors.TransportUnavailable("this node's kvstore_native has no copy_claimed: pages of shared "
                                                  "buffers move as any buffer's")
            if len(self._buffers) >= BUFFERS_MAX:
                raise errors.CapacityExhausted(f"a connection shares at most {BUFFERS_MAX} page buffers with the "
                                               "node; release some (drop their arrays) before sharing more")
            mapped = _Mapped(fd)
        finally:
            os.close(fd)
        buffer_id, self._next_id = self._next_id, self._next_id + 1
        self._buffers[buffer_id] = mapped
        return framing.BUFFER_ID.pack(buffer_id)

    def unshare(self, payload: bytes | bytearray) -> bytes:
        if len(payload) != framing.BUFFER_ID.size:
            raise errors.MalformedRequest(f"UNSHARE_BUFFER carries a {framing.BUFFER_ID.size}-byte id, "
                                          f"not {len(payload)} bytes")
        mapped = self._buffers.pop(framing.BUFFER_ID.unpack(payload)[0], None)
        if mapped is not None:
            mapped.close()
        return b""

    def move(self, payload: bytes | bytearray, identity: Identity) -> bytes:
        """The node's part of a MOVE_PAGES: which of its pages it copied (a byte each) and their checksums."""
        lease_id, token, buffer_id, cursor, page_bytes, into_buffer, indices, offsets = framing.decode_move(payload)
        if not 1 <= len(indices) <= self._pages_max or not page_bytes:
            raise errors.InvalidArgument(f"a move of {len(indices)} pages of {page_bytes} bytes: 1 to "
                                         f"{self._pages_max} pages (limits.batch_pages_max) of at least a byte")
        mapped = self._buffers.get(buffer_id)
        if mapped is None:
            raise errors.InvalidArgument(f"no shared buffer {buffer_id} on this connection")
        if cursor >= CURSORS:
            raise errors.InvalidArgument(f"claim counter {cursor} of {CURSORS}")
        starts = np.frombuffer(offsets, dtype=np.uint64)
        if int(starts.min()) < HEADER_BYTES or int(starts.max()) + page_bytes > mapped.size:
            raise errors.InvalidArgument(f"a page of {page_bytes} bytes outside shared buffer {buffer_id} "
                                         f"({HEADER_BYTES} to {mapped.size})")
        if not identity.admin:
            tenancy.own_lease(self._store, lease_id, identity)
        slots = indices.tolist()
        begun = self._store.begin_transfers(lease_id, token, READ if into_buffer else WRITE, slots, page_bytes)
        vouched = [vouch for _, _, vouch in begun]
        arrived: list[int | None] = [None] * len(slots)
        try:
            failpoints.hit("move.before_copy")
            sums, claimed = native.copy_claimed(
                mapped.base + cursor * CURSOR_STRIDE, into_buffer, self._store.arena.address,
                [offset for _, offset, _ in begun], mapped.base, offsets, page_bytes)
            if not into_buffer:   # what landed in each slot the node wrote, as a TCP landing records it
                arrived = [checksum if copied else None
                           for checksum, copied in zip(np.frombuffer(sums, dtype=np.uint64).tolist(), claimed)]
        finally:
            if begun:
                self._store.end_transfers(begun[0][0], slots, arrived, vouched)
        return claimed + sums

    def close(self) -> None:
        for mapped in self._buffers.values():
            mapped.close()
        self._buffers.clear()


def _populate(address: int, nbytes: int) -> None:
    """Fill in the node's page tables for a mapped buffer, as the client's own mapping was (MAP_POPULATE): else
    the node's first touch of each 4 KiB page is a fault inside its copy (64 KiB puts from a new 1 GiB buffer
    ran at 5.3-5.8 GB/s for five passes over it, then 8.5-9). MADV_POPULATE_READ maps a shared memfd's pages
    writable; called through ctypes, it leaves the GIL to the node's other threads (Python's MAP_POPULATE holds
    it throughout: 0.11 s a GiB in which no other thread of the node runs). About 0.06 s a GiB on the sharing
    connection's thread; a kernel before 5.14 refuses it, and the pages fault in as the node first touches them."""
    if _libc.madvise(address, nbytes, _MADV_POPULATE_READ) != 0:
        errno = ctypes.get_errno()
        log.info("a shared page buffer's pages are mapped as the node first touches them (MADV_POPULATE_READ: %s)",
                 os.strerror(errno))


class _Mapped:
    """A checked, mapped shared buffer."""

    def __init__(self, fd: int):
        info = os.fstat(fd)
        size = info.st_size
        if not stat.S_ISREG(info.st_mode) or not HEADER_BYTES < size <= BUFFER_BYTES_MAX or size % 4096:
            raise errors.InvalidArgument(f"a shared page buffer is a memfd of whole 4 KiB pages, more than one and "
                                         f"at most {BUFFER_BYTES_MAX} bytes; this one has {size}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise errors.InvalidArgument("a shared page buffer must be a memfd sealed against shrinking "
                                         "(F_SEAL_SHRINK): the node would fault reading a shortened one")
        if info.st_blocks * 512 < size:
            raise errors.InvalidArgument("a shared page buffer must have all its pages allocated when it is shared "
                                         "(kvstore_client.shared_page_buffer does)")
        self.size = size
        try:
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except OSError as exc:   # sealed against writes, say
            raise errors.InvalidArgument(f"a shared page buffer the node cannot map to read and write: {exc}") from None
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.base = self._array.ctypes.data
        _populate(self.base, size)

    def close(self) -> None:
        del self._array
        self._mmap.close()
