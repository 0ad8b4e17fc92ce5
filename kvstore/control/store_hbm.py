"""The HBM tier's state: which pages have a copy in the node's GPU pool (tiers/hbm.py), and where.

A copy tier above DRAM, so that every other rule of the store stays as it is:
- A page in HBM is also in DRAM. Its HBM copy holds a pin on its record, so no eviction takes the
  DRAM slot, and every Acquire answer still has an arena offset for a reader that cannot reach the
  pool. HBM never holds a page's only copy: losing the pool (a kill, a GPU reset) loses nothing,
  and moving a page in or out never touches DRAM or NVMe. The price is capacity (the pool adds no
  pages to what the node holds), which is why config refuses a pool larger than half the arena.
- The pages in HBM are prefix-closed: a page has a copy only while the parent it was copied under
  has one (or it had no parent then), and copies leave leaf-first, least recently read first. So the HBM pages of a chain
  are its first pages, and "how much of this prompt is in HBM" is a walk that stops at the first
  page without a copy.
- A copy is answered (AcquireResponse.hbm_offsets, Lookup's tiers) only once its bytes, taken into
  a buffer of the node's own and checked against the commit checksum there, are in the pool. A copy
  a lease reads is never dropped: only a record whose sole pin is its copy's may leave.
- A page that leaves the index (delete, corruption) while it has a copy is answered by nobody from
  then on (`alive` is False); the mover's sweep drops the copy and its pin, which frees the DRAM slot.

The mover (hbm_mover.py) decides what comes in and copies the bytes, outside the lock; these
methods are the bookkeeping, under it. A part of PageStore (store.py), which owns the lock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from kvstore.control.index import PageRecord
from kvstore.control.store_types import SCAN_POSITIONS
from kvstore.tiers.dram import SlabAllocator
from kvstore_client.proto import pb


@dataclasses.dataclass
class HbmCounters:
    promotions: int = 0        # copies made
    promoted_bytes: int = 0
    demotions: int = 0         # copies dropped for room or after their page left
    hits: int = 0              # pages answered with an HBM offset
    refused: int = 0           # copies not made: the pool was full of pinned or parent copies


class HbmCopies:
    """The pool's slots and the copies in them."""

    def _init_hbm(self, pool_bytes: int, slab_bytes: int) -> None:
        self.hbm_allocator = SlabAllocator(pool_bytes, slab_bytes) if pool_bytes else None
        # Each copy's pool offset and the parent it was copied under, least recently read first. The parent
        # is kept because a page that left the index no longer names it (native_index).
        self._hbm: collections.OrderedDict[PageRecord, tuple[int, PageRecord | None]] = collections.OrderedDict()
        self._hbm_moving: dict[PageRecord, int] = {}              # slots claimed, bytes not yet in
        self._hbm_children: collections.Counter[PageRecord] = collections.Counter()   # copies of each one's children
        self._hbm_per_namespace: collections.Counter[int] = collections.Counter()
        self.hbm_counters = HbmCounters()

    # -- the mover's steps ------------------------------------------------------------------------

    def hbm_claim(self, records: list[PageRecord]) -> list[tuple[PageRecord, int]]:
        """Pool slots for the copies these pages (chains, parents first) may have: pages in DRAM whose
        parent has a copy or is claimed before them here. Each is pinned; room is made by dropping
        least recently read leaf copies no lease reads. Returns (record, pool offset) in order."""
        claimed: list[tuple[PageRecord, int]] = []
        with self._lock:
            if self.hbm_allocator is None:
                return claimed
            coming: set[PageRecord] = set()
            for record in dict.fromkeys(self._hbm_ancestors(records) + records):
                if (not record.alive or not record.in_dram or record in self._hbm or record in self._hbm_moving
                        or not (record.parent is None or record.parent in self._hbm or record.parent in coming)):
                    continue
                offset = self.hbm_allocator.allocate(record.slot_bytes)
                while offset is None and self._hbm_drop_one(record.slot_bytes, keep=coming):
                    offset = self.hbm_allocator.allocate(record.slot_bytes)
                if offset is None:
                    self.hbm_counters.refused += 1
                    break      # its children could not follow it in either
                self.index.pin_all([record], hit=False)
                self._hbm_moving[record] = offset
                coming.add(record)
                claimed.append((record, offset))
        return claimed

    def _hbm_ancestors(self, records: list[PageRecord]) -> list[PageRecord]:
        """The pages above the first of `records` that have no copy (up to SCAN_POSITIONS), root first:
        a chain read from its middle comes in with its head. Locked."""
        ancestors: list[PageRecord] = []
        parent = records[0].parent if records else None
        while parent is not None and parent not in self._hbm and len(ancestors) < SCAN_POSITIONS:
            ancestors.append(parent)
            parent = parent.parent
        return ancestors[::-1]

    def hbm_source(self, record: PageRecord) -> memoryview:
        """The DRAM slot a claimed page is copied from (pinned: never reused while claimed)."""
        return self.slot_view(record, record.offset)

    def hbm_finish(self, done: list[tuple[PageRecord, int, bool]]) -> int:
        """Publish the copies whose bytes are in the pool (ok), in claim order; a copy whose parent's was not
        published, or whose page left meanwhile, is dropped. Returns copies published."""
        published = 0
        with self._lock:
            for record, offset, ok in done:
                del self._hbm_moving[record]
                parent = record.parent
                if ok and record.alive and record.in_dram and (parent is None or parent in self._hbm):
                    self._hbm[record] = (offset, parent)
                    if parent is not None:
                        self._hbm_children[parent] += 1
                    self._hbm_per_namespace[record.page_id[0]] += 1
                    self.hbm_counters.promotions += 1
                    self.hbm_counters.promoted_bytes += self._page_bytes(record)
                    published += 1
                else:
                    self.hbm_allocator.free(offset)
                    self.index.unpin_all([record])
        return published

    def hbm_sweep(self, cursor: int) -> int:
        """Drop the copies of pages that left the index, among SCAN_POSITIONS copies from `cursor` on (newest
        first: children before their parents); returns where the next sweep goes on (0: the newest again)."""
        with self._lock:
            window = list(itertools.islice(reversed(self._hbm), cursor, cursor + SCAN_POSITIONS))
            for record in window:
                if not record.alive and record.pins == 1 and not self._hbm_children[record]:
                    self._hbm_drop(record)
            return cursor + len(window) if len(window) == SCAN_POSITIONS else 0

    # -- answers ----------------------------------------------------------------------------------

    def hbm_offsets(self, records: list[PageRecord]) -> list[int]:
        """Each leased page's pool offset, or -1 (read it from the arena); [] when none is in HBM. The lease
        pins them, so an answered copy is not dropped before the lease ends."""
        with self._lock:
            if not self._hbm:
                return []
            offsets = [self._hbm[record][0] if record.alive and record in self._hbm else -1 for record in records]
            for record, offset in zip(records, offsets):
                if offset >= 0:
                    self._hbm.move_to_end(record)
            hits = len(offsets) - offsets.count(-1)
            self.hbm_counters.hits += hits
            return offsets if hits else []

    def _hbm_leading(self, ns_id: int, keys) -> int:
        """How many leading keys have an HBM copy (prefix-closed: the walk stops at the first without). Locked."""
        if not self._hbm_per_namespace[ns_id]:
            return 0
        get, count = self.index.get, 0
        for key in keys:
            record = get((ns_id, key))
            if record is None or not record.alive or record not in self._hbm:
                break
            count += 1
        return count

    def _hbm_mark_each(self, ns_id: int, keys, tiers: bytes) -> bytes:
        """tiers_each's answer with HBM for each key whose page has a copy. Locked."""
        if not self._hbm_per_namespace[ns_id]:
            return tiers
        marked, get = bytearray(tiers), self.index.get
        for position, key in enumerate(keys):
            if marked[position]:
                record = get((ns_id, key))
                if record is not None and record.alive and record in self._hbm:
                    marked[position] = pb.HBM
        return bytes(marked)

    def hbm_usage(self) -> tuple[int, int, int]:
        """(copies, pool bytes used, pool bytes) of the HBM tier."""
        with self._lock:
            allocator = self.hbm_allocator
            if allocator is None:
                return 0, 0, 0
            return len(self._hbm), allocator.used_bytes, allocator.capacity_bytes

    def check_hbm(self) -> None:
        """Assert the tier's rules (tests, and the node's self-check): each copy's page is in DRAM and pinned,
        its parent has a copy, and the child counts are the copies'."""
        with self._lock:
            children: collections.Counter[PageRecord] = collections.Counter()
            for record, (_, parent) in self._hbm.items():
                assert record.pins >= 1, f"an HBM copy's page {record.page_id[1].hex()[:16]} is not pinned"
                assert not record.alive or record.in_dram, \
                    f"the page {record.page_id[1].hex()[:16]} is in HBM but not in DRAM"
                assert parent is None or parent in self._hbm, "HBM copies are not prefix-closed"
                if parent is not None:
                    children[parent] += 1
            assert +self._hbm_children == children, "HBM child counts differ from the copies"

    # -- dropping copies ---------------------------------------------------------------------------

    def _hbm_drop_one(self, slot_bytes: int, keep: set[PageRecord]) -> bool:
        """Drop the least recently read leaf copy no lease reads, of this slot size if one is among the first
        SCAN_POSITIONS, else of any (its slab may then free). Locked."""
        fallback = None
        for position, record in enumerate(self._hbm):
            if position >= SCAN_POSITIONS:
                break
            if record.pins != 1 or self._hbm_children[record] or record in keep:
                continue
            if record.slot_bytes == slot_bytes:
                self._hbm_drop(record)
                return True
            fallback = fallback or record
        if fallback is not None:
            self._hbm_drop(fallback)
            return True
        return False

    def _hbm_drop(self, record: PageRecord) -> None:
        offset, parent = self._hbm.pop(record)
        if parent is not None:
            self._hbm_children[parent] -= 1
            if not self._hbm_children[parent]:
                del self._hbm_children[parent]
        self._hbm_per_namespace[record.page_id[0]] -= 1
        self.hbm_allocator.free(offset)
        self.hbm_counters.demotions += 1
        self.index.unpin_all([record])
