"""The HBM tier's state: which pages have a copy in the node's GPU pool (tiers/hbm.py), and where.

A copy tier above DRAM and NVMe, so that every other rule of the store stays as it is:
- A page has an HBM copy only while it is in the index (in DRAM or on NVMe). HBM never holds a page's
  only copy: losing the pool (a kill, a GPU reset) loses nothing, and moving a page in or out never
  touches DRAM or NVMe. A copy holds no pin: DRAM eviction, write-down and quotas go on as on a node
  without a pool (a page evicted from DRAM keeps its copy while it is on NVMe). The price is capacity:
  the pool adds no pages to what the node holds.
- The copies are prefix-closed: a page has one only while its parent has one (or it has no parent), so
  the HBM pages of a chain are its first pages. Copies leave leaf-first (a copy none of whose children
  has one), least recently read first, and never while a lease pins the page: a lease pins what it
  answers, so a copy an engine may be reading is never dropped or its slot reused. Roots anchored at an
  absent parent are not copied (a parent committed later adopts them, and the copies would no longer be
  closed).
- A copy is answered (AcquireResponse.hbm_offsets, Lookup's tiers) only once its bytes, taken into a
  buffer of the node's own and checked against the commit checksum there, are in the pool, and only
  to a lease still open in the same lock section.
- A page that leaves the index is answered by nobody from then on (`alive` is False); the mover's
  sweep frees its pool slot once no lease pins it.
- Pages of several sizes share the pool's slabs as they share the arena's: room is made from a leaf copy
  of the same slot size, else by emptying one slab all of whose copies are leaves no lease pins (least
  recently read first), else the copy is refused; never by dropping copies that would free nothing.

The mover (hbm_mover.py) decides what comes in and copies the bytes, outside the lock; these methods
are the bookkeeping, under it, each bounded by the pages it is given or SCAN_POSITIONS. A part of
PageStore (store.py), which owns the lock.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from kvstore.control.index import PageRecord
from kvstore.control.leases import Lease
from kvstore.control.store_types import SCAN_POSITIONS
from kvstore.tiers.dram import SlabAllocator
from kvstore_client.proto import pb


@dataclasses.dataclass
class HbmCounters:
    promotions: int = 0        # copies made
    promoted_bytes: int = 0
    demotions: int = 0         # copies dropped for room or after their page left the index
    hits: int = 0              # pages answered with an HBM offset
    refused: int = 0           # copies not made: no room (every leaf copy leased, or of other sizes)
    discarded: int = 0         # copies made but not published (bytes did not match, the page or its parent left)


class HbmCopies:
    """The pool's slots and the copies in them."""

    def _init_hbm(self, pool_bytes: int, slab_bytes: int) -> None:
        self.hbm_allocator = SlabAllocator(pool_bytes, slab_bytes) if pool_bytes else None
        # Each copy's pool offset and the parent it was copied under (a page that left the index no longer
        # names its parent: native_index).
        self._hbm: dict[PageRecord, tuple[int, PageRecord | None]] = {}
        self._hbm_leaves: collections.OrderedDict[PageRecord, None] = collections.OrderedDict()  # least recent first
        self._hbm_moving: dict[PageRecord, tuple[int, PageRecord | None]] = {}   # claimed, bytes not yet in
        # Copies and claims of each page's children: a page with any is not a leaf of the pool.
        self._hbm_children: collections.Counter[PageRecord] = collections.Counter()
        self._hbm_per_namespace: collections.Counter[int] = collections.Counter()
        self.hbm_counters = HbmCounters()

    # -- the mover's steps ------------------------------------------------------------------------

    def hbm_claim(self, records: list[PageRecord]) -> list[tuple[PageRecord, int]]:
        """Pool slots for the copies these pages (chains, parents first, with the missing ancestors of the
        first) may have: pages in DRAM whose parent has a copy or is claimed before them here. Each is pinned
        while its bytes are copied. Returns (record, pool offset) in order."""
        claimed: list[tuple[PageRecord, int]] = []
        with self._lock:
            if self.hbm_allocator is None:
                return claimed
            try:
                for record in dict.fromkeys(self._hbm_ancestors(records) + records):
                    parent = record.parent
                    if (not record.alive or not record.in_dram or record in self._hbm or record in self._hbm_moving
                            or (parent is None and record.anchor)
                            or not (parent is None or parent in self._hbm or parent in self._hbm_moving)):
                        continue
                    if parent is not None:   # no leaf while its child is claimed: room is never made from it
                        self._hbm_count_child(parent, 1)
                    offset = self._hbm_room(record.slot_bytes)
                    if offset is None:
                        if parent is not None:
                            self._hbm_count_child(parent, -1)
                        self.hbm_counters.refused += 1
                        continue       # its children cannot follow it; other chains may
                    self.index.pin_all([record], hit=False)   # its DRAM slot stays while it is copied
                    self._hbm_moving[record] = (offset, parent)
                    claimed.append((record, offset))
            except BaseException:
                self._hbm_settle([(record, offset, False) for record, offset in claimed])
                raise
        return claimed

    def hbm_source(self, record: PageRecord) -> memoryview:
        """The DRAM slot a claimed page is copied from (pinned: never reused while claimed)."""
        return self.slot_view(record, record.offset)

    def hbm_finish(self, done: list[tuple[PageRecord, int, bool]]) -> int:
        """Publish the copies whose bytes are in the pool (ok), in claim order; a copy whose parent's was not
        published, or whose page left meanwhile, is dropped. Returns copies published."""
        with self._lock:
            return self._hbm_settle(done)

    def hbm_sweep(self, cursor: int) -> int:
        """Drop the copies of pages that left the index and no lease pins, among SCAN_POSITIONS copies from
        `cursor` on; returns where the next sweep goes on (0: from the start again)."""
        with self._lock:
            window = list(itertools.islice(self._hbm, cursor, cursor + SCAN_POSITIONS))
            for record in window:
                if not record.alive and not record.pins:
                    self._hbm_drop(record)
            return cursor + len(window) if len(window) == SCAN_POSITIONS else 0

    # -- answers ----------------------------------------------------------------------------------

    def hbm_offsets(self, lease: Lease) -> list[int]:
        """Each of an open lease's pages' pool offset, or -1 (read it from the arena); [] when none is in HBM or
        the lease has ended. The lease pins them, so an answered copy stays until it ends."""
        with self._lock:
            if lease.ended or not self._hbm:
                return []
            records = lease.pinned
            offsets = [self._hbm[record][0] if record in self._hbm else -1 for record in records]
            hits = len(offsets) - offsets.count(-1)
            if not hits:
                return []
            for record, offset in zip(records, offsets):
                if offset >= 0 and record in self._hbm_leaves:
                    self._hbm_leaves.move_to_end(record)
            self.hbm_counters.hits += hits
            return offsets

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
        """(copies, pool bytes used, pool bytes) of the HBM tier; copies of pages gone count until swept."""
        with self._lock:
            allocator = self.hbm_allocator
            if allocator is None:
                return 0, 0, 0
            return len(self._hbm), allocator.used_bytes, allocator.capacity_bytes

    def check_hbm(self) -> None:
        """Assert the tier's rules (tests, and the node's self-check): each live copy's page is where it was copied
        (same parent) and its parent has a copy; the child counts, the leaves and the pool's used bytes are what
        the copies and claims make them."""
        with self._lock:
            if self.hbm_allocator is None:
                return
            children: collections.Counter[PageRecord] = collections.Counter()
            for record, (_, parent) in self._hbm.items():
                if record.alive:
                    assert record.parent is parent, f"the page {record.page_id[1].hex()[:16]} moved under its copy"
                    assert parent is None or parent in self._hbm, "HBM copies are not prefix-closed"
            for _, parent in itertools.chain(self._hbm.values(), self._hbm_moving.values()):
                if parent is not None:
                    children[parent] += 1
            assert +self._hbm_children == children, "HBM child counts differ from the copies"
            assert set(self._hbm_leaves) == {r for r in self._hbm if not self._hbm_children[r]}, \
                "the HBM leaves are not the copies without child copies"
            slots = [offset for offset, _ in itertools.chain(self._hbm.values(), self._hbm_moving.values())]
            assert len(set(slots)) == len(slots), "two HBM copies share a slot"
            assert sum(map(self.hbm_allocator.slot_bytes_of, slots)) == self.hbm_allocator.used_bytes, \
                "a pool slot is used by no copy"

    # -- locked helpers ----------------------------------------------------------------------------

    def _hbm_ancestors(self, records: list[PageRecord]) -> list[PageRecord]:
        """The pages above the first of `records` that have no copy (up to SCAN_POSITIONS), root first: a chain
        read from its middle comes in with its head."""
        ancestors: list[PageRecord] = []
        parent = records[0].parent if records else None
        while parent is not None and parent not in self._hbm and len(ancestors) < SCAN_POSITIONS:
            ancestors.append(parent)
            parent = parent.parent
        return ancestors[::-1]

    def _hbm_settle(self, done: list[tuple[PageRecord, int, bool]]) -> int:
        published = 0
        for record, offset, ok in done:
            _, parent = self._hbm_moving.pop(record)
            self.index.unpin_all([record])
            if ok and record.alive and (parent is None or parent in self._hbm):
                self._hbm[record] = (offset, parent)
                if not self._hbm_children[record]:
                    self._hbm_leaves[record] = None
                self._hbm_per_namespace[record.page_id[0]] += 1
                self.hbm_counters.promotions += 1
                self.hbm_counters.promoted_bytes += self.hbm_allocator.slot_bytes_of(offset)
                published += 1
                continue
            self.hbm_allocator.free(offset)
            self.hbm_counters.discarded += 1
            if parent is not None:
                self._hbm_count_child(parent, -1)
        return published

    def _hbm_room(self, slot_bytes: int) -> int | None:
        """A pool slot of this size, dropping leaf copies for room (see the module docstring); None if none."""
        offset = self.hbm_allocator.allocate(slot_bytes)
        while offset is None:
            victim = self._hbm_victim(slot_bytes)
            if victim is not None:
                self._hbm_drop(victim)
            elif not self._hbm_empty_a_slab():
                return None
            offset = self.hbm_allocator.allocate(slot_bytes)
        return offset

    def _hbm_droppable_leaves(self):
        """The least recently read SCAN_POSITIONS leaf copies, less those a lease pins."""
        return (record for record in itertools.islice(self._hbm_leaves, SCAN_POSITIONS) if not record.pins)

    def _hbm_victim(self, slot_bytes: int) -> PageRecord | None:
        return next((record for record in self._hbm_droppable_leaves() if record.slot_bytes == slot_bytes), None)

    def _hbm_empty_a_slab(self) -> bool:
        """Drop every copy of the first slab (by its least recently read leaf) whose copies are all droppable
        leaves, so that its memory can take another slot size; False when no slab is."""
        slab_bytes, by_slab = self.hbm_allocator.slab_bytes, collections.defaultdict(list)
        for record in self._hbm_droppable_leaves():
            offset = self._hbm[record][0]
            by_slab[offset - offset % slab_bytes].append(record)
        for records in by_slab.values():
            if len(records) == self.hbm_allocator.slots_used(self._hbm[records[0]][0]):
                for record in records:
                    self._hbm_drop(record)
                return True
        return False

    def _hbm_count_child(self, parent: PageRecord, delta: int) -> None:
        """A copy or claim of one of `parent`'s children came or went: the parent is a leaf of the pool only
        with none (a new leaf goes first in line: its children, read with it, just left)."""
        count = self._hbm_children[parent] + delta
        assert count >= 0, "an HBM child count went below zero"
        if count:
            self._hbm_children[parent] = count
            self._hbm_leaves.pop(parent, None)
            return
        self._hbm_children.pop(parent, None)
        if parent in self._hbm:
            self._hbm_leaves[parent] = None
            self._hbm_leaves.move_to_end(parent, last=False)

    def _hbm_drop(self, record: PageRecord) -> None:
        offset, parent = self._hbm.pop(record)
        self._hbm_leaves.pop(record, None)
        if parent is not None:
            self._hbm_count_child(parent, -1)
        ns_id = record.page_id[0]
        self._hbm_per_namespace[ns_id] -= 1
        if not self._hbm_per_namespace[ns_id]:
            del self._hbm_per_namespace[ns_id]
        self.hbm_allocator.free(offset)
        self.hbm_counters.demotions += 1
