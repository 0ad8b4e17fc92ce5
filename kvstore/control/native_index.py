"""The page index in C (native/csrc/page_index.c), with the API and the behaviour of index.PageIndex.

index.PageIndex keeps every page as a Python object with a set of children, a dict entry keyed by a
tuple, and heap tuples. The C index keeps a page in one fixed 96-byte slot of a growable array (key
inline, tree links as slot numbers, flags in bits), a key table of 4-byte slot numbers (and a byte
of each one's hash, so an absent key is found absent without reading page slots, and one of its
distance from home, so a deletion moves no page it must read), and LRU orders of 20-byte entries
that only evictable pages enter (a queue of those offered in order, a heap of the rest): about a
sixth of the Python index's node memory a page (bench/index_memory.py; the measured bytes a page are
in native/README.md, "The page index"). Records are proxies made
on demand (`IndexRecord`), the same object while anyone holds one, so they go into sets and dicts as
PageRecords do.

What differs, and why it does not matter to callers:
- `children` is a new set on each read (the index owns the links); nothing mutates it in place.
- A removed page's `parent` reads None (its parent's slot may be reused once the parent goes too);
  every caller checks `alive` before following a removed page's parent.
- `remove_subtree` returns descendants before ancestors in link order, not set order.
- Records of recovered pages are adopted by key: `add_recovered` takes recovery's PageRecords and
  indexes copies of them (the objects recovery built are dropped after start-up).

`leading(ns, keys, key_bytes=n)` also takes the keys packed in one bytes-like, n bytes each, so a
long lookup is one call without a bytes object per key; `leading_places` answers where each page is,
one byte a page, with no object per page. `add_chain` adds a commit's pages, each the next one's
parent, in one call, and makes no record for them when asked not to; `positions_held` finds which of a Reserve's keys are held, in one call;
`evict_dram_many` takes a run of DRAM victims and hands back their offsets and tenants, with no record
or callback per victim, and `remove_subtree_slots` hands back the slots of the pages a Delete removes (a
1,024-page chain: 1.9 ms with a callback a page, 0.5 ms); `ready_prefix` and `read_all` find and count
the pages an Acquire keeps (a 256-page Acquire spent 70 of its 250 us in those two steps in Python).

Not thread-safe: the page store's lock guards every call.
"""

from __future__ import annotations

from typing import Callable, Iterator

from kvstore.control.index import PageId, PageIndex, PageRecord, TenantUsage


try:
    import kvstore_native
    _NativeIndex = getattr(kvstore_native, "PageIndex", None)
except ImportError:  # pragma: no cover - where native/ is not built
    _NativeIndex = None
    missing_reason = "kvstore_native is not installed"
else:
    missing_reason = "" if _NativeIndex is not None else "kvstore_native has no PageIndex"
if _NativeIndex is not None and not hasattr(_NativeIndex, "ready_prefix"):   # pragma: no cover
    missing_reason = "kvstore_native was built from older sources (its PageIndex has no ready_prefix)"
    _NativeIndex = None


def available() -> bool:
    return _NativeIndex is not None


if _NativeIndex is not None:

    class NativePageIndex(_NativeIndex):
        def __init__(self, on_removed: Callable, on_dram_dropped: Callable,
                     tenant_of: Callable[[int], str] = lambda namespace_id: ""):
            super().__init__(on_removed, on_dram_dropped, tenant_of)

        def insert(self, page_id: PageId, parent, offset: int, slot_bytes: int, checksum: int):
            record = self.add(page_id, parent, offset, slot_bytes, checksum)
            self.touch_all([record])
            return record

        def records(self) -> Iterator:
            return iter(self._all(False))

        def page_ids(self) -> list[PageId]:
            return self._all(True)

        @property
        def usage(self) -> dict[str, TenantUsage]:
            """Each tenant's pages per tier (a snapshot: read it, do not keep it)."""
            usage = {}
            for tenant, dram_pages, nvme_pages, nvme_bytes in self._usage_rows():
                row = usage[tenant] = TenantUsage()
                row.dram_pages, row.nvme_pages, row.nvme_bytes = dram_pages, nvme_pages, nvme_bytes
            return usage

        @property
        def pages_by_namespace(self) -> dict[int, int]:
            """Pages per namespace (a snapshot)."""
            return dict(self._namespace_rows())

        def add_recovered(self, records: list[PageRecord]) -> None:
            """Adopt pages rebuilt from NVMe, already linked and prefix-closed (start-up path)."""
            added: dict[PageId, object] = {}
            for record in _parents_first(records):
                parent = added[record.parent.page_id] if record.parent is not None else None
                added[record.page_id] = self.add(record.page_id, parent, record.offset, record.slot_bytes,
                                                 record.checksum, on_nvme=True, shard=record.shard)
            self._offer_recovered([added[record.page_id] for record in records])


def make_page_index(native: bool, on_removed: Callable, on_dram_dropped: Callable,
                    tenant_of: Callable[[int], str]):
    """The C index when asked for and built; else the Python one (the reference). The server's
    start-up log says which one runs, and why (kvstore.server._log_native_core)."""
    if native and available():
        return NativePageIndex(on_removed, on_dram_dropped, tenant_of)
    return PageIndex(on_removed, on_dram_dropped, tenant_of)


def _parents_first(records: list[PageRecord]) -> list[PageRecord]:
    """The records ordered so that each comes after its parent (they form a forest)."""
    ordered, placed = [], set()
    for record in records:
        chain = []
        node = record
        while node is not None and id(node) not in placed:
            chain.append(node)
            node = node.parent
        for node in reversed(chain):
            placed.add(id(node))
            ordered.append(node)
    return ordered
