"""Puts and gets of pages in a shared page buffer, copied by this process and the node at once (shared_buffers.py).

One connection's side of it: the buffers it has shared with the node (each once, on first use, with the
ids the node gave them), the MOVE_PAGES of each large move, and this process's own share of the copy.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from kvstore_client import errors, framing, native, shared_buffers
from kvstore_client.channel import LocalChannel
from kvstore_client.data_path import Pages, offsets_and_segments
from kvstore_client.shared_buffers import SharedPages

log = logging.getLogger(__name__)

# A move of fewer bytes, or of smaller pages, is copied by this process alone. MOVE_PAGES and its answer cost
# tens of microseconds on each side, and the node's thread takes as long to wake: on a host copying 11 GB/s,
# this process had claimed 15.5 of the 16 pages of a 1 MiB move (64 KiB pages) before the node began, then
# waited 59 us for its answer; below 2 MiB, such a put's last Commit run goes alone (64 KiB puts: 5-9% more
# GB/s, alternated). And the node holds each page's slot before it copies any (a few microseconds of Python a
# page): with pages of 4 KiB, gets of 1,024 from a shared buffer ran at 402k pages/s where the client alone
# got 622k.
MOVE_BYTES_MIN = 2 << 20
MOVE_PAGE_BYTES_MIN = 64 << 10
# When a call's deadline passes during a move, this process has claimed and copied every page the node did
# not: the call waits this long for the node to finish those it claimed, so it never returns while the node
# may still write into the caller's buffer, then gives up on the node.
FINISH_WAIT_S = 10.0


class _Bytes:
    """An answer read as its bytes."""
    FromString = staticmethod(bytes)


class AssistedCopies:
    def __init__(self, channel: LocalChannel, arena_base: int):
        self._channel = channel
        self._arena_base = arena_base
        self._ids: dict[SharedPages, int | None] = {}   # shared here -> the node's id (None: it did not take it)
        self._sharing = threading.Lock()   # threads of one client share a buffer once

    def move(self, into_buffer: bool, lease_id: int, token: bytes, indices: Sequence[int], offsets: Sequence[int],
             segments: Any, page_bytes: int, settle_later: bool = False) -> memoryview | MoveInFlight | None:
        """Copy pages between their slots (arena offsets) and a shared buffer, with the node: each page's xxh3
        (of the bytes written, as the one-sided copies give it). None where this move is not one to share:
        few bytes, pages outside any shared buffer, no kvstore_native, or a buffer the node did not take.
        `settle_later`: once this process has copied its part, a MoveInFlight, the node's answer not yet read."""
        count = len(indices)
        held = shared_buffers.holding(segments, page_bytes) if _large_enough(count, page_bytes) else None
        if held is None:
            return None
        shared, buffer_offsets = held
        buffer_id = self._share(shared)
        cursor = shared.take_cursor() if buffer_id is not None else None
        if cursor is None:
            return None
        request = framing.encode_move(lease_id, token, buffer_id, cursor, page_bytes, into_buffer,
                                      np.asarray(indices, dtype=np.uint32), buffer_offsets)
        pending = self._channel.submit_frame("MovePages", framing.encode(framing.MOVE_PAGES, request), _Bytes)
        node_part = functools.partial(self._node_part, pending, shared, cursor)
        try:
            mine = native.copy_claimed(shared.cursor_address(cursor), into_buffer, self._arena_base, offsets,
                                       shared.base, _as_q(buffer_offsets), page_bytes)
        except BaseException:
            node_part()
            raise
        if settle_later:
            return MoveInFlight(mine, count, node_part)
        return _merged(mine, node_part(), count)

    @staticmethod
    def shares(pages: Pages, page_bytes: int) -> bool:
        """Whether a move of `pages` is one to share: move() then waits on the node's answer. Their segments are
        looked at only for a move large enough."""
        return (_large_enough(len(pages), page_bytes)
                and shared_buffers.holding(offsets_and_segments(pages)[1], page_bytes) is not None)

    def _node_part(self, pending: Any, shared: SharedPages, cursor: int) -> bytes:
        """The node's answer to a move; its claim counter goes back to the buffer once the node is done with it."""
        try:
            answer = pending.result()
        except errors.DeadlineExceeded:
            pending.deadline = time.monotonic() + FINISH_WAIT_S
            try:
                pending.result()
            except errors.DeadlineExceeded:   # the counter is never used again: the node may still hold it
                raise errors.Unavailable(
                    f"the node did not finish its part of a copy within {FINISH_WAIT_S:.0f} s of the call's "
                    "deadline: pages of the shared buffer this call named may still be written by it") from None
            except errors.KVStoreError:
                pass
            shared.give_back(cursor)
            raise
        except errors.KVStoreError:   # refused before it claimed any page, or the channel broke
            if self._channel.alive():
                shared.give_back(cursor)
            raise
        shared.give_back(cursor)
        return answer

    def _share(self, shared: SharedPages) -> int | None:
        """The node's id of `shared` on this connection, handing it over the first time."""
        with self._sharing:
            self._unshare_released()
            if shared not in self._ids:
                self._ids[shared] = self._hand_over(shared)
            return self._ids[shared]

    def _hand_over(self, shared: SharedPages) -> int | None:
        """Send the memfd of `shared`; the id the node gave it, or None where it did not take it."""
        fd = shared.dup_fd()
        if fd < 0:
            return None
        try:
            pending = self._channel.submit_frame("ShareBuffer", framing.encode(framing.SHARE_BUFFER, b""), _Bytes,
                                                 fd=fd)
        finally:
            os.close(fd)
        try:
            return framing.BUFFER_ID.unpack(pending.result())[0]
        except errors.KVStoreError as exc:
            if not self._channel.alive():
                raise
            log.info("the node did not take a shared page buffer, whose pages move as any buffer's: %s", exc)
            return None

    def _unshare_released(self) -> None:
        """Tell the node to unmap the buffers shared here whose arrays are gone."""
        for shared in [shared for shared in self._ids if shared.released]:
            buffer_id = self._ids.pop(shared)
            if buffer_id is not None:
                frame = framing.encode(framing.UNSHARE_BUFFER, framing.BUFFER_ID.pack(buffer_id))
                self._channel.submit_frame("UnshareBuffer", frame, _Bytes).posted = True


