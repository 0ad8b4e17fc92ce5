"""The prefix-closed page index over every tier.

Every page record knows its parent, and a page stays in the index only while its parent
does: so "how many leading pages of this chain are cached" is one pass that stops at the
first miss, and no byte is spent on a page that could never be reached. A page lives in
DRAM (an arena slot), on NVMe, or both:
- DRAM eviction takes the least recently used unpinned page that is either also on NVMe
  (only its DRAM copy goes: "clean") or a leaf (it leaves the index). The caller may ask for
  clean pages only, so that write_back never loses a page that is not yet written down.
  A run of victims can be taken in one call (evict_dram_many), which hands the freed slots
  back to the caller instead of calling on_removed/on_dram_dropped for each.
- NVMe eviction takes the least recently used page with no child on NVMe (so what survives
  a restart stays prefix-closed), dropping only its NVMe copy when it is also in DRAM.
- Delete takes a page with everything that extends it.
- Every page belongs to its namespace's tenant. The heaps are kept per tenant, so either
  eviction can also be asked for one tenant's pages only (its quota, quotas.py), in the same
  order and under the same rules; `usage` counts each tenant's pages per tier.

A page may be committed after a parent the index no longer holds, when its writer asked for it
(ReserveRequest.anchor_absent_parent: an engine backs up the pages after its own cache hit, and
this store evicted the page before them). It is then a root *anchored* at the parent key it
names: `anchor` holds that key, and `_anchored` maps the absent parent's page id to the pages
waiting for it. Nothing else is recorded for the absent parent (no record, no bytes). Lookups
are unchanged: from the chain's start they stop at the gap, and from the anchored page on they
count it. When the parent page is committed again, it adopts its anchored pages as children, so
from then on it is evicted only after them (leaf-first). An anchored page that leaves the index
leaves its anchor entry too.

Not thread-safe: the page store's lock guards every call (store.py).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from typing import Callable, Iterator

from kvstore.config import PAGE_HITS_MAX   # a page's hits saturate there, as the C index's 32-bit count does
from kvstore_client.keys import HEX_DIGEST_BYTES, unpack_keys

PageId = tuple[int, bytes]  # (namespace_id, key)
NO_SLOT = -1


class PageRecord:
    __slots__ = ("page_id", "parent", "children", "offset", "slot_bytes", "checksum",
                 "pins", "_hits", "tick", "alive", "on_nvme", "busy", "queued", "anchor", "tenant",
                 "nvme_refused_bytes", "position", "shard")

    def __init__(self, page_id: PageId, parent: "PageRecord | None", offset: int, slot_bytes: int, checksum: int):
        self.page_id = page_id
        self.parent = parent
        self.children: set[PageRecord] | None = None
        self.offset = offset       # DRAM slot, or NO_SLOT
        self.slot_bytes = slot_bytes
        self.checksum = checksum
        self.pins = 0              # leases and moves holding this page; a pinned page is never evicted
        self._hits = 0
        self.tick = 0              # logical time of the last access
        self.alive = True          # False once removed from the index
        self.on_nvme = False
        self.busy = False          # being written down or promoted by the controller
        self.queued = False        # waiting in the controller's write-down queue
        self.anchor = b""          # the absent parent's key this root waits for (see the module docstring)
        self.tenant = ""           # its namespace's tenant (set as the index takes the page)
        self.nvme_refused_bytes = -1  # its tenant's NVMe bytes when that quota last refused it; -1: never
        self.position = -1         # its place in the index's scan order (PageIndex.scan), while it is in it
        self.shard = 0             # the NVMe shard its copy is on (while on_nvme)

    @property
    def hits(self) -> int:
        return self._hits

    @hits.setter
    def hits(self, value: int) -> None:
        self._hits = min(value, PAGE_HITS_MAX)   # `hits += 1` past the bound stays at it

    def is_leaf(self) -> bool:
        return not self.children

    @property
    def in_dram(self) -> bool:
        return self.offset != NO_SLOT


_Entry = tuple[int, int, PageRecord]


class TenantUsage:
    """One tenant's pages in the index, per tier (NVMe bytes counted as slot bytes)."""

    __slots__ = ("dram_pages", "nvme_pages", "nvme_bytes")

    def __init__(self) -> None:
        self.dram_pages = 0
        self.nvme_pages = 0
        self.nvme_bytes = 0


