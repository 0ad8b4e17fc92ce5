"""Where a page's bytes land as they are read from a socket, and their xxh3 on the way.

Both ends of the TCP data plane receive a page a read at a time (the node a PUT's body, the
client a GET's answer) and hash it as it comes. The reader starts each page with `reset()`,
asks `place(dst)` where the next bytes bound for `dst` go, reads into it, and says
`landed(dst, n)`. A page whose bytes need no hash (a GET answer the node vouched for:
tcp_framing.VOUCHED) starts with `reset(hashed=False)` and lands the same way, unhashed:

- CopiedLanding (kvstore_native): each read lands in a private buffer small enough to stay in
  the CPU's cache, and one native pass (CopyHasher) copies it into place with streamed stores
  and hashes it from that buffer. The kernel's copy then writes cache-hot lines, where a read
  straight into a cold page made it fetch every destination line before writing it, and the
  hash reads the buffer, not the page. What is hashed is what was written, whatever else may
  write the destination. Loopback against a raw socket, one core: puts 0.68 -> 0.73, gets
  0.71 -> 0.79 (native/README.md). An unhashed page is copied out with the same streamed
  stores (CopyHasher.copy_unhashed): a read straight into a cold page is slower than both.
  A reader on a plain blocking socket (the client; `receives`) hands it the whole page
  instead: `receive` runs the read-and-copy loop natively, without the GIL. A read that leaves
  the page part-way through a 64-byte line (a socket read returns what has come; the node hands
  on the bytes of a body read ahead with its header) is followed, where the page is hashed, by
  one short read to the line's end: CopyHasher copies and hashes in one pass only from a line and
  an xxh3 stripe on, so one such read would otherwise put the rest of the page on its two-pass path.
- DirectLanding (without kvstore_native's CopyHasher): reads go straight into place,
  DIRECT_PIECE_BYTES at most, each piece hashed by xxhash right after it lands.
"""

from __future__ import annotations

import mmap

import xxhash

from kvstore_client import native

# The private buffer: small beside a core's L2 (1-2 MiB), so the kernel's copy into it and the native copy out
# of it both hit the cache, with the sender's buffers beside it where both ends share a core.
LANDING_BYTES = 256 << 10
# A direct read: small enough to be hashed from the CPU's cache, large enough that the extra reads cost little
# beside the bytes.
DIRECT_PIECE_BYTES = 1 << 20
# CopyHasher's one-pass copy-and-hash starts at a cache line of the destination and an xxh3 stripe: both 64 bytes.
LINE_BYTES = 64


def landing_buffer() -> memoryview:
    """A private buffer for CopiedLanding (page-aligned). Readers on one thread may share one: each read's bytes are
    copied out before the next read."""
    return memoryview(mmap.mmap(-1, LANDING_BYTES))


class _Landing:
    """A page's xxh3 so far; each kind says where the next bytes bound for `dst` go (place) and takes in the
    `nbytes` of them that came (landed)."""

    def __init__(self, hasher) -> None:
        self._hasher = hasher
        self._hashed = True

    def reset(self, hashed: bool = True) -> None:
        """Start a page; `hashed` False: its bytes land unhashed (intdigest is then that of no bytes)."""
        self._hasher.reset()
        self._hashed = hashed

    def intdigest(self) -> int:
        return self._hasher.intdigest()


class CopiedLanding(_Landing):
    receives = True

    def __init__(self, buffer: memoryview) -> None:
        super().__init__(native.CopyHasher())
        self._buffer = buffer
        self._landed = 0   # bytes of this page landed so far

    def reset(self, hashed: bool = True) -> None:
        super().reset(hashed)
        self._landed = 0

    def receive(self, fd: int, dst: memoryview, deadline: float | None) -> None:
        """Fill `dst` from the blocking socket `fd`, every read landed as place/landed would land it, in one native
        loop without the GIL: a 1 MiB page is about six reads, each a pass of Python otherwise. Past `deadline`
        (time.monotonic()) TimeoutError; at the end of the stream ConnectionResetError."""
        self._hasher.receive(fd, dst, self._buffer, self._hashed, deadline or 0.0)

    def place(self, dst: memoryview) -> memoryview:
        cut = self._landed % LINE_BYTES if self._hashed else 0   # part-way through a line: read to its end
        return self._buffer[:min(len(dst), LINE_BYTES - cut if cut else LANDING_BYTES)]

    def landed(self, dst: memoryview, nbytes: int) -> None:
        self._landed += nbytes
        if self._hashed:
            self._hasher.copy(dst, self._buffer[:nbytes])
        else:
            self._hasher.copy_unhashed(dst, self._buffer[:nbytes])


class DirectLanding(_Landing):
    receives = False   # the reader loops over place/landed itself

    def __init__(self) -> None:
        super().__init__(xxhash.xxh3_64())

    def place(self, dst: memoryview) -> memoryview:
        return dst[:DIRECT_PIECE_BYTES]

    def landed(self, dst: memoryview, nbytes: int) -> None:
        if self._hashed:
            self._hasher.update(dst[:nbytes])


def new_landing(buffer: memoryview | None = None) -> CopiedLanding | DirectLanding:
    """A landing for one page stream (one thread): copied through `buffer` (landing_buffer(), a new one when None)
    where kvstore_native has CopyHasher, else direct."""
    if native.CopyHasher is None:
        return DirectLanding()
    return CopiedLanding(landing_buffer() if buffer is None else buffer)