class MoveInFlight:
    """A put's shared move once this process has copied its part, the node's answer not yet read: the pages' checksums
    (0 where the node copied the page) and `copied_by_node` (a byte a page), for a Commit sent at once. The node serves
    a connection's frames in order, so it has finished the move and recorded its pages' checksums before it reads
    that Commit (CommitRequest.copied_by_node), and the Commit no longer waits for the move's answer (64 KiB puts
    from a shared buffer: the answer came 60-80 us after this process's part). settle() reads the answer; a put
    settles every move before it returns, as a call must not while the node may still read the caller's buffer."""

    def __init__(self, mine: tuple[bytes, bytes], count: int, node_part: Callable[[], bytes]):
        sums, claims = mine
        self.checksums = memoryview(sums).cast("Q")
        self.copied_by_node = (np.frombuffer(claims, dtype=np.uint8) == 0).astype(np.uint8).tobytes()
        self._mine, self._count, self._node_part = mine, count, node_part
        self._settled = False

    def settle(self) -> None:
        """Wait for the node's part (at most once); Internal unless each page was copied exactly once, or the error
        the node answered."""
        if not self._settled:
            self._settled = True
            _merged(self._mine, self._node_part(), self._count)


def _merged(mine: tuple[bytes, bytes], theirs: bytes, count: int) -> memoryview:
    """Each page's checksum, from whichever side copied it; Internal unless each page was copied exactly once."""
    my_sums, my_claims = mine
    if len(theirs) != 9 * count:
        raise errors.Internal(f"the node answered a move of {count} pages with {len(theirs)} bytes")
    their_claims = np.frombuffer(theirs, dtype=np.uint8, count=count).astype(bool)
    claimed = np.frombuffer(my_claims, dtype=np.uint8).astype(bool)
    if (claimed & their_claims).any() or not (claimed | their_claims).all():
        raise errors.Internal("a shared move's pages were not each copied once (its claim counter was changed "
                              "during the move)")
    sums = np.where(their_claims, np.frombuffer(theirs, dtype=np.uint64, count=count, offset=count),
                    np.frombuffer(my_sums, dtype=np.uint64))
    return memoryview(sums.tobytes()).cast("Q")


def _large_enough(count: int, page_bytes: int) -> bool:
    """Whether `count` pages of `page_bytes` are a move to share with the node (where kvstore_native can)."""
    return (native.copy_claimed is not None and count >= 2 and page_bytes >= MOVE_PAGE_BYTES_MIN
            and count * page_bytes >= MOVE_BYTES_MIN)


def _as_q(values: np.ndarray) -> memoryview:
    """uint64s as a buffer of format 'Q', which kvstore_native reads in place (numpy's says 'L')."""
    return memoryview(np.ascontiguousarray(values, dtype=np.uint64)).cast("B").cast("Q")