class PageIndex:
    def __init__(self, on_removed: Callable[[PageRecord], None], on_dram_dropped: Callable[[PageRecord], None],
                 tenant_of: Callable[[int], str] = lambda namespace_id: ""):
        self._pages: dict[PageId, PageRecord] = {}
        # Heaps of (tick, seq, record); entries go stale when the record is touched again or
        # changes state, and are skipped when popped. DRAM ones are per (tenant, slot size, clean),
        # NVMe ones per tenant.
        self._dram: dict[tuple[str, int, bool], list[_Entry]] = {}
        self._nvme: dict[tuple[str, int], list[_Entry]] = {}   # (tenant, shard) -> LRU heap
        self._tenant_of = tenant_of
        self.usage: dict[str, TenantUsage] = {}
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._on_removed = on_removed          # a removed, unpinned page: free what it held
        self._on_dram_dropped = on_dram_dropped  # a page's DRAM copy may be reused
        self.pages_by_namespace: dict[int, int] = {}
        self._roots: dict[int, set[PageRecord]] = {}   # pages with no parent, per namespace (Delete all)
        self._anchored: dict[PageId, set[PageRecord]] = {}   # absent parent -> roots anchored at it
        # Every page at a position that stays its own while it is in the index (freed positions are
        # reused, last freed first, as the C index reuses page slots): what scan() walks in bounded steps.
        self._positions: list[PageRecord | None] = []
        self._free_positions: list[int] = []
        self.dram_pages = 0
        self.nvme_pages = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, page_id: PageId) -> bool:
        return page_id in self._pages

    def get(self, page_id: PageId) -> PageRecord | None:
        return self._pages.get(page_id)

    def add(self, page_id: PageId, parent: PageRecord | None, offset: int, slot_bytes: int,
            checksum: int, on_nvme: bool = False, anchor: bytes = b"", shard: int = 0) -> PageRecord:
        """Insert without an access tick; the caller touches the new pages (see touch_all).

        `anchor`: with no parent, the key of the absent parent this page extends."""
        assert page_id not in self._pages, "a committed page is immutable"
        assert parent is None or parent.alive, "the index stays prefix-closed"
        assert not (parent is not None and anchor), "a page is anchored only when its parent is absent"
        record = PageRecord(page_id, parent, offset, slot_bytes, checksum)
        record.on_nvme = on_nvme
        record.shard = shard
        record.tenant = self._tenant_of(page_id[0])
        if parent is not None:
            if parent.children is None:
                parent.children = set()
            parent.children.add(record)
        else:
            self._roots.setdefault(page_id[0], set()).add(record)
            if anchor and (page_id[0], anchor) != page_id:
                record.anchor = anchor
                self._anchored.setdefault((page_id[0], anchor), set()).add(record)
        self._pages[page_id] = record
        self._place(record)
        waiting = self._anchored.pop(page_id, None)
        if waiting:
            self._adopt(record, waiting)
        self.pages_by_namespace[page_id[0]] = self.pages_by_namespace.get(page_id[0], 0) + 1
        self.dram_pages += offset != NO_SLOT
        self.nvme_pages += on_nvme
        usage = self._usage(record.tenant)
        usage.dram_pages += offset != NO_SLOT
        usage.nvme_pages += on_nvme
        usage.nvme_bytes += slot_bytes * on_nvme
        return record

    def add_chain(self, namespace_id: int, keys: list[bytes], parent: PageRecord | None, offsets: list[int],
                  slot_bytes: int, checksums: list[int], records: bool = True) -> list[PageRecord] | int:
        """add() of a commit's pages, each the parent of the next (the first's parent is `parent`), touched
        together (one access tick). Returns their records, or with records=False their number (the C
        index then makes no object per page)."""
        added = []
        try:
            for key, offset, checksum in zip(keys, offsets, checksums, strict=True):
                parent = self.add((namespace_id, key), parent, offset, slot_bytes, checksum)
                added.append(parent)
        finally:
            self.touch_all(added)
        return added if records else len(added)

    def insert(self, page_id: PageId, parent: PageRecord | None, offset: int, slot_bytes: int,
               checksum: int) -> PageRecord:
        record = self.add(page_id, parent, offset, slot_bytes, checksum)
        self.touch_all([record])
        return record

    def leading(self, namespace_id: int, keys: list[bytes]) -> list[PageRecord]:
        """Records of the leading keys present in any tier, stopping at the first miss. Touches nothing."""
        # map() keeps the per-key work in C: a 128k-token prompt is 8192 keys (about 3x the plain loop)
        records = list(map(self._pages.get, zip(itertools.repeat(namespace_id), keys)))
        if None in records:
            del records[records.index(None):]
        return records

    def positions_held(self, namespace_id: int, keys: list[bytes]) -> list[int]:
        """The positions of the keys whose pages are held in any tier (all of them, not only leading ones)."""
        held = self._pages
        return [i for i, key in enumerate(keys) if (namespace_id, key) in held]

    def places_each(self, namespace_id: int, keys: list[bytes] | bytes, key_bytes: int = 0,
                    digests: bool = False) -> bytes:
        """Where each key's page is, each key on its own: 0 not held, 1 in DRAM, 2 on NVMe only (one byte a key).
        With key_bytes, `keys` is one buffer of keys that long, back to back; with digests, hex keys' 32 bytes."""
        keys = _key_list(keys, key_bytes, digests)
        pages = self._pages
        places = bytearray(len(keys))
        for i, key in enumerate(keys):
            record = pages.get((namespace_id, key))
            if record is not None:
                places[i] = 1 if record.offset != NO_SLOT else 2
        return bytes(places)

    def leading_places(self, namespace_id: int, keys: list[bytes] | bytes, key_bytes: int = 0,
                       digests: bool = False) -> bytes:
        """Where each page of leading(namespace_id, keys) is, as places_each answers (1 in DRAM, 2 on NVMe
        only). With key_bytes, `keys` is one buffer of keys that long, back to back; with digests, hex keys'
        32 bytes."""
        keys = _key_list(keys, key_bytes, digests)
        return bytes(1 if record.offset != NO_SLOT else 2 for record in self.leading(namespace_id, keys))

    def roots(self, namespace_id: int) -> list[PageRecord]:
        """Pages of a namespace that have no parent (removing their subtrees empties it)."""
        return list(self._roots.get(namespace_id, ()))

    def scan(self, start: int, positions_max: int, namespace_id: int | None = None, keys: bool = False,
             found_max: int = -1) -> tuple[list, int | None]:
        """The pages at positions [start, start + positions_max) (of one namespace, or all), as
        records or (keys=True) their keys, at most `found_max` of them (-1: no limit), and the position
        to go on from (None: the end). A page in the index for the whole of a scan keeps its position,
        so a scan meets it exactly once; one added or removed meanwhile may be met or not. Work is
        bounded by `positions_max`."""
        if start < 0 or positions_max < 0:
            raise ValueError("scan: start and positions_max must not be negative")
        stop = min(start + positions_max, len(self._positions))
        found = []
        for position in range(start, stop):
            if len(found) == found_max:
                stop = position
                break
            record = self._positions[position]
            if record is not None and (namespace_id is None or record.page_id[0] == namespace_id):
                found.append(record.page_id[1] if keys else record)
        return found, (stop if stop < len(self._positions) else None)

    def _place(self, record: PageRecord) -> None:
        if self._free_positions:
            record.position = self._free_positions.pop()
            self._positions[record.position] = record
        else:
            record.position = len(self._positions)
            self._positions.append(record)

    def touch_all(self, records: list[PageRecord]) -> None:
        """One access tick for pages written or read together."""
        tick = next(self._clock)
        for record in records:
            record.tick = tick
            self._offer(record)

    def read_all(self, records: list[PageRecord]) -> None:
        """Pages read together: one hit each (saturating at PAGE_HITS_MAX) and one access tick."""
        for record in records:
            if record._hits < PAGE_HITS_MAX:
                record._hits += 1
        self.touch_all(records)

    @staticmethod
    def ready_prefix(records: list[PageRecord]) -> int:
        """How many leading records are alive and in DRAM (what a read lease keeps)."""
        return sum(1 for _ in itertools.takewhile(lambda r: r.alive and r.offset != NO_SLOT, records))

    def pin(self, record: PageRecord) -> None:
        record.pins += 1

    def pin_all(self, records: list[PageRecord], hit: bool) -> None:
        """Pin pages read together; they share one access tick (hot path of Acquire)."""
        tick = next(self._clock)
        for record in records:
            record.pins += 1
            if hit and record._hits < PAGE_HITS_MAX:
                record._hits += 1
            record.tick = tick

    def unpin_all(self, records: list[PageRecord]) -> None:
        for record in records:
            record.pins -= 1
            if record.pins == 0:
                if not record.alive:
                    self._on_removed(record)
                elif record.on_nvme or not record.children:  # else not evictable: nothing to offer
                    self._offer(record)
            else:
                assert record.pins > 0, "unpin of a page that is not pinned"

    def set_dram(self, record: PageRecord, offset: int) -> None:
        assert not record.in_dram and offset != NO_SLOT
        record.offset = offset
        self.dram_pages += 1
        self._usage(record.tenant).dram_pages += 1
        self._offer(record)

    def set_on_nvme(self, record: PageRecord, on_nvme: bool, shard: int = 0) -> None:
        """The page's copy reached NVMe shard `shard` (or left NVMe)."""
        if record.on_nvme != on_nvme:
            record.on_nvme = on_nvme
            record.shard = shard
            step = 1 if on_nvme else -1
            self.nvme_pages += step
            usage = self._usage(record.tenant)
            usage.nvme_pages += step
            usage.nvme_bytes += step * record.slot_bytes
            self._offer(record)
            if not on_nvme and record.parent is not None and record.parent.alive:
                self._offer(record.parent)   # it may have been its parent's last child on NVMe

    def add_recovered(self, records: list[PageRecord]) -> None:
        """Adopt pages rebuilt from NVMe, already linked and prefix-closed (start-up path)."""
        self._pages.update(zip((record.page_id for record in records), records))
        for record in records:
            self._place(record)
        for ns_id, count in collections.Counter(record.page_id[0] for record in records).items():
            self.pages_by_namespace[ns_id] = self.pages_by_namespace.get(ns_id, 0) + count
        for record in records:
            if record.parent is None:
                self._roots.setdefault(record.page_id[0], set()).add(record)
            record.tenant = self._tenant_of(record.page_id[0])
            usage = self._usage(record.tenant)
            usage.nvme_pages += 1
            usage.nvme_bytes += record.slot_bytes
        self.nvme_pages += len(records)
        # All share tick 0 and get increasing sequence numbers: appended in order, still a heap.
        assert not self._nvme, "recovery runs before anything else reaches the index"
        for seq, record in enumerate(records, next(self._seq)):
            self._nvme.setdefault((record.tenant, record.shard), []).append((0, seq, record))
        self._seq = itertools.count(next(self._seq) + len(records))

    def release_busy(self, record: PageRecord) -> None:
        record.busy = False
        if record.alive:
            self._offer(record)

    def evict_dram(self, slot_bytes: int | None, clean_only: bool, tenant: str | None = None,
                   older_than_unsaved: bool = False) -> PageRecord | None:
        """Free the DRAM slot of the least recently used evictable page of this size (None: any size),
        of this tenant (None: any), if there is one. `clean_only`: of a page also on NVMe; with
        `older_than_unsaved`, only while that page is older than every evictable page held only in
        DRAM (of this size and tenant): else None, and the unsaved pages are written down first."""
        victim = self._evict_oldest(slot_bytes, clean_only, tenant, notify=True, older_than_unsaved=older_than_unsaved)
        return victim[0] if victim else None

    def evict_dram_many(self, slot_bytes: int | None, clean_only: bool, count: int, tenant: str | None = None,
                        until_bytes: int = 0, older_than_unsaved: bool = False) -> tuple[list[int], list[str]]:
        """Up to `count` evict_dram(slot_bytes, clean_only, tenant, older_than_unsaved) in a row, with no
        callback per victim: returns the DRAM offsets the victims held (each now the caller's to free) and
        their tenants, in eviction order. With `until_bytes`, the victim whose slot brings the run's slot
        bytes to that many is the last one taken."""
        offsets: list[int] = []
        tenants: list[str] = []
        freed_bytes = 0
        while len(offsets) < count:
            victim = self._evict_oldest(slot_bytes, clean_only, tenant, notify=False,
                                        older_than_unsaved=older_than_unsaved)
            if victim is None:
                break
            record, offset = victim
            offsets.append(offset)
            tenants.append(record.tenant)
            freed_bytes += record.slot_bytes
            if 0 < until_bytes <= freed_bytes:
                break
        return offsets, tenants

    def _evict_oldest(self, slot_bytes: int | None, clean_only: bool, tenant: str | None,
                      notify: bool, older_than_unsaved: bool = False) -> tuple[PageRecord, int] | None:
        """evict_dram's victim and the DRAM offset it held. Without `notify`, neither on_removed nor
        on_dram_dropped is called: the slot is the caller's to free."""
        entry = self._oldest(slot_bytes, clean_only and not older_than_unsaved, tenant)
        if entry is None or (clean_only and not entry[2].on_nvme):   # the oldest is unsaved: written down first
            return None
        record = entry[2]
        heapq.heappop(self._dram[(record.tenant, record.slot_bytes, record.on_nvme)])
        offset = record.offset
        if record.on_nvme:
            self._drop_dram(record, notify)
        else:
            self._remove(record, notify)
            if not notify:
                record.offset = NO_SLOT
        return record, offset

    def _oldest(self, slot_bytes: int | None, clean_only: bool, tenant: str | None) -> _Entry | None:
        """The oldest evictable entry at the top of the DRAM heaps of this size and tenant (None: all),
        stale tops dropped."""
        best: _Entry | None = None
        for (owner, size, clean), heap in self._dram.items():
            if (clean_only and not clean) or slot_bytes not in (None, size) or tenant not in (None, owner):
                continue
            while heap and not self._dram_evictable(heap[0], clean):
                heapq.heappop(heap)
            if heap and (best is None or heap[0][:2] < best[:2]):
                best = heap[0]
        return best

    def records(self) -> Iterator[PageRecord]:
        return iter(self._pages.values())

    def page_ids(self) -> list[PageId]:
        return list(self._pages)

    def evict_nvme(self, shard: int | None, count: int, tenant: str | None = None) -> list[PageRecord]:
        """Take up to `count` pages off NVMe shard `shard` (None: any shard), of this tenant (None:
        any), least recently used first. Each (tenant, shard) has its own order, so no other shard's
        page is looked at."""
        heaps = [heap for (owner, on), heap in self._nvme.items()
                 if tenant in (None, owner) and shard in (None, on)]
        taken = []
        while len(taken) < count:
            best = _oldest_heap(heaps, self._nvme_evictable)
            if best is None:
                break
            record = heapq.heappop(best)[2]
            self.set_on_nvme(record, False)
            if not record.in_dram:
                self._remove(record)
            taken.append(record)
        return taken

    def dram_only_lru(self, count: int, tenant: str | None = None) -> list[PageRecord]:
        """Up to `count` unpinned pages held only in DRAM, of this tenant (None: any), least recently
        used first (write-back)."""
        # Popped in order from the DRAM-only heaps (O(count log n), not a scan: this runs
        # under the store's lock on every write-back pass), then pushed back, still offered.
        # A page its tenant's NVMe quota refused is passed over until that tenant holds less on
        # NVMe: else the same oldest pages would fill every pass and no other tenant's get written.
        heaps = [heap for (owner, _, clean), heap in self._dram.items() if not clean and tenant in (None, owner)]
        taken: list[tuple[_Entry, list[_Entry]]] = []
        passed: list[tuple[_Entry, list[_Entry]]] = []
        while len(taken) < count:
            best = _oldest_heap(heaps, lambda entry: self._dram_evictable(entry, False))
            if best is None:
                break
            entry = heapq.heappop(best)
            (passed if self._nvme_refused(entry[2]) else taken).append((entry, best))
        for entry, heap in taken + passed:
            heapq.heappush(heap, entry)
        return [entry[2] for entry, _ in taken]

    def _nvme_refused(self, record: PageRecord) -> bool:
        """Its tenant's NVMe quota refused it and the tenant holds no fewer NVMe bytes since."""
        refused_bytes = record.nvme_refused_bytes
        return refused_bytes >= 0 and self._usage(record.tenant).nvme_bytes >= refused_bytes

    def remove_subtree(self, record: PageRecord, limit: int = -1) -> list[PageRecord]:
        """Remove a page and every page that extends it, descendants first, or only the first `limit`
        of them in that order (a prefix of a post-order leaves the rest a tree); returns them."""
        removed = list(_post_order(record) if limit < 0 else itertools.islice(_post_order(record), limit))
        for node in removed:
            self._remove(node)
        return removed

    def remove_subtree_slots(self, record: PageRecord, limit: int = -1) -> tuple[list[PageRecord], list[int]]:
        """remove_subtree with no on_removed: also returns the DRAM offset each removed page gave up, now the
        caller's to free (NO_SLOT where it held none, or a lease still reads it: freed as that lease ends)."""
        removed = list(_post_order(record) if limit < 0 else itertools.islice(_post_order(record), limit))
        slots = []
        for node in removed:
            self._remove(node, notify=False)
            if node.pins:
                slots.append(NO_SLOT)
            else:
                slots.append(node.offset)
                node.offset = NO_SLOT
        return removed, slots

    def check_prefix_closed(self) -> None:
        """Assert the invariant over the whole index (tests and debugging)."""
        for record in self._pages.values():
            assert record.alive and (record.in_dram or record.on_nvme or record.busy)
            if record.parent is not None:
                assert record.parent.alive and self._pages.get(record.parent.page_id) is record.parent
                assert record in record.parent.children
            else:
                assert record in self._roots[record.page_id[0]]
            if record.anchor:
                assert record.parent is None and (record.page_id[0], record.anchor) not in self._pages
                assert record in self._anchored[(record.page_id[0], record.anchor)]
        assert sum(map(len, self._roots.values())) == sum(r.parent is None for r in self._pages.values())
        assert sum(map(len, self._anchored.values())) == sum(bool(r.anchor) for r in self._pages.values())

    def anchored(self, parent_id: PageId) -> set[PageRecord]:
        """Pages waiting for the absent parent `parent_id` (tests and Stats)."""
        return set(self._anchored.get(parent_id, ()))

    def _adopt(self, record: PageRecord, waiting: set[PageRecord]) -> None:
        """The anchored roots in `waiting` become children of `record`, their parent committed again.

        A root that is one of `record`'s own ancestors stays a plain root (keys that name each
        other would make a cycle; honest hash chains never do)."""
        ancestors = set()
        node = record.parent
        while node is not None:
            ancestors.add(node)
            node = node.parent
        roots = self._roots[record.page_id[0]]
        for child in waiting:
            child.anchor = b""
            if child in ancestors:
                continue
            roots.discard(child)
            child.parent = record
            if record.children is None:
                record.children = set()
            record.children.add(child)
        if not roots:
            del self._roots[record.page_id[0]]

    def _remove(self, record: PageRecord, notify: bool = True) -> None:
        """Take a leaf out of the index; with `notify`, an unpinned one goes to on_removed."""
        assert record.is_leaf(), "only leaves leave the index"
        del self._pages[record.page_id]
        self._positions[record.position] = None
        self._free_positions.append(record.position)
        if record.anchor:
            anchor_id = (record.page_id[0], record.anchor)
            waiting = self._anchored[anchor_id]
            waiting.discard(record)
            if not waiting:
                del self._anchored[anchor_id]
        self.pages_by_namespace[record.page_id[0]] -= 1
        if record.parent is None:
            roots = self._roots[record.page_id[0]]
            roots.discard(record)
            if not roots:
                del self._roots[record.page_id[0]]
        self.dram_pages -= record.in_dram
        self.nvme_pages -= record.on_nvme
        usage = self._usage(record.tenant)
        usage.dram_pages -= record.in_dram
        usage.nvme_pages -= record.on_nvme
        usage.nvme_bytes -= record.slot_bytes * record.on_nvme
        record.alive = False
        parent = record.parent
        if parent is not None:
            parent.children.discard(record)
            if not parent.children:
                self._offer(parent)
        if record.pins == 0 and notify:
            self._on_removed(record)

    def _usage(self, tenant: str) -> TenantUsage:
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        return usage

    def _drop_dram(self, record: PageRecord, notify: bool = True) -> None:
        self.dram_pages -= 1
        self._usage(record.tenant).dram_pages -= 1
        if notify:
            self._on_dram_dropped(record)
        record.offset = NO_SLOT

    def _offer(self, record: PageRecord) -> None:
        """Put the page's current state up for eviction; stale heap entries are skipped later.

        Only what is evictable now: a page that becomes so later (its last child leaves, it
        reaches NVMe) is offered again then. This keeps the read path's unpin cheap.
        """
        if record.pins:
            return
        in_dram = record.offset != NO_SLOT and (record.on_nvme or not record.children)
        if not (in_dram or record.on_nvme):
            return
        entry = (record.tick, next(self._seq), record)
        if in_dram:
            clean = record.on_nvme
            heap = self._dram.setdefault((record.tenant, record.slot_bytes, clean), [])
            heapq.heappush(heap, entry)
            if len(heap) > 64 and len(heap) > 4 * len(self._pages):
                heap[:] = [e for e in heap if self._dram_evictable(e, clean)]
                heapq.heapify(heap)
        if record.on_nvme:
            heap = self._nvme.setdefault((record.tenant, record.shard), [])
            heapq.heappush(heap, entry)
            if len(heap) > 64 and len(heap) > 4 * len(self._pages):
                heap[:] = [e for e in heap if self._nvme_evictable(e)]
                heapq.heapify(heap)

    @staticmethod
    def _dram_evictable(entry: _Entry, clean: bool) -> bool:
        tick, _, record = entry
        return (record.alive and record.tick == tick and record.in_dram and record.pins == 0
                and not record.busy and record.on_nvme == clean and (clean or record.is_leaf()))

    @staticmethod
    def _nvme_evictable(entry: _Entry) -> bool:
        tick, _, record = entry
        return (record.alive and record.tick == tick and record.on_nvme and record.pins == 0 and not record.busy
                and not any(child.on_nvme for child in record.children or ())
                and (record.in_dram or record.is_leaf()))


def _oldest_heap(heaps: list[list[_Entry]], evictable: Callable[[_Entry], bool]) -> list[_Entry] | None:
    """The heap whose top is the least recently used evictable entry, dropping stale tops on the way."""
    best: list[_Entry] | None = None
    for heap in heaps:
        while heap and not evictable(heap[0]):
            heapq.heappop(heap)
        if heap and (best is None or heap[0][:2] < best[0][:2]):
            best = heap
    return best


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


def _key_list(keys: list[bytes] | bytes, key_bytes: int, digests: bool = False) -> list[bytes]:
    """`keys` as a list: with key_bytes, one buffer of keys that long, back to back; with digests, each a hex
    key's 32 bytes, listed as its 64 digits (keys.unpack_keys)."""
    if digests and key_bytes != HEX_DIGEST_BYTES:
        raise ValueError(f"digests are {HEX_DIGEST_BYTES} bytes each, not key_bytes={key_bytes}")
    if not key_bytes:
        return keys
    if len(keys) % key_bytes:
        raise ValueError(f"packed keys are {len(keys)} bytes, not a multiple of key_bytes={key_bytes}")
    return unpack_keys(keys, key_bytes, digests)
