"""What the put/get pipeline (pipeline.py) needs from a data plane, and how each one cuts a put up.

A data path moves whole pages between the caller's buffers and the node's arena, named as
(index, arena offset, segments): `index` is the page's slot in its lease (Commit names pages by
it), the offset says where the slot is, the segments where the caller's bytes are. Reserve,
Commit, Acquire and Release go over the control channel; only "move these bytes" differs:
shared memory copies (shm_transport.py), TCP sends frames (tcp_transport.py), RDMA posts
one-sided reads and writes (rdma_transport.py).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Protocol, Sequence, Union

from kvstore_client.buffers import Segment

Page = tuple[int, int, Sequence[Segment]]   # (index in the lease, arena offset, segments of the caller's buffer)


class PageColumns:
    """Pages to move as three columns (indices in the lease, arena offsets, segments), made by slicing what
    the node answered and the caller's pages, without a tuple per page. Walked, it yields each page's
    (index, offset, segments) as a list of Page does (TCP, RDMA); shared memory hands two columns to one
    native copy."""

    __slots__ = ("indices", "offsets", "segments")

    def __init__(self, indices: Sequence[int], offsets: Sequence[int], segments: Sequence[Sequence[Segment]]):
        self.indices, self.offsets, self.segments = indices, offsets, segments

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[Page]:
        return zip(self.indices, self.offsets, self.segments)


Pages = Union[PageColumns, list[Page]]


def offsets_and_segments(pages: Pages) -> tuple[Sequence[int], Sequence[Sequence[Segment]]]:
    """The arena offsets and the segments of `pages`, as two sequences."""
    if isinstance(pages, PageColumns):
        return pages.offsets, pages.segments
    return [offset for _, offset, _ in pages], [segments for _, _, segments in pages]


def indices_of(pages: Pages) -> Sequence[int]:
    """The lease index of each of `pages`."""
    if isinstance(pages, PageColumns):
        return pages.indices
    return [index for index, _, _ in pages]


# A get's Acquires: one more is one more message each way, so a batch is cut in few parts.
ACQUIRE_PARTS = 4


@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """How a put is cut up on one data path: the pages of one Reserve, and of one Commit.

    While one group's pages move, the next group's Reserve is in flight; while one run moves, the
    server checksums the run committed before it. Tuned per data path (see each one's SHAPE).
    """

    reserve_group_pages_min: int    # a Reserve asks for at least this many pages ...
    reserve_group_bytes: int        # ... or as many as fit in this many bytes, if more
    commit_run_bytes: int           # a Commit covers as many pages as fit in this (at least one)
    # ... but at most this many (0: no cap): the first Reserve of a put is waited for before any page moves.
    reserve_group_pages_max: int = 0
    # A get is acquired in up to ACQUIRE_PARTS parts of at least this many pages, all sent at once, so
    # the node pins one part while the one before it is copied; 0: one Acquire for the whole batch.
    acquire_part_pages_min: int = 0
    # The first Reserve of a put asks for at most this many bytes (at least one page; 0: a whole
    # group). Nothing overlaps it, and where copying a page takes far longer than reserving one, the
    # next group is reserved while these few pages move.
    first_group_bytes: int = 0
    # A put's first Reserve, and each Commit, covers at most this many pages (0: no cap): small pages cost the
    # node about as much to reserve and commit as the client to copy, so the two overlap only in short runs.
    small_run_pages: int = 0

    def __post_init__(self) -> None:
        assert self.reserve_group_pages_min >= 1 and self.reserve_group_bytes >= 0 and self.commit_run_bytes > 0
        assert self.acquire_part_pages_min >= 0 and self.first_group_bytes >= 0 and self.small_run_pages >= 0
        assert self.reserve_group_pages_max == 0 or self.reserve_group_pages_max >= self.reserve_group_pages_min

    def group_pages(self, page_bytes: int) -> int:
        pages = max(self.reserve_group_pages_min, self.reserve_group_bytes // page_bytes)
        return min(pages, self.reserve_group_pages_max) if self.reserve_group_pages_max else pages

    def reserve_groups(self, pages: int, page_bytes: int) -> list[tuple[int, int]]:
        """The (start, stop) of each Reserve of a put of `pages`: a short first one (first_group_bytes),
        then group_pages each."""
        group = self.group_pages(page_bytes)
        first = min(group, max(1, self.first_group_bytes // page_bytes)) if self.first_group_bytes else group
        first = min(first, self.small_run_pages or first)
        bounds = [(0, min(first, pages))]
        while bounds[-1][1] < pages:
            start = bounds[-1][1]
            bounds.append((start, min(start + group, pages)))
        return bounds

    def run_pages(self, page_bytes: int) -> int:
        pages = max(1, self.commit_run_bytes // page_bytes)
        return min(pages, self.small_run_pages or pages)

    def acquire_part_pages(self, pages: int) -> int:
        """Pages of one Acquire of a get of `pages` (all of them where gets are not cut up)."""
        if not self.acquire_part_pages_min:
            return max(pages, 1)
        return max(self.acquire_part_pages_min, -(-pages // ACQUIRE_PARTS))


# Over a network a message costs a round trip and a page costs its bytes on the wire: groups are
# large so the next Reserve hides behind the transfer, runs large enough that a Commit's round
# trip is small next to moving its run, and small enough that checksumming overlaps the wire.
# (RDMA; TCP, whose node hashes pages as they land, has its own: tcp_transport.SHAPE.)
NETWORK_SHAPE = PipelineShape(reserve_group_pages_min=1, reserve_group_bytes=64 << 20, commit_run_bytes=16 << 20)


class DataPath(Protocol):
    name: str
    rdma_qp_num: int   # RDMA: the node's queue pair, named in Reserve and Acquire; 0 otherwise
    shape: PipelineShape

    def put(self, lease_id: int, token: bytes, pages: Pages, page_bytes: int) -> list[int] | None:
        """Write each page into its reserved slot; raises Unavailable if the node is lost. Returns each
        page's xxh3 where the path computed it from the bytes it copied (its Commit then says so and the
        node reads nothing back), else None."""

    def get(self, lease_id: int, token: bytes, pages: Pages, page_bytes: int) -> list[int | None] | None:
        """Read each pinned page into the caller's segments; raises Unavailable if the node is lost. Returns
        each page's xxh3 as it landed (shared memory hashes while it copies, TCP after the frames arrive),
        which the caller compares with the node's: a client of the tenant could have changed the slot
        through its shared mapping, so every plane refuses a changed page. TCP gives None for a page the
        node vouched for: no other process could have written its slot (tcp_framing.VOUCHED). RDMA returns
        None (no NIC here to measure the cost of a pass over what the NIC wrote; verify=True checks it)."""

    def alive(self) -> bool:
        """False once the path is known broken or its node gone (a cheap check, no round trip)."""

    def close(self) -> None: ...
