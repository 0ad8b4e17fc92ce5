"""The shared-memory data plane: pages are copied straight into and out of the node's arena.

The memfd of the caller's tenant comes over the node's Unix socket (LocalChannel.map_arena_fd) and
is mapped once per connection (arena.py). Committed pages are not write-protected in it: a get
hashes each page as it copies it, and one that no longer matches the checksum recorded at commit
(changed through a mapping) is refused and reported to the node, which drops it (pipeline.py).
Pages in a shared page buffer (shared_buffers.py) are copied by the client and the node at once
(assisted_copy.py). The socket the memfd came over stays open as long as the mapping is used: the
node closes it when it stops, and that is how a mapping is known to be stale.
"""

from __future__ import annotations

import dataclasses

from kvstore_client import errors, native
from kvstore_client.arena import ArenaMapping
from kvstore_client.assisted_copy import AssistedCopies, MoveInFlight
from kvstore_client.channel import LocalChannel
from kvstore_client.data_path import Pages, PipelineShape, indices_of, offsets_and_segments
from kvstore_client.proto import pb

# With kvstore_native the SDK checksums each page as it copies it, and the node reads nothing
# back. Without it, the server checksums each committed run while the next one is copied: runs
# are short so it reads them back while they are still in the shared L3 cache (a second stream
# from DRAM slows the copy itself by a third), and the last run's checksum is brief.
# A message costs tens of microseconds on each side, more than copying a small page, so a Reserve
# asks for 8 MiB of pages (a batch of 128 pages of 64 KiB in one) and its pages are committed in runs
# of 2 MiB; but for at most 512 pages, which the node reserves in well under a millisecond, so pages
# of 4 KiB start moving while the next 512 are reserved. The first Reserve asks for only 2 MiB: pages
# of 64 KiB and up take far longer to copy than to reserve, so the rest of the batch is reserved while
# those move (64 KiB: 2-5% more puts/s); 512 pages of 4 KiB are 2 MiB anyway (a shorter first group
# made their puts slower). A get is acquired in up to four parts (data_path.ACQUIRE_PARTS).
SHAPE = PipelineShape(reserve_group_pages_min=32, reserve_group_bytes=8 << 20, commit_run_bytes=2 << 20,
                      acquire_part_pages_min=64, reserve_group_pages_max=512, first_group_bytes=2 << 20)
# Where the SDK checksums pages as it copies them, the node reads nothing back, and a run is only a
# message and its Python on both sides (tens of microseconds, and the copy's fence): runs of 32 MiB
# spend 6-7% of a put of 1-4 MiB pages outside the copy where runs of 2 MiB spent 14-19%. Small pages
# are reserved first, and committed, 128 at a time: with packed messages the node reserves and commits a
# page of 4 KiB in about the time the client copies it, so a put of 1,024 of them overlaps the two best in
# short runs (5-16% more puts/s than a first Reserve and Commits of 512, alternated in one hour). Larger
# pages take no short first group: reserving a group of them costs the node tens of microseconds, less
# than the Reserve and Commit a short group adds, and its Commit found the node asleep (64 KiB: 7-8% more
# puts/s without it, twice in one hour; 1 MiB the same).
HASHING_SHAPE = dataclasses.replace(SHAPE, commit_run_bytes=32 << 20, small_run_pages=128, first_group_bytes=0)


class ShmDataPath:
    name = "shm"
    rdma_qp_num = 0

    def __init__(self, channel: LocalChannel, instance_id: bytes, commits_here: bool = False):
        """Map the arena of the node whose Hello said `instance_id`, over `channel` (borrowed, not closed here).
        `commits_here`: the caller's Commits go over `channel` too, so put_ahead may leave a move's answer unread."""
        fd = channel.map_arena_fd()
        arena = ArenaMapping(fd, whole=not channel.arena_of_one_tenant)
        try:
            if channel.call("Hello", pb.HelloRequest()).instance_id != instance_id:
                raise errors.Unavailable(f"{channel.path} on this host belongs to another kvstore node")
        except BaseException:
            arena.close()
            raise
        self.arena = arena
        self._channel = channel
        self._assisted = AssistedCopies(channel, arena.base)
        self.shape = SHAPE if native.module is None else HASHING_SHAPE
        self._commits_here = commits_here

    def put(self, lease_id: int, token: bytes, pages: Pages, page_bytes: int) -> list[int] | None:
        return self._put(lease_id, token, pages, page_bytes, False)

    def put_ahead(self, lease_id: int, token: bytes, pages: Pages, page_bytes: int) -> list[int] | MoveInFlight | None:
        """put(), but a move shared with the node comes back as a MoveInFlight (its answer unread) where the
        Commit that follows goes over this path's channel, which the node serves in order."""
        return self._put(lease_id, token, pages, page_bytes, self._commits_here)

    def _put(self, lease_id: int, token: bytes, pages: Pages, page_bytes: int,
             settle_later: bool) -> list[int] | MoveInFlight | None:
        offsets, segments = offsets_and_segments(pages)
        sums = self._assisted.move(False, lease_id, token, indices_of(pages), offsets, segments, page_bytes,
                                   settle_later)
        if sums is None:
            sums = self.arena.write_hashed(offsets, segments)
        if sums is None:   # no kvstore_native: memmove, and the node hashes the slots at commit
            write = self.arena.write
            for offset, page in zip(offsets, segments):
                write(offset, page)
        self._check_same_node()
        return sums

    def get(self, lease_id: int, token: bytes, pages: Pages, page_bytes: int) -> list[int]:
        offsets, segments = offsets_and_segments(pages)
        sums = self._assisted.move(True, lease_id, token, indices_of(pages), offsets, segments, page_bytes)
        if sums is None:
            sums = self.arena.read_pages_hashed(offsets, segments)
        self._check_same_node()
        return sums

    def waits_on_node(self, pages: Pages, page_bytes: int) -> bool:
        """Whether a put or get of `pages` is copied with the node, and so waits for its answer (assisted_copy.py)."""
        return self._assisted.shares(pages, page_bytes)

    def alive(self) -> bool:
        return self._channel.alive()

    def close(self) -> None:
        self.arena.close()

    def _check_same_node(self) -> None:
        """The offsets just used were answered before this check; if the node that mapped this arena
        had stopped by then (its socket is closed), they may be a restarted node's, and the bytes
        copied belong to neither: the call fails before anything is committed or returned."""
        if not self._channel.alive():
            raise errors.Unavailable("the node's shm socket closed during the copy (the node stopped or the "
                                     "channel failed): the arena mapping is stale and nothing copied counts")
