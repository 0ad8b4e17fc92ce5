"""Page buffers the node can reach: puts from them and gets into them are copied by the client and the node at once.

A put through shared memory is one copy, from the caller's buffer into the arena, and one core does it: on
this host a core's copy is the limit (1-4 MiB pages move at 0.92-1.09 of memmove). Where the caller's pages
live in memory the node maps too, the node can take part of the copy on its own core. shared_page_buffer()
makes such a buffer: a memfd, sealed so that it cannot shrink (the node would take SIGBUS reading past a
shortened file), filled in when it is made (so its memory is the caller's, not the node's), and handed to the
node over the local socket the first time a put or a get uses it on a connection (framing.SHARE_BUFFER).

Each put or get of large pages in one then names its pages to the node (framing.MOVE_PAGES) and starts
copying them itself. Both sides claim pages one at a time with an atomic add to a counter in the buffer's
first page (kvstore_native.copy_claimed), so each copies as many as it gets to: a node busy elsewhere takes
few, an idle one 40-50% here. Each side hashes the pages it copies as the single-sided copies do; a get's
checksums, the node's too, are compared with those recorded at commit. The call returns only after the node
has answered, so nothing of the node's copy touches the caller's buffer after it (a node that has not
answered 10 s past the call's deadline is given up on, and the error says the buffer may still change:
assisted_copy.py).

Without kvstore_native, or where the node does not take the buffer, pages move as from any other buffer.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from kvstore_client import errors
from kvstore_client.buffers import PageRows

# The buffer's first page holds the claim counters, one a cache line: CURSORS moves at once per buffer.
HEADER_BYTES = 4096
CURSOR_STRIDE = 64
CURSORS = HEADER_BYTES // CURSOR_STRIDE

# id(SharedPages) -> it, from its making until its release, or until the next buffer is made where the release
# found the lock held (_prune; look-ups skip released buffers meanwhile). A buffer's release runs in a weakref
# finalizer, which the garbage collector may start in any thread at any allocation: inside a section holding
# _live_lock too. So a release takes only its buffer's own lock, and never waits for this one.
_live: dict[int, "SharedPages"] = {}
_live_lock = threading.Lock()


def shared_page_buffer(pages: int, page_bytes: int) -> np.ndarray:
    """A (pages, page_bytes) uint8 array on a 4 KiB boundary, as page_buffer(), in memory the node can map:
    puts from it and gets into it over shared memory are copied by this process and the node at once."""
    if pages <= 0 or page_bytes <= 0:
        raise errors.InvalidArgument(f"a shared page buffer of {pages} pages of {page_bytes} bytes: both positive")
    shared, memory = SharedPages.create(pages * page_bytes)
    array = np.frombuffer(memory, dtype=np.uint8, count=pages * page_bytes,
                          offset=HEADER_BYTES).reshape(pages, page_bytes)
    with _live_lock:
        _prune()
        _live[id(shared)] = shared
    # The mapping lives as long as any view of it (every slice of the array holds it): once it goes, so does
    # the buffer's share on each connection.
    weakref.finalize(memory, shared.release)
    return array


class SharedPages:
    """One shared buffer: its memfd (kept open to hand to each connection), its mapping and its claim counters."""

    def __init__(self, fd: int, size: int, base: int):
        self.fd, self.size, self.base = fd, size, base
        self.released = False
        self._free = list(range(CURSORS))
        self._lock = threading.Lock()

    @classmethod
    def create(cls, nbytes: int) -> tuple["SharedPages", mmap.mmap]:
        """A buffer of at least `nbytes` past its header, and its mapping (which it holds no reference to)."""
        size = HEADER_BYTES + -(-nbytes // 4096) * 4096
        fd = os.memfd_create("kvstore-shared-pages", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(fd)
            raise
        probe = ctypes.c_char.from_buffer(memory)
        base = ctypes.addressof(probe)
        del probe
        return cls(fd, size, base), memory

    def locate(self, segments: Any, page_bytes: int) -> np.ndarray | None:
        """Each page's offset in this buffer, if every page of `segments` is one run of page_bytes in it."""
        if isinstance(segments, PageRows):
            first = segments.base - self.base
            offsets = first + np.arange(len(segments), dtype=np.uint64) * page_bytes
            end = first + len(segments) * page_bytes
        else:
            starts = []
            for page in segments:
                if len(page) != 1 or page[0][1] != page_bytes:
                    return None
                starts.append(page[0][0] - self.base)
            offsets = np.array(starts, dtype=np.int64)
            first, end = (int(offsets.min()), int(offsets.max()) + page_bytes) if len(offsets) else (0, 0)
            offsets = offsets.astype(np.uint64)
        return offsets if HEADER_BYTES <= first and end <= self.size else None

    def dup_fd(self) -> int:
        """A duplicate of the memfd to hand over (closed by the caller); -1 once the buffer is released."""
        with self._lock:
            return -1 if self.released else os.dup(self.fd)

    def take_cursor(self) -> int | None:
        """A claim counter of its own for one move, set to 0; None while CURSORS moves use this buffer."""
        with self._lock:
            if not self._free:
                return None
            cursor = self._free.pop()
        ctypes.c_uint64.from_address(self.cursor_address(cursor)).value = 0
        return cursor

    def give_back(self, cursor: int) -> None:
        with self._lock:
            self._free.append(cursor)

    def cursor_address(self, cursor: int) -> int:
        return self.base + cursor * CURSOR_STRIDE

    def release(self) -> None:
        """The array is gone: no new move uses the buffer, and connections unshare it (AssistedCopies)."""
        with self._lock:
            if self.released:
                return
            self.released = True
            os.close(self.fd)
            self.fd = -1
        if _live_lock.acquire(blocking=False):   # held (by this thread, maybe): the next buffer made prunes it
            try:
                _prune()
            finally:
                _live_lock.release()


def holding(segments: Any, page_bytes: int) -> tuple[SharedPages, np.ndarray] | None:
    """The shared buffer holding every page of `segments` whole, with the pages' offsets in it; None if none does."""
    if isinstance(segments, PageRows):
        address = segments.base
    elif segments and len(segments[0]) == 1:
        address = segments[0][0][0]
    else:
        return None
    with _live_lock:
        candidates = [shared for shared in _live.values()
                      if not shared.released and shared.base <= address < shared.base + shared.size]
    for shared in candidates:
        offsets = shared.locate(segments, page_bytes)
        if offsets is not None:
            return shared, offsets
    return None


def live_buffers() -> Sequence[SharedPages]:
    with _live_lock:
        return [shared for shared in _live.values() if not shared.released]


def _prune() -> None:
    """_live_lock held: forget the released buffers. A finalizer run meanwhile only sets a flag (release)."""
    for key in [key for key, shared in _live.items() if shared.released]:
        del _live[key]
