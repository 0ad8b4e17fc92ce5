"""The page store: the one owner of page state on a node.

It holds the lock and, under it, everything a page's life touches: the DRAM arena and its
slab allocator, the prefix-closed index, namespaces, write and read leases, the pages
being written, and the counters. Every method takes the lock itself and returns with it
released; no caller holds it, so no method needs to know whether it is held.

The store does no disk I/O. Allocation evicts only what it may drop without losing a
page (a DRAM copy of an NVMe page, or any leaf when nothing protects DRAM-only pages);
when that is not enough it reports the shortfall, the controller writes pages down
outside the lock, and the caller asks again. Hashing a committed slot happens outside the
lock too, with the slots marked busy.

Who calls what: the service (RPC rules) and the controller (tier moves) call the store;
the store calls neither. It tells a `StoreListener` (the controller) what happened —
commits, hits, pages wanted from NVMe, DRAM running short — with the lock held, so a
listener only queues work. Where the node publishes its page events (events_out), every step that
changes a page's tiers also tells its StoreEvents journal (store_events.py), under the lock, the
pages it touched: O(pages of that step), into a bounded queue a thread of its own publishes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable

from kvstore.config import Config
from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.control.leases import LeaseTable
from kvstore.control.native_index import make_page_index
from kvstore.control.quotas import SlabShares, TenantLedger
from kvstore.control.store_events import StoreEvents
from kvstore.control.store_exposure import Exposure
from kvstore.control.store_hbm import HbmCopies
from kvstore.control.store_leases import LeaseEnds
from kvstore.control.store_memory import DramSlots
from kvstore.control.store_reads import ReadHolds
from kvstore.control.store_scrub import Scrubbing
from kvstore.control.store_types import (NAMESPACES_MAX, REMOVE_PAGES, SCAN_POSITIONS, SCAN_SECTIONS, Clock,
                                         Counters, Evict, NoListener, PageId, StoreListener, namespace_not_found)
from kvstore.control.store_writedown import WriteDown
from kvstore.control.store_writes import WriteLeases
from kvstore.limits import Limits
from kvstore.tiers.dram import Arena, SlabAllocator, slot_bytes_for
from kvstore_client import errors
from kvstore_client.keys import Namespace, namespace_id, unpack_keys
from kvstore_client.proto import pb

log = logging.getLogger(__name__)

_HBM_BYTE = bytes([pb.HBM])
# index.places_each's and leading_places' bytes (0 not held, 1 DRAM, 2 NVMe only) as Tier values, 0 for not held.
_TIER_OF_PLACE = bytes([0, pb.DRAM, pb.NVME]) + bytes(253)


class PageStore(WriteLeases, ReadHolds, LeaseEnds, WriteDown, DramSlots, Scrubbing, HbmCopies, Exposure):
    """The state and the lock; namespaces, lookups, deletes and Stats here, the rest in its parts:
    store_writes (reserve and commit), store_reads (holds and promotion), store_leases (leases
    ending), store_writedown (the controller's claims), store_memory (DRAM slots and eviction),
    store_scrub (the scrubber's batches), store_hbm (copies in the HBM pool), store_exposure (reads
    the node vouches for). Every part's method takes this lock itself."""

    def __init__(self, config: Config, arena: Arena, clock: Clock = time.monotonic):
        self.config = config
        self.limits = Limits.from_config(config)
        self.arena = arena
        self.clock = clock
        self._lock = threading.Lock()
        self._committed = threading.Condition(self._lock)   # notified whenever pages become visible
        # Acquires waiting for pages not yet committed each hold a worker thread: at most half of them.
        self._commit_waiters_max = max(1, config.server.grpc_workers // 2)
        self._commit_waiters = 0
        self._settled = threading.Condition(self._lock)   # a busy page stopped moving
        assert arena.slab_bytes == config.dram.slab_bytes, "the arena moves slabs of the allocator's size"
        self.allocator = SlabAllocator(arena.nbytes, config.dram.slab_bytes, place=arena.place)
        self.ledger = TenantLedger(config.tenants.quota_table(), config.dram.slab_bytes)
        # Slabs are a tenant's own only with its own memfd; sharing one, tenants share slabs too.
        self.shares = SlabShares(config.tenants.quota_table() if arena.tenants_apart else {},
                                 config.dram.slab_bytes, arena.nbytes // config.dram.slab_bytes)
        self.index = make_page_index(config.server.native_index, on_removed=self._on_removed,
                                     on_dram_dropped=self._free_dram,
                                     tenant_of=lambda ns_id: self.namespaces[ns_id].tenant)
        self.leases = LeaseTable(config.leases.per_tenant_max)
        self.namespaces: dict[int, Namespace] = {}
        self._namespace_used: dict[int, float] = {}        # last use, for reclaiming idle ones
        # Reserved, uncommitted pages: namespace -> key -> lease id. A dict per namespace, so that a
        # Reserve's keys are checked and claimed with set operations rather than a step per key.
        self._pending: dict[int, dict[bytes, int]] = {}
        # Pages whose NVMe copy is being deleted (outside the lock): not written down meanwhile,
        # or the delete could erase the fresh copy. A count per id: deletes may overlap.
        self._nvme_deleting: dict[PageId, int] = {}
        self._nvme_admitted: set[PageRecord] = set()       # write-downs counted in ledger.nvme_writing_bytes
        # Where claim_unsaved's walks up long unsaved chains stopped, the point nearest a chain's saved end last.
        self._unsaved_walk: list[PageRecord] = []
        # Slots of write leases that ended while their writer may still be copying into them through
        # shared memory (see _fence): lease id -> (owner, offsets). Never reused until the owner says
        # its copies are over (its Abort of the lease) or its connection closes.
        self._fenced: dict[int, tuple[object, list[int]]] = {}
        self.counters = Counters()
        self._promoting = 0   # slots claimed for promotion whose NVMe reads are not finished
        self.listener: StoreListener = NoListener()
        # Page events for routers (events_out); None: not published, and no step costs anything for them.
        self.events: StoreEvents | None = None
        self.protect_unsaved = False   # write_back: DRAM-only pages are evicted only once written down
        self.draining = False
        self._init_hbm(config.hbm.pool_bytes, config.dram.slab_bytes)
        self._init_exposure(all_exposed=config.rdma.enabled)   # peers write into the registered arena

    @property
    def evict_first(self) -> Evict:
        """What allocation may drop before any page is written down for room (write_back: clean pages older than
        every unsaved one; once some are written down, Evict.CLEAN)."""
        return Evict.COLD if self.protect_unsaved else Evict.ANY

    def open_namespace(self, namespace: Namespace) -> int:
        ns_id = namespace_id(namespace)
        with self._lock:
            self._namespace_used[ns_id] = self.clock()
            if ns_id in self.namespaces:
                return ns_id
            limits, tenant = self.config.limits, namespace.tenant
            same_tenant = [i for i, ns in self.namespaces.items() if ns.tenant == tenant]
            if len(same_tenant) >= limits.namespaces_per_tenant_max and not self._reclaim_idle(same_tenant):
                raise errors.CapacityExhausted(
                    f"tenant {tenant!r} already holds {limits.namespaces_per_tenant_max} namespaces with pages or "
                    "leases (limits.namespaces_per_tenant_max): clear unused ones or raise the limit")
            # The node-wide cap binds a tenant only past its floor: other tenants filling it lock nobody out.
            if (len(same_tenant) >= limits.namespaces_per_tenant_floor and len(self.namespaces) >= NAMESPACES_MAX
                    and not self._reclaim_idle(list(self.namespaces))):
                raise errors.CapacityExhausted(
                    f"this node holds {len(self.namespaces)} namespaces with pages or leases, its most "
                    f"({NAMESPACES_MAX}), and tenant {tenant!r} {len(same_tenant)} of them, past the "
                    f"{limits.namespaces_per_tenant_floor} every tenant may always open "
                    "(limits.namespaces_per_tenant_floor): clear unused ones")
            self.namespaces[ns_id] = namespace
        log.info("namespace opened id=%016x model=%s tenant=%s page_bytes=%d",
                 ns_id, namespace.model, namespace.tenant, namespace.page_bytes)
        return ns_id

    def _reclaim_idle(self, candidates: list[int]) -> bool:
        """Lock held: forget the least recently used namespace with no page, lease or write."""
        busy = {lease.namespace_id for lease in self.leases.all()} | {ns for ns, keys in self._pending.items() if keys}
        idle = [i for i in candidates if i not in busy and not self.index.pages_by_namespace.get(i)]
        if not idle:
            return False
        victim = min(idle, key=lambda i: self._namespace_used.get(i, 0.0))
        del self.namespaces[victim]
        self._namespace_used.pop(victim, None)
        self._pending.pop(victim, None)
        self.index.pages_by_namespace.pop(victim, None)
        log.info("idle namespace reclaimed id=%016x", victim)
        return True

    def namespace(self, ns_id: int) -> Namespace:
        namespace = self.namespaces.get(ns_id)
        if namespace is None:
            raise namespace_not_found(ns_id)
        return namespace

    def lease_namespace(self, lease_id: int) -> int | None:
        """The namespace a lease is in; None for an unknown lease."""
        with self._lock:
            lease = self.leases.get(lease_id)
            return None if lease is None else lease.namespace_id

    def adopt_recovered(self, namespaces: dict[int, Namespace], records: list[PageRecord]) -> None:
        """Start-up: take the namespaces and pages rebuilt from NVMe (before anything is served)."""
        with self._lock:
            self.namespaces.update(namespaces)
            self.index.add_recovered(records)
            self.counters.recovered_pages = len(records)
            if self.events is not None:   # start-up, before anything is served: announced as stored on DISK
                self.events.sync(self.index.records())

    def tiers(self, ns_id: int, keys: list[bytes]) -> list[int]:
        """The tier of each leading page held here (HBM, else DRAM when it is in both, else NVMe)."""
        return list(self.tiers_packed(ns_id, keys))

    def tiers_packed(self, ns_id: int, keys: list[bytes] | bytes, key_bytes: int = 0, digests: bool = False) -> bytes:
        """tiers() as one byte (a Tier) per leading page held; with key_bytes, `keys` is one buffer of keys
        that long, back to back (the C index reads it whole: no object per key); with digests, hex keys'
        32 bytes (LookupRequest.hex_digests)."""
        with self._lock:
            places = self.index.leading_places(ns_id, keys, key_bytes=key_bytes, digests=digests)
            in_hbm = 0
            if self._hbm_per_namespace[ns_id]:   # else no key need be cut out of the buffer
                leading = unpack_keys(keys[:len(places) * key_bytes], key_bytes, digests) if key_bytes \
                    else keys[:len(places)]
                in_hbm = self._hbm_leading(ns_id, leading)
        return _HBM_BYTE * in_hbm + places[in_hbm:].translate(_TIER_OF_PLACE)

    def tiers_each(self, ns_id: int, keys: list[bytes] | bytes, key_bytes: int = 0, digests: bool = False) -> bytes:
        """One byte per key, each key on its own: 0 when its page is not held here, else the tier it is read
        from (a Tier: HBM over DRAM over NVMe). With key_bytes, keys of that length back to back (digests:
        hex keys' 32 bytes)."""
        with self._lock:   # bounded: at most the Lookup's keys, one table probe each, in C
            places = self.index.places_each(ns_id, keys, key_bytes=key_bytes, digests=digests).translate(_TIER_OF_PLACE)
            if self._hbm_per_namespace[ns_id]:
                listed = unpack_keys(keys, key_bytes, digests) if key_bytes else keys
                places = self._hbm_mark_each(ns_id, listed, places)
        return places

    def group_presence(self, ns_ids: list[int], keys: list[bytes]) -> tuple[int, list[list[bool]]]:
        """One snapshot of a page group (groups.py): the leading pages of the first namespace, and whether
        each other namespace holds its page of each of those positions. Under one lock, so a group
        committed together (commit_group) is seen whole or not at all."""
        with self._lock:
            leading = len(self.index.leading(ns_ids[0], keys))
            get = self.index.get
            present = [[get((ns_id, key)) is not None for key in keys[:leading]] for ns_id in ns_ids[1:]]
        return leading, present

    def keys_page(self, ns_id: int, cursor: int, keys_max: int) -> tuple[list[bytes], int | None]:
        """Up to `keys_max` keys of the namespace's pages, from index position `cursor` on, and the
        position to go on from (None: the end). A page held for the whole of a listing is listed once;
        the lock is held for SCAN_POSITIONS positions at a time (see PageIndex.scan)."""
        return self._walk(ns_id, cursor, keys_max, keys=True)

    def pages_page(self, ns_id: int, cursor: int, pages_max: int) -> tuple[list[tuple[bytes, bytes, bool, bool]],
                                                                          int | None, int]:
        """keys_page with each page's parent key and tiers: (key, parent key, in DRAM, on NVMe). The third
        value is, on a walk's first call (cursor 0), the sequence number of the namespace's tenant stream
        from which page events complete this walk (StoreEvents.snapshot_seq), read before the walk begins;
        0 otherwise, or when no events are published."""
        seq = 0
        if cursor == 0 and self.events is not None:
            with self._lock:
                seq = self.events.snapshot_seq(self.namespaces[ns_id].tenant)
        found, cursor = self._walk(ns_id, cursor, pages_max, keys=False, row=_page_row)
        return found, cursor, seq

    def _walk(self, ns_id: int, cursor: int, most: int, keys: bool,
              row: Callable[[PageRecord], Any] | None = None) -> tuple[list, int | None]:
        """Up to `most` of the namespace's pages from index position `cursor` on (their keys, or `row` of
        each record, made under the lock), SCAN_POSITIONS positions a lock section, SCAN_SECTIONS at most."""
        found: list = []
        for _ in range(SCAN_SECTIONS):
            with self._lock:
                items, cursor = self.index.scan(cursor, SCAN_POSITIONS, ns_id, keys=keys, found_max=most - len(found))
                found += items if row is None else map(row, items)
            if cursor is None or len(found) >= most:
                break
        return found, cursor

    def delete(self, ns_id: int, keys: list[bytes] | None) -> tuple[list[PageRecord], list[PageRecord]]:
        """Remove pages (None: every page of the namespace) with everything that extends them: their
        subtrees, and the pages anchored at each key (the key itself held or not). Leaves first, in
        lock sections of REMOVE_PAGES pages: a page stored meanwhile may stay (as with a Delete just
        before that put); a page held throughout is removed.

        Returns (pages removed, those that are or may soon be on disk: on NVMe, or moving now,
        as a write-down in flight may still put them there; wait_settled before deleting them)."""
        removed: list[PageRecord] = []
        on_disk: list[PageRecord] = []
        with self._lock:   # what to remove: a few roots, the keys' own pages, or a scan of the index
            if keys is None:
                scan = self.index.pages_by_namespace.get(ns_id, 0) > REMOVE_PAGES
                todo = [] if scan else self.index.roots(ns_id)
            else:
                scan = False
                todo = [self.index.get((ns_id, k)) for k in keys]
                todo += [r for k in keys for r in self.index.anchored((ns_id, k))]
        cursor: int | None = 0 if scan else None
        while True:   # REMOVE_PAGES pages removed (or SCAN_POSITIONS positions scanned) per lock section
            with self._lock:
                if not todo and cursor is not None:
                    todo, cursor = self.index.scan(cursor, SCAN_POSITIONS, ns_id, found_max=REMOVE_PAGES)
                section = self._remove_subtrees(todo, REMOVE_PAGES)
                self._sync_events(section)
                moving = [r for r in section if r.on_nvme or r.busy]
                self._deleting([r.page_id for r in moving])
            removed += section
            on_disk += moving
            if not todo and cursor is None:
                return removed, on_disk

    def _remove_subtrees(self, todo: list[PageRecord | None], budget: int) -> list[PageRecord]:
        """Remove up to `budget` pages of the subtrees of `todo`, leaves first; a record leaves `todo`
        once its subtree is gone (so the next section goes on where this one stopped)."""
        removed: list[PageRecord] = []
        slots: list[int] = []
        while todo and len(removed) < budget:
            record = todo[-1]
            if record is not None and record.alive:
                records, offsets = self.index.remove_subtree_slots(record, budget - len(removed))
                removed += records
                slots += offsets
            if record is None or not record.alive:
                todo.pop()
        self._free_slots(removed, slots)
        return removed

    def namespace_page_bytes(self, ns_id: int) -> int:
        with self._lock:
            return self.namespaces[ns_id].page_bytes

    def namespace_spec(self, ns_id: int) -> dict:
        with self._lock:
            return dataclasses.asdict(self.namespaces[ns_id])

    def count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self.counters, name, getattr(self.counters, name) + value)

    def snapshot(self, offset: int, count: int) -> tuple[Counters, dict, list[pb.NamespaceStats], int]:
        """Counters, DRAM figures and one page of namespaces (in id order), taken together."""
        with self._lock:
            counters = Counters()
            counters.__dict__.update(self.counters.__dict__)
            dram = {"capacity_bytes": self.allocator.capacity_bytes, "used_bytes": self.allocator.used_bytes,
                    "dram_pages": self.index.dram_pages, "nvme_pages": self.index.nvme_pages,
                    "leases_open": len(self.leases)}
            ids = sorted(self.namespaces)[offset:offset + count]
            namespaces = [
                pb.NamespaceStats(namespace_id=i, model=self.namespaces[i].model, tenant=self.namespaces[i].tenant,
                                  page_bytes=self.namespaces[i].page_bytes,
                                  pages=self.index.pages_by_namespace.get(i, 0), spec=self.namespaces[i].to_proto())
                for i in ids]
            return counters, dram, namespaces, len(self.namespaces)

    def tenant_stats(self, tenant: str | None = None) -> list[pb.TenantStats]:
        """What each tenant holds, its quotas and counters (only `tenant`'s when given), by name."""
        with self._lock:
            ledger, usage = self.ledger, self.index.usage
            names = sorted(ledger.tenants() | set(usage)) if tenant is None else [tenant]
            stats = []
            for name in names:
                held, counters = usage.get(name), ledger.counters.get(name)
                stats.append(pb.TenantStats(
                    tenant=name, dram_bytes=ledger.dram_bytes.get(name, 0),
                    dram_pages=held.dram_pages if held else 0, nvme_bytes=held.nvme_bytes if held else 0,
                    nvme_pages=held.nvme_pages if held else 0, dram_quota_bytes=ledger.dram_limit(name),
                    nvme_quota_bytes=ledger.nvme_limit(name), **dataclasses.asdict(counters) if counters else {}))
            return stats

    def check_invariants(self) -> None:
        """Assert the index and allocator agree (tests, and after recovery)."""
        with self._lock:
            self.index.check_prefix_closed()
            held = sum(r.slot_bytes for r in self.index.records() if r.offset != NO_SLOT)
            leased = sum(slot_bytes_for(self.namespaces[lease.namespace_id].page_bytes) * len(lease.slots)
                         for lease in self.leases.all())
            leased += sum(self.allocator.slot_bytes_of(o) for _, offsets in self._fenced.values() for o in offsets)
            assert held + leased <= self.allocator.used_bytes, "a slot is used twice"
            assert sum(self.ledger.dram_bytes.values()) == self.allocator.used_bytes, "a slot has no tenant"
            for tenant, slabs in self.allocator.slabs_held.items():
                assert slabs <= (self.shares.cap(tenant) or slabs), f"tenant {tenant!r} holds slabs past its quota"
            for record in self.index.records():
                if record.offset != NO_SLOT:
                    holder = self.arena.key(record.tenant)
                    assert self.allocator.tenant_of(record.offset) == holder, "a page sits in another tenant's slab"
                    assert self.arena.holder(record.offset - record.offset % self.arena.slab_bytes) == holder, \
                        "a page's slab is mapped from another tenant's memfd"
        self.check_hbm()

    def _sync_events(self, records: Iterable[PageRecord]) -> None:
        """Tell the page events journal these pages' tiers (lock held); nothing when events are off."""
        if self.events is not None:
            self.events.sync(records)


def _page_row(record: PageRecord) -> tuple[bytes, bytes, bool, bool]:
    """A ListPages row: (key, parent key or the absent parent it is anchored at, in DRAM, on NVMe)."""
    parent = record.parent.page_id[1] if record.parent is not None else (record.anchor or b"")
    return record.page_id[1], parent, record.in_dram, record.on_nvme
