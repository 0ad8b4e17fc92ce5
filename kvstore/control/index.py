"""The prefix-closed page index.

Every page record knows its parent, and a page is only kept while its parent is kept:
eviction takes leaves only (least recently used first, like a radix tree's), and delete
takes a page with everything that extends it. So "how many leading pages of this chain
are cached" is one pass that stops at the first miss, and no byte is spent on a page
that could never be reached.

Not thread-safe: the service's lock guards every call.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator

PageId = tuple[int, bytes]  # (namespace_id, key)


class PageRecord:
    __slots__ = ("page_id", "parent", "children", "offset", "slot_bytes", "checksum",
                 "pins", "hits", "tick", "alive")

    def __init__(self, page_id: PageId, parent: "PageRecord | None", offset: int, slot_bytes: int, checksum: int):
        self.page_id = page_id
        self.parent = parent
        self.children: set[PageRecord] | None = None
        self.offset = offset
        self.slot_bytes = slot_bytes
        self.checksum = checksum
        self.pins = 0          # leases holding this page; a pinned page is never evicted
        self.hits = 0
        self.tick = 0          # logical time of the last access
        self.alive = True      # False once removed from the index

    def is_leaf(self) -> bool:
        return not self.children


class PageIndex:
    def __init__(self, on_free: Callable[[PageRecord], None]):
        self._pages: dict[PageId, PageRecord] = {}
        # Per slot size: heap of (tick, seq, record) over leaves. Entries go stale when the
        # record is touched again, gains a child or leaves the index; they are skipped.
        self._leaves: dict[int, list[tuple[int, int, PageRecord]]] = {}
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._on_free = on_free          # called when a removed page's slot may be reused
        self.pages_by_namespace: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page_id: PageId) -> bool:
        return page_id in self._pages

    def get(self, page_id: PageId) -> PageRecord | None:
        return self._pages.get(page_id)

    def insert(self, page_id: PageId, parent: PageRecord | None, offset: int, slot_bytes: int,
               checksum: int) -> PageRecord:
        record = self.add(page_id, parent, offset, slot_bytes, checksum)
        self.touch(record)
        return record

    def add(self, page_id: PageId, parent: PageRecord | None, offset: int, slot_bytes: int,
            checksum: int) -> PageRecord:
        """Insert without an access tick; the caller touches the new pages (see touch_all)."""
        assert page_id not in self._pages, "a committed page is immutable"
        assert parent is None or parent.alive, "the index stays prefix-closed"
        record = PageRecord(page_id, parent, offset, slot_bytes, checksum)
        if parent is not None:
            if parent.children is None:
                parent.children = set()
            parent.children.add(record)
        self._pages[page_id] = record
        self.pages_by_namespace[page_id[0]] = self.pages_by_namespace.get(page_id[0], 0) + 1
        return record

    def touch(self, record: PageRecord) -> None:
        record.tick = next(self._clock)
        if record.is_leaf():
            self._push_leaf(record)

    def leading(self, namespace_id: int, keys: list[bytes]) -> list[PageRecord]:
        """Records of the leading keys present, stopping at the first miss. Touches nothing."""
        pages = self._pages
        records = []
        for key in keys:
            record = pages.get((namespace_id, key))
            if record is None:
                break
            records.append(record)
        return records

    def roots(self, namespace_id: int) -> list[PageRecord]:
        """Pages of a namespace that have no parent (removing their subtrees empties it)."""
        return [r for (ns, _), r in self._pages.items() if ns == namespace_id and r.parent is None]

    def touch_all(self, records: list[PageRecord]) -> None:
        """One access tick for pages written or read together; only leaves enter the LRU."""
        tick = next(self._clock)
        for record in records:
            record.tick = tick
            if not record.children and record.pins == 0:
                self._push_leaf(record)

    def pin(self, record: PageRecord) -> None:
        record.pins += 1

    def pin_all(self, records: list[PageRecord], hit: bool) -> None:
        """Pin pages read together; they share one access tick (hot path of Acquire)."""
        tick = next(self._clock)
        for record in records:
            record.pins += 1
            record.hits += hit
            record.tick = tick

    def unpin_all(self, records: list[PageRecord]) -> None:
        for record in records:
            record.pins -= 1
            if record.pins == 0:
                self._unpinned(record)

    def _unpinned(self, record: PageRecord) -> None:
        """The last lease on a page ended: free it if it was removed, else it may be evicted."""
        assert record.pins == 0, "a page still pinned"
        if not record.alive:
            self._on_free(record)
        elif record.is_leaf():
            self._push_leaf(record)

    def evict_leaf(self, slot_bytes: int) -> PageRecord | None:
        """Remove the least recently used unpinned leaf of this slot size, if any."""
        heap = self._leaves.get(slot_bytes)
        while heap:
            tick, _, record = heapq.heappop(heap)
            if record.alive and record.tick == tick and record.is_leaf() and record.pins == 0:
                self._remove(record)
                return record
        return None

    def oldest_leaf_slot_bytes(self) -> int | None:
        """The slot size whose LRU leaf is oldest across sizes (to free a whole slab)."""
        best: tuple[int, int] | None = None
        for slot_bytes, heap in self._leaves.items():
            while heap and not self._valid(heap[0]):
                heapq.heappop(heap)
            if heap and (best is None or heap[0][0] < best[0]):
                best = (heap[0][0], slot_bytes)
        return best[1] if best else None

    def remove_subtree(self, record: PageRecord) -> int:
        """Remove a page and every page that extends it; returns pages removed."""
        removed = 0
        for node in list(_post_order(record)):
            self._remove(node)
            removed += 1
        return removed

    def check_prefix_closed(self) -> None:
        """Assert the invariant over the whole index (tests and debugging)."""
        for record in self._pages.values():
            assert record.alive
            if record.parent is not None:
                assert record.parent.alive and self._pages.get(record.parent.page_id) is record.parent
                assert record in record.parent.children

    def _remove(self, record: PageRecord) -> None:
        assert record.is_leaf(), "only leaves leave the index"
        del self._pages[record.page_id]
        self.pages_by_namespace[record.page_id[0]] -= 1
        record.alive = False
        parent = record.parent
        if parent is not None:
            parent.children.discard(record)
            if not parent.children and parent.pins == 0:
                self._push_leaf(parent)
        if record.pins == 0:
            self._on_free(record)

    def _push_leaf(self, record: PageRecord) -> None:
        heap = self._leaves.setdefault(record.slot_bytes, [])
        heapq.heappush(heap, (record.tick, next(self._seq), record))
        if len(heap) > 64 and len(heap) > 4 * len(self._pages):
            heap[:] = [entry for entry in heap if self._valid(entry)]
            heapq.heapify(heap)

    @staticmethod
    def _valid(entry: tuple[int, int, PageRecord]) -> bool:
        tick, _, record = entry
        return record.alive and record.tick == tick and record.is_leaf() and record.pins == 0


def _post_order(record: PageRecord) -> Iterator[PageRecord]:
    """Descendants before ancestors, without recursion (chains can be thousands of pages)."""
    stack: list[tuple[PageRecord, bool]] = [(record, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded or not node.children:
            yield node
        else:
            stack.append((node, True))
            stack.extend((child, False) for child in node.children)
