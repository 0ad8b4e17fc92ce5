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

import collections
import dataclasses
import enum
import hmac
import itertools
import logging
import threading
import time
from typing import Callable, Iterable, Protocol

import xxhash

from kvstore import failpoints
from kvstore.config import Config
from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.control.native_index import make_page_index
from kvstore.control.leases import READ, WRITE, Lease, LeaseTable
from kvstore.control.quotas import SlabShares, TenantLedger
from kvstore.control.store_events import StoreEvents
from kvstore.limits import Limits
from kvstore.tiers.dram import SLOT_ALIGN, Arena, SlabAllocator, slot_bytes_for
from kvstore_client import errors
from kvstore_client.keys import Namespace, namespace_id
from kvstore_client.proto import pb

log = logging.getLogger(__name__)

_DRAM_BYTE = bytes([pb.DRAM])

# Namespaces over all tenants; beyond it (and a tenant's own limit) idle ones are reclaimed, and a
# tenant past limits.namespaces_per_tenant_floor is refused: at most this plus each tenant's floor.
NAMESPACES_MAX = 4096
# Work under the lock for whole-index walks (ListKeys, the scrubber, Delete of a namespace): index
# positions scanned, or pages removed, per lock section; a call takes at most SCAN_SECTIONS of them.
SCAN_POSITIONS = 16384
SCAN_SECTIONS = 16
Clock = Callable[[], float]
PageId = tuple[int, bytes]


def namespace_not_found(ns_id: int) -> errors.KVStoreError:
    """The one answer for a namespace id a caller may not use: never opened, or another tenant's."""
    return errors.NamespaceNotFound(
        f"namespace {ns_id:#018x} is not open on this server; call OpenNamespace with its spec first")


def lease_not_found(lease_id: int) -> errors.KVStoreError:
    """The one answer for a lease a caller may not use: unknown, ended, or another tenant's."""
    return errors.LeaseNotFound(f"lease {lease_id:#x} is unknown, already finished, or expired")


class Evict(enum.Enum):
    """What allocation may drop to free a slot."""

    CLEAN = "clean"  # only DRAM copies of pages also on NVMe (write_back keeps the rest until written)
    ANY = "any"      # also least recently used leaves held only in DRAM (they leave the cache)


class Counters:
    def __init__(self) -> None:
        self.dram_hits = 0          # pages served from DRAM as they were
        self.nvme_hits = 0          # pages served after promotion from NVMe
        self.misses = 0
        self.evictions = 0          # DRAM copies dropped (pages only in DRAM leave the index)
        self.nvme_evictions = 0
        self.promotions = 0
        self.promoted_bytes = 0
        self.demotions = 0
        self.demoted_bytes = 0
        self.corrupt_pages = 0
        self.leases_expired = 0
        self.pages_committed = 0
        self.checksum_failures = 0
        self.write_queue_drops = 0
        self.nvme_write_errors = 0
        self.recovered_pages = 0
        self.scrub_pages_checked = 0
        self.scrub_pages_bad = 0
        self.scrub_passes = 0
        self.bytes_reserved = 0      # page bytes of slots granted for writing (clients copy into them)
        self.bytes_acquired = 0      # page bytes of pages leased for reading (clients copy out of them)


class StoreListener(Protocol):
    """Told of page events with the store's lock held: queue work, never call the store back."""

    # Whether on_commit is called: a record per committed page costs more than indexing the page.
    wants_commits: bool

    def on_commit(self, records: list[PageRecord]) -> None: ...
    def on_hit(self, records: list[PageRecord]) -> None: ...
    def on_wanted(self, records: list[PageRecord]) -> None: ...
    def on_dram_short(self) -> None: ...


class _NoListener:
    wants_commits = False

    def on_commit(self, records: list[PageRecord]) -> None: pass
    def on_hit(self, records: list[PageRecord]) -> None: pass
    def on_wanted(self, records: list[PageRecord]) -> None: pass
    def on_dram_short(self) -> None: pass


@dataclasses.dataclass(eq=False)
class Reservation:
    """A Reserve in two steps: what the index said, then slots for the pages wanted."""

    lease: Lease | None
    first_index: int
    states: list[int]
    offsets: list[int]
    wanted: list[int]            # positions still to be given a slot
    slot_bytes: int
    extending: bool
    tenant: str = ""
    refusal: str = ""            # why pages past the granted ones got no slot, when a quota is the reason


@dataclasses.dataclass(eq=False)
class Claim:
    """NVMe pages taken for promotion: each has a DRAM slot of its own size, and is busy and pinned."""

    records: list[PageRecord]
    slots: list[int]
    short: int                   # pages that got no slot (DRAM is full of pinned or unsaved pages)


@dataclasses.dataclass(frozen=True)
class CommitPart:
    """One lease of a group commit: as a Commit names it (indices, checksums, whose checksums)."""

    lease_id: int
    indices: list[int]
    checksums: list[int]
    from_writer: bool


class PageStore:
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
        self._unsaved_resume: PageRecord | None = None     # where claim_unsaved's walk up a long chain goes on
        # Slots of write leases that ended while their writer may still be copying into them through
        # shared memory (see _fence): lease id -> (owner, offsets). Never reused until the owner says
        # its copies are over (its Abort of the lease) or its connection closes.
        self._fenced: dict[int, tuple[object, list[int]]] = {}
        self.counters = Counters()
        self._promoting = 0   # slots claimed for promotion whose NVMe reads are not finished
        self.listener: StoreListener = _NoListener()
        # Page events for routers (events_out); None: not published, and no step costs anything for them.
        self.events: StoreEvents | None = None
        self.protect_unsaved = False   # write_back: DRAM-only pages are evicted only once written down
        self.draining = False

    @property
    def evict_first(self) -> Evict:
        """What allocation may drop before any page is written down for room (write_back: clean pages only)."""
        return Evict.CLEAN if self.protect_unsaved else Evict.ANY

    # -- namespaces -------------------------------------------------------------------

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

    # -- lookups ----------------------------------------------------------------------

    def tiers(self, ns_id: int, keys: list[bytes]) -> list[int]:
        """The tier of each leading page held here (DRAM when it is in both)."""
        with self._lock:
            offsets = self.index.leading_offsets(ns_id, keys)
        if NO_SLOT not in offsets:   # the usual answer, without a per-page step
            return [pb.DRAM] * len(offsets)
        return [pb.NVME if offset == NO_SLOT else pb.DRAM for offset in offsets]

    def tiers_packed(self, ns_id: int, keys_packed: bytes, key_bytes: int) -> bytes:
        """tiers() of keys of one length back to back, as one byte (a Tier) per leading page held."""
        with self._lock:   # the C index reads the buffer whole: no object per key
            offsets = self.index.leading_offsets(ns_id, keys_packed, key_bytes=key_bytes)
        if NO_SLOT not in offsets:
            return _DRAM_BYTE * len(offsets)
        return bytes(pb.NVME if offset == NO_SLOT else pb.DRAM for offset in offsets)

    def held_each(self, ns_id: int, keys: list[bytes]) -> bytes:
        """One byte per key, 1 when its page is held here (any tier), each key on its own."""
        with self._lock:
            positions = self.index.positions_held(ns_id, keys)
        held = bytearray(len(keys))
        for position in positions:
            held[position] = 1
        return bytes(held)

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
        found: list[bytes] = []
        for _ in range(SCAN_SECTIONS):
            with self._lock:
                keys, cursor = self.index.scan(cursor, SCAN_POSITIONS, ns_id, keys=True,
                                               found_max=keys_max - len(found))
            found += keys
            if cursor is None or len(found) >= keys_max:
                break
        return found, cursor

    def pages_page(self, ns_id: int, cursor: int, pages_max: int) -> tuple[list[tuple[bytes, bytes, bool, bool]],
                                                                          int | None, int]:
        """keys_page with each page's parent key and tiers: (key, parent key, in DRAM, on NVMe). The third
        value is, on a walk's first call (cursor 0), the sequence number of the namespace's tenant stream
        from which page events complete this walk (StoreEvents.snapshot_seq), read as the walk begins; 0
        otherwise, or when no events are published."""
        found: list[tuple[bytes, bytes, bool, bool]] = []
        seq = 0
        for _ in range(SCAN_SECTIONS):
            with self._lock:
                if cursor == 0 and self.events is not None and not found:
                    seq = self.events.snapshot_seq(self.namespaces[ns_id].tenant)
                records, cursor = self.index.scan(cursor, SCAN_POSITIONS, ns_id, found_max=pages_max - len(found))
                for record in records:
                    parent = record.parent.page_id[1] if record.parent is not None else (record.anchor or b"")
                    found.append((record.page_id[1], parent, record.in_dram, record.on_nvme))
            if cursor is None or len(found) >= pages_max:
                break
        return found, cursor, seq

    # -- writes: reserve, commit, abort -------------------------------------------------

    def reserve(self, ns_id: int, keys: list[bytes], parent_key: bytes, lease_id: int, ttl_ms: int,
                owner: object | None, absent_parent: str = "refuse") -> Reservation:
        """Step one: a write lease, the state of each key, pages of the chain pinned. No slots yet.

        The keys are distinct (checks.keys)."""
        slot_bytes = slot_bytes_for(self.namespaces[ns_id].page_bytes)
        tenant = self.namespaces[ns_id].tenant
        states = [pb.PARENT_MISSING] * len(keys)
        with self._lock:
            if self.draining:
                raise errors.Draining("the server is draining for shutdown and takes no new leases")
            claimed = self._pending.setdefault(ns_id, {})
            if lease_id:
                lease = self._lease(lease_id, WRITE)
                if lease.namespace_id != ns_id:
                    raise errors.InvalidArgument(f"lease {lease_id:#x} belongs to another namespace")
                if parent_key != lease.keys[-1]:
                    raise errors.InvalidArgument(
                        "parent_key of an extending Reserve must be the last key reserved under the lease")
            else:
                parent = self.index.get((ns_id, parent_key)) if parent_key else None
                absent = bool(parent_key) and parent is None and parent_key not in claimed
                if absent and absent_parent != "anchor":
                    return Reservation(None, 0, states, [0] * len(keys), [], slot_bytes, False, tenant)
                lease = self.leases.open(WRITE, ns_id, self.clock(), ttl_ms, owner, tenant)
                lease.anchored = absent   # committed anchored at the absent parent key (index.py)
                lease.parent_key = parent_key
                if parent is not None:
                    self._pin(lease, parent)
            first_index = len(lease.keys)
            lease.keys.extend(keys)
            held = self.index.positions_held(ns_id, keys)
            if not held and claimed.keys().isdisjoint(keys):
                # The usual Reserve: every page new. Claimed now, in this lock section, so no other lease
                # reserves one meanwhile.
                claimed.update(dict.fromkeys(keys, lease.lease_id))
                wanted = list(range(len(keys)))
                states = [pb.NO_SPACE] * len(keys)
            else:
                wanted = self._claim_each(lease, keys, held, claimed, states)
            lease.busy += 1   # not reaped between the two steps
            self._namespace_used[ns_id] = self.clock()
        return Reservation(lease, first_index, states, [0] * len(keys), wanted, slot_bytes, bool(lease_id), tenant)

    def _claim_each(self, lease: Lease, keys: list[bytes], held: list[int], claimed: dict[bytes, int],
                    states: list[int]) -> list[int]:
        """Lock held: reserve()'s states key by key, when some page is held or in flight; the positions wanted."""
        held_positions = set(held)
        wanted = []
        for i, key in enumerate(keys):
            if i in held_positions:
                states[i] = pb.PRESENT
                self._pin(lease, self.index.get((lease.namespace_id, key)))
            elif key in claimed:
                states[i] = pb.IN_FLIGHT
            else:  # claimed now, in this lock section, so no other lease reserves it meanwhile
                wanted.append(i)
                states[i] = pb.NO_SPACE
                claimed[key] = lease.lease_id
        return wanted

    def fill(self, reservation: Reservation, evict: Evict) -> int:
        """Step two: slots for the wanted pages; returns how many are still short of a slot."""
        lease = reservation.lease
        if lease is None or not reservation.wanted:
            return 0
        with self._lock:
            if lease.ended:
                raise errors.LeaseNotFound(f"lease {lease.lease_id:#x} ended while its slots were found")
            wanted = len(reservation.wanted)
            room = self._dram_room(reservation.tenant, reservation.slot_bytes, wanted, evict)
            reservation.refusal = self.ledger.dram_refusal(reservation.tenant) if room < wanted else ""
            granted = self._allocate(reservation.slot_bytes, room, evict, reservation.tenant)
            if len(granted) < room and self._at_slab_cap(reservation.tenant):
                reservation.refusal = self._slab_refusal(reservation.tenant)
            page_bytes = self.namespaces[lease.namespace_id].page_bytes
            first, count = reservation.first_index, len(granted)
            if wanted == len(reservation.states):   # every page wanted: the first `count` get slots
                lease.slots.update(zip(range(first, first + count), granted))
                reservation.states[:count] = [pb.RESERVED] * count
                reservation.offsets[:count] = granted
            else:
                for i, offset in zip(reservation.wanted, granted):
                    lease.slots[first + i] = offset
                    reservation.states[i], reservation.offsets[i] = pb.RESERVED, offset
            self.counters.bytes_reserved += len(granted) * page_bytes
            reservation.wanted = reservation.wanted[len(granted):]
            if reservation.wanted:
                self.listener.on_dram_short()
        if granted:
            failpoints.hit("reserve.after_allocate")
        return len(reservation.wanted)

    def finish_reservation(self, reservation: Reservation) -> None:
        """End step two: a lease that holds nothing is closed; raises when nothing could be placed."""
        lease = reservation.lease
        if lease is None:
            return
        with self._lock:
            lease.busy -= 1
            if reservation.wanted and reservation.refusal:   # counted once, after any second try
                self.ledger.of(reservation.tenant).dram_refused_pages += len(reservation.wanted)
            claimed = self._pending[lease.namespace_id]
            for i in reservation.wanted:   # claimed in step one, given no slot: free for others again
                key = lease.keys[reservation.first_index + i]
                if claimed.get(key) == lease.lease_id:
                    del claimed[key]
            if lease.slots or reservation.extending or lease.ended:
                return
            self._end_lease(lease)
            reservation.lease = None
            if reservation.wanted and reservation.refusal:
                raise errors.CapacityExhausted(reservation.refusal)
            if reservation.wanted:
                raise errors.CapacityExhausted(
                    f"no slot of {reservation.slot_bytes} bytes can be freed: every page is pinned by a lease, "
                    "waiting to be written down, or the arena is full of other page sizes")

    def commit(self, lease_id: int, indices: list[int], checksums: list[int],
               records: bool = False) -> tuple[list[int], list[int], list[PageRecord]]:
        """Hash the slots (unlocked: they belong to this lease alone), check, publish in chain order.

        A slot the node already hashed as its data-plane write landed (end_transfer) is not read again.

        Returns (states, checksums, records of the pages published). The records are made only when
        asked for (a durable commit waits on them); else the list is empty."""
        with self._lock:
            lease = self._lease(lease_id, WRITE)
            indices = self._committable(lease, indices)
            if checksums and len(checksums) != len(indices):
                raise errors.InvalidArgument(
                    f"{len(checksums)} checksums for {len(indices)} pages: give one per page or none")
            page_bytes = self.namespaces[lease.namespace_id].page_bytes
            offsets = [lease.slots[i] for i in indices]
            arrived = [lease.arrived.get(i) for i in indices]
            lease.busy += 1
            lease.committing.update(indices)   # no data-plane write, no other commit, until published
        try:
            view = self.arena.view
            sums = [xxhash.xxh3_64_intdigest(view[o:o + page_bytes]) if known is None else known
                    for o, known in zip(offsets, arrived)]
            failpoints.hit("commit.before_publish")
        except BaseException:
            with self._lock:
                lease.busy -= 1
                lease.committing.difference_update(indices)
            raise
        with self._lock:   # one section from the marks' release to publishing: no write slips in between
            lease.busy -= 1
            lease.committing.difference_update(indices)
            for position, (want, got) in enumerate(zip(checksums, sums)):
                if want != got:
                    self.counters.checksum_failures += 1
                    raise errors.ChecksumMismatch(
                        f"page at index {indices[position]} hashes to {got:#018x}, not {want:#018x}; "
                        "nothing in this commit was made visible: rewrite the slot or abort")
            if self.leases.get(lease.lease_id) is not lease:
                raise errors.LeaseNotFound(f"lease {lease_id:#x} ended while its commit was checked")
            states, published = self._publish(lease, indices, sums, records)
            if not lease.slots:
                self._end_lease(lease)
        failpoints.hit("commit.after_publish")
        return states, sums, published

    def commit_written(self, lease_id: int, indices: list[int], checksums: list[int],
                       records: bool = False) -> tuple[list[int], list[int], list[PageRecord]]:
        """Publish slots whose checksums the lease's writer computed as it copied them in (one pass over
        the bytes: kvstore_native.copy_hash), without reading the slots back. A page is still never
        published without a checksum from its writer or from this node; the scrubber, promotion from
        NVMe and reads with verify check it later, like any page. Returns what commit() returns."""
        failpoints.hit("commit.before_publish")   # the writer hashed the slots; nothing visible yet
        with self._lock:
            lease = self._lease(lease_id, WRITE)
            indices = self._committable(lease, indices)
            if len(checksums) != len(indices):
                raise errors.InvalidArgument(
                    f"{len(checksums)} checksums for {len(indices)} pages: checksums_from_writer needs one per page")
            states, published = self._publish(lease, indices, checksums, records)
            if not lease.slots:
                self._end_lease(lease)
        failpoints.hit("commit.after_publish")
        return states, checksums, published

    def commit_group(self, parts: list[CommitPart]) -> list[tuple[list[int], list[int], list[PageRecord]]]:
        """Publish several write leases (one tenant's; a position's KV page and its sidecar pages, each in
        its own namespace) in one step: every page each part names becomes visible, or none does.

        Every lease, index and checksum is checked, and every page is checked to have its parent in
        the store or earlier in the group, before anything is published; all of it then happens in
        one lock section, so no Lookup, LookupGroup or Acquire sees part of the group. A failed check
        raises naming the lease and leaves every lease as it was (open, its slots uncommitted).
        Slots are hashed outside the lock, as in commit(). Returns commit()'s answer per part (no records)."""
        with self._lock:
            leases = self._group_leases(parts)
            plans = []
            for part, lease in zip(parts, leases):
                indices = self._committable(lease, part.indices)
                if (part.checksums or part.from_writer) and len(part.checksums) != len(indices):
                    raise errors.InvalidArgument(
                        f"{len(part.checksums)} checksums for {len(indices)} pages of lease {lease.lease_id:#x}: "
                        "give one per page" + ("" if part.from_writer else " or none"))
                page_bytes = self.namespaces[lease.namespace_id].page_bytes
                known = list(part.checksums) if part.from_writer else [lease.arrived.get(i) for i in indices]
                plans.append((lease, indices, page_bytes, [lease.slots[i] for i in indices], known))
            for lease, indices, *_ in plans:
                lease.busy += 1
                lease.committing.update(indices)   # no data-plane write, no other commit, until published
        try:
            view = self.arena.view
            sums = [[xxhash.xxh3_64_intdigest(view[o:o + page_bytes]) if k is None else k for o, k in zip(offsets, known)]
                    for _, _, page_bytes, offsets, known in plans]
            failpoints.hit("commit.before_publish")
        except BaseException:
            with self._lock:
                self._unmark(plans)
            raise
        with self._lock:   # one section from the marks' release to publishing every part
            self._unmark(plans)
            for part, (lease, indices, *_), got in zip(parts, plans, sums):
                if part.from_writer:
                    continue
                for position, (want, sum_) in enumerate(zip(part.checksums, got)):
                    if want != sum_:
                        self.counters.checksum_failures += 1
                        raise errors.ChecksumMismatch(
                            f"page at index {indices[position]} of lease {lease.lease_id:#x} hashes to {sum_:#018x}, "
                            f"not {want:#018x}; nothing in this group was made visible: rewrite the slot or abort")
            for lease, *_ in plans:
                if self.leases.get(lease.lease_id) is not lease:
                    raise errors.LeaseNotFound(f"lease {lease.lease_id:#x} of the group ended while its commit was "
                                               "checked; nothing in this group was made visible")
            self._check_publishable([(lease, indices) for lease, indices, *_ in plans])
            results = []
            for (lease, indices, *_), got in zip(plans, sums):
                states, published = self._publish(lease, indices, got, False)
                results.append((states, got, published))
            for lease, *_ in plans:
                if not lease.slots:
                    self._end_lease(lease)
        failpoints.hit("commit.after_publish")
        return results

    def _group_leases(self, parts: list[CommitPart]) -> list[Lease]:
        """Lock held: the write leases of a group commit, each named once, all of one tenant."""
        leases = [self._lease(part.lease_id, WRITE) for part in parts]
        if len({lease.lease_id for lease in leases}) != len(leases):
            raise errors.InvalidArgument("a lease appears twice in the group: name each lease once, with all its "
                                         "indices")
        tenants = {self.namespaces[lease.namespace_id].tenant for lease in leases}
        if len(tenants) > 1:
            raise errors.InvalidArgument(f"a group's leases are of one tenant; these are of {sorted(tenants)}")
        return leases

    def _unmark(self, plans: list[tuple]) -> None:
        for lease, indices, *_ in plans:
            lease.busy -= 1
            lease.committing.difference_update(indices)

    def _check_publishable(self, plans: list[tuple[Lease, list[int]]]) -> None:
        """Lock held: raise GroupIncomplete unless _publish would make every page of the group visible
        (each page's parent is in the store, published earlier in the group, or its anchor)."""
        visible: set[PageId] = set()
        for lease, indices in plans:
            ns_id, keys = lease.namespace_id, lease.keys
            for position in indices:
                parent_key = keys[position - 1] if position else lease.parent_key
                if (parent_key and (ns_id, parent_key) not in visible and self.index.get((ns_id, parent_key)) is None
                        and (position or not lease.anchored)):
                    raise errors.GroupIncomplete(
                        f"page at index {position} of lease {lease.lease_id:#x} has no parent in the store (it was "
                        "deleted, or its writer aborted); nothing in this group was made visible: abort the "
                        "group's leases and put it again")
                visible.add((ns_id, keys[position]))

    def _committable(self, lease: Lease, indices: list[int]) -> list[int]:
        """Lock held: the indices a commit names (none: every uncommitted one), each reserved and idle."""
        indices = indices or sorted(lease.slots)
        if not lease.writing and not lease.committing and all(map(lease.slots.__contains__, indices)):
            return indices   # the usual commit, checked without a step per index
        for index in indices:
            if index not in lease.slots:
                raise errors.InvalidArgument(
                    f"index {index} is not a reserved, uncommitted slot of lease {lease.lease_id:#x}")
            if index in lease.writing:
                raise errors.SlotBusy(f"index {index} of lease {lease.lease_id:#x} is still being written "
                                      "over the data plane: commit it after its transfer is answered")
            if index in lease.committing:
                raise errors.SlotBusy(f"index {index} of lease {lease.lease_id:#x} is already being committed: "
                                      "wait for that Commit's answer")
        return indices

    def _publish(self, lease: Lease, indices: list[int], sums: list[int],
                 records: bool) -> tuple[list[int], list[PageRecord]]:
        """Lock held: make checked pages visible in chain order; a page whose parent is gone is dropped, unless
        it is the first of a lease that named an absent parent to anchor at. Returns (states, the published
        pages' records when `records` is asked for, else [])."""
        ns_id, keys, index = lease.namespace_id, lease.keys, self.index
        slot_bytes = slot_bytes_for(self.namespaces[ns_id].page_bytes)
        first = indices[0] if indices else 0
        parent_key = keys[first - 1] if first else lease.parent_key
        chain_parent = index.get((ns_id, parent_key)) if parent_key else None
        wants_commits = self.listener.wants_commits or self.events is not None
        if indices and indices[-1] - first == len(indices) - 1 and (chain_parent is not None or not parent_key):
            # The usual commit: consecutive pages under a parent held here (or none), one index call,
            # and no object per page unless someone reads them.
            offsets = list(map(lease.slots.pop, indices))
            if lease.arrived:
                for position in indices:
                    lease.arrived.pop(position, None)
            chain_keys = keys[first:first + len(indices)]
            claimed = self._pending[ns_id]
            for key in chain_keys:
                del claimed[key]
            published = index.add_chain(ns_id, chain_keys, chain_parent, offsets, slot_bytes, list(sums),
                                        records=records or wants_commits)
            count = len(indices)
            states = [pb.COMMITTED] * count
        else:
            states, published = self._publish_each(lease, indices, sums, slot_bytes)
            index.touch_all(published)
            count = len(published)
        self.counters.pages_committed += count
        if self.events is not None:
            self.events.sync(published)
        if self.listener.wants_commits:
            self.listener.on_commit(published)
        self._committed.notify_all()
        return states, published if records else []

    def _publish_each(self, lease: Lease, indices: list[int], sums: list[int],
                      slot_bytes: int) -> tuple[list[int], list[PageRecord]]:
        """_publish page by page: a gap in the chain, a parent gone, or an anchored first page."""
        ns_id, keys, index = lease.namespace_id, lease.keys, self.index
        claimed = self._pending[ns_id]
        states, published = [], []
        for position, checksum in zip(indices, sums):
            key = keys[position]
            offset = lease.slots.pop(position)
            lease.arrived.pop(position, None)
            del claimed[key]
            parent_key = keys[position - 1] if position else lease.parent_key
            parent = index.get((ns_id, parent_key)) if parent_key else None
            anchor = b""
            if parent_key and parent is None:
                if position or not lease.anchored:
                    self._free_slot(offset)
                    states.append(pb.COMMIT_PARENT_MISSING)
                    continue
                anchor = parent_key
            published.append(index.add((ns_id, key), parent, offset, slot_bytes, checksum, anchor=anchor))
            states.append(pb.COMMITTED)
        return states, published

    def abort(self, lease_id: int, owner: object | None = None) -> tuple[int, Lease | None]:
        """End a write lease; (its uncommitted pages, the lease). Asked by the owner of a lease that was
        fenced (it expired while the owner could write its slots), frees the fenced slots: the owner
        aborts only once its copies into them have returned. (0, None) then."""
        with self._lock:
            fenced = self._fenced.get(lease_id)
            if fenced is not None and fenced[0] is owner:
                self._unfence(lease_id)
                return 0, None
            lease = self._lease(lease_id, WRITE)
            aborted = len(lease.slots)
            if owner is lease.owner:
                self._end_lease(lease)
            else:
                self._fence(lease)
        return aborted, lease

    # -- reads: acquire, release ---------------------------------------------------------

    def wait_committed(self, ns_id: int, keys: list[bytes], deadline: float) -> None:
        """Block until every key is in the index (in any tier) or time.monotonic() passes `deadline`."""
        with self._committed:
            if self._commit_waiters >= self._commit_waiters_max:
                return                                 # answer with what is committed now
            self._commit_waiters += 1
            try:
                while len(self.index.leading(ns_id, keys)) < len(keys) and not self.draining:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._committed.wait(remaining)
            finally:
                self._commit_waiters -= 1

    def hold_chain(self, ns_id: int, keys: list[bytes], ttl_ms: int, owner: object | None) -> Lease:
        """A read lease pinning every leading page in any tier: none of them is a victim of the
        promotion that may follow (trim_read_lease then keeps only what is in DRAM)."""
        return self.hold_group([(ns_id, keys)], ttl_ms, owner)[0]

    def hold_group(self, parts: list[tuple[int, list[bytes]]], ttl_ms: int, owner: object | None) -> list[Lease]:
        """hold_chain for several namespaces in one lock section: a read lease per part, all pinned at
        once, so no part's page leaves the store between finding one part and pinning the next."""
        with self._lock:
            if self.draining:
                raise errors.Draining("the server is draining for shutdown and takes no new leases")
            tenants = [self.namespace(ns_id).tenant for ns_id, _ in parts]
            for tenant, count in collections.Counter(tenants).items():   # all parts' leases or none
                self.leases.room(tenant, count)
            leases = []
            for (ns_id, keys), tenant in zip(parts, tenants):
                records = self.index.leading(ns_id, keys)
                lease = self.leases.open(READ, ns_id, self.clock(), ttl_ms, owner, tenant)
                self.index.pin_all(records, hit=False)
                lease.pinned = records
                lease.busy += 1   # not reaped while pages are promoted for it
                self._namespace_used[ns_id] = self.clock()
                leases.append(lease)
            return leases

    def drop_held(self, leases: list[Lease]) -> None:
        """End read leases of hold_group that will never be answered (their group's call failed)."""
        with self._lock:
            for lease in leases:
                lease.busy -= 1
                self._end_lease(lease)

    def missing(self, lease: Lease) -> list[PageRecord]:
        """Pages of the lease's chain not in DRAM, in chain order."""
        with self._lock:
            return [r for r in lease.pinned if r.offset == NO_SLOT]

    def want(self, lease: Lease) -> None:
        """Ask for the lease's pages not in DRAM to be promoted in the background."""
        with self._lock:
            wanted = [r for r in lease.pinned if r.offset == NO_SLOT and r.alive]
            if wanted:
                self.listener.on_wanted(wanted)

    def trim_read_lease(self, lease: Lease, keys_asked: int, from_dram: int) -> Lease | None:
        """Keep the leading pages in DRAM under the lease, unpin the rest, count; None if no page."""
        with self._lock:
            lease.busy -= 1
            ready = list(itertools.takewhile(lambda r: r.alive and r.offset != NO_SLOT, lease.pinned))
            self.index.unpin_all(lease.pinned[len(ready):])
            lease.pinned = ready
            from_dram = min(from_dram, len(ready))
            self.counters.dram_hits += from_dram
            self.counters.nvme_hits += len(ready) - from_dram
            self.counters.misses += keys_asked - len(ready)
            if not ready or lease.ended:
                self._end_lease(lease)
                return None
            for record in ready:
                record.hits += 1
            self.index.touch_all(ready)
            self.leases.restart(lease, self.clock())   # its TTL runs from the answer, not from before promotion
            self.listener.on_hit(ready)
            self.counters.bytes_acquired += len(ready) * self.namespaces[lease.namespace_id].page_bytes
            return lease

    def release(self, lease_ids: Iterable[int]) -> int:
        with self._lock:
            leases = [self._lease(lease_id, READ) for lease_id in lease_ids]
            for lease in leases:
                self._end_lease(lease)
        return len(leases)

    # -- delete -------------------------------------------------------------------------

    def delete(self, ns_id: int, keys: list[bytes] | None) -> tuple[list[PageRecord], list[PageRecord]]:
        """Remove pages (None: every page of the namespace) with everything that extends them: their
        subtrees, and the pages anchored at each key (the key itself held or not). Leaves first, in
        lock sections of SCAN_POSITIONS pages: a page stored meanwhile may stay (as with a Delete just
        before that put); a page held throughout is removed.

        Returns (pages removed, those that are or may soon be on disk: on NVMe, or moving now,
        as a write-down in flight may still put them there; wait_settled before deleting them)."""
        removed: list[PageRecord] = []
        on_disk: list[PageRecord] = []
        with self._lock:   # what to remove: a few roots, the keys' own pages, or a scan of the index
            if keys is None:
                scan = self.index.pages_by_namespace.get(ns_id, 0) > SCAN_POSITIONS
                todo = [] if scan else self.index.roots(ns_id)
            else:
                scan = False
                todo = [self.index.get((ns_id, k)) for k in keys]
                todo += [r for k in keys for r in self.index.anchored((ns_id, k))]
        cursor: int | None = 0 if scan else None
        while True:   # SCAN_POSITIONS pages removed (and as many positions scanned) per lock section
            with self._lock:
                if not todo and cursor is not None:
                    todo, cursor = self.index.scan(cursor, SCAN_POSITIONS, ns_id)
                section = self._remove_subtrees(todo, SCAN_POSITIONS)
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
        while todo and len(removed) < budget:
            record = todo[-1]
            if record is not None and record.alive:
                removed += self.index.remove_subtree(record, budget - len(removed))
            if record is None or not record.alive:
                todo.pop()
        return removed

    # -- leases: expiry, connections, draining -----------------------------------------

    def owns_leases(self, owner: object) -> bool:
        """Whether a lease, or fenced slots, ending with this connection are held."""
        with self._lock:
            return self.leases.any_owned_by(owner) or any(held is owner for held, _ in self._fenced.values())

    def end_owner(self, owner: object) -> int:
        """A connection closed: its leases end and its fenced slots are free (its copies are over)."""
        with self._lock:
            leases = self.leases.owned_by(owner)
            for lease in leases:
                self._end_lease(lease)
            for lease_id in [i for i, (held, _) in self._fenced.items() if held is owner]:
                self._unfence(lease_id)
        return len(leases)

    def reap_expired(self) -> list[tuple[Lease, int, int]]:
        """End leases past their deadline; (lease, uncommitted pages, pinned pages) of each."""
        with self._lock:
            expired = [(lease, len(lease.slots), len(lease.pinned)) for lease in self.leases.expired(self.clock())]
            for lease, _, _ in expired:
                self._fence(lease)
            self.counters.leases_expired += len(expired)
        return expired

    def fenced_slots(self) -> int:
        with self._lock:
            return sum(len(offsets) for _, offsets in self._fenced.values())

    def start_draining(self) -> None:
        with self._lock:
            self.draining = True

    def open_leases(self) -> int:
        with self._lock:
            return len(self.leases)

    # -- data plane (see data_plane.py) --------------------------------------------------

    def begin_transfer(self, lease_id: int, token: bytes, kind: str, slot: int, nbytes: int) -> tuple[Lease, int]:
        """Check a frame against its lease; (lease, slot offset), held until end_transfer."""
        with self._lock:
            lease = self.leases.get(lease_id)
            if lease is None or self.clock() > lease.deadline:
                raise lease_not_found(lease_id)
            if not hmac.compare_digest(lease.token, token):
                raise errors.TokenMismatch(f"the token does not match lease {lease_id:#x}")
            if lease.kind != kind:
                verb = "written" if kind == WRITE else "read"
                raise errors.SlotNotInLease(f"lease {lease_id:#x} is a {lease.kind} lease: its slots cannot be {verb}")
            if kind == WRITE:
                offset = lease.slots.get(slot)
                if offset is None:
                    raise errors.SlotNotInLease(f"slot {slot} is not a reserved, uncommitted slot of lease {lease_id:#x}")
                if slot in lease.writing or slot in lease.committing:
                    raise errors.SlotBusy(f"slot {slot} of lease {lease_id:#x} is already being written or committed")
            elif not 0 <= slot < len(lease.pinned):
                raise errors.SlotNotInLease(f"lease {lease_id:#x} pins {len(lease.pinned)} pages; no page {slot}")
            else:
                offset = lease.pinned[slot].offset
            page_bytes = self.namespaces[lease.namespace_id].page_bytes
            if nbytes != page_bytes:
                raise errors.LengthMismatch(f"{nbytes} bytes for a page of {page_bytes}: move whole pages")
            if kind == WRITE:
                lease.writing.add(slot)
                lease.arrived.pop(slot, None)   # the bytes an earlier write's checksum was taken of are going
            lease.transfers += 1
            return lease, offset

    def end_transfer(self, lease: Lease, slot: int, arrived_checksum: int | None = None) -> None:
        """A transfer is over; `arrived_checksum`: the xxh3 this node took of a written slot's bytes once
        all of them had landed, which its Commit records without hashing the slot again."""
        with self._lock:
            self._transfer_ended(lease, slot)
            if arrived_checksum is not None and lease.kind == WRITE and slot in lease.slots:
                lease.arrived[slot] = arrived_checksum

    def cut_transfer(self, lease: Lease, slot: int) -> None:
        """A write stopped part-way: its lease ends, so the torn page is never visible."""
        with self._lock:
            self._transfer_ended(lease, slot)
            if self.leases.get(lease.lease_id) is lease:
                log.info("data-plane write cut mid-page; lease=%016x aborted", lease.lease_id)
                self._end_lease(lease)

    def _transfer_ended(self, lease: Lease, slot: int) -> None:
        lease.transfers -= 1
        assert lease.transfers >= 0, "a transfer ended twice"
        if lease.kind == WRITE:
            lease.writing.discard(slot)
        if lease.ended and not lease.transfers:
            self._free_lease_memory(lease)

    # -- for the controller: write-down ---------------------------------------------------

    def claim_unsaved(self, records: Iterable[PageRecord], pages_max: int) -> list[PageRecord]:
        """Pages to write down with their unsaved ancestors first, pinned and marked busy: at most
        `pages_max`. A page whose unsaved ancestors are more than that is passed over, and the next
        call walks on from the highest one reached, so a long unsaved chain is written from its
        saved end in batches while no call walks more than `pages_max` pages under the lock."""
        batch: list[PageRecord] = []
        seen: set[PageRecord] = set()
        with self._lock:
            resume, self._unsaved_resume = self._unsaved_resume, None
            for record in itertools.chain([resume] if resume is not None else [], records):
                if len(batch) >= pages_max:
                    break
                chain, stopped_at = _unsaved_chain(record, self._nvme_deleting, seen, pages_max - len(batch))
                if stopped_at is not None and self._unsaved_resume is None:
                    self._unsaved_resume = stopped_at
                seen.update(chain)
                batch += chain
            for record in batch:
                record.busy = True
                record.pins += 1
        return batch

    def unsaved_lru(self, count: int, tenant: str | None = None) -> list[PageRecord]:
        """Up to `count` unpinned pages held only in DRAM (of this tenant; None: any), least recently used first."""
        with self._lock:
            return self.index.dram_only_lru(count, tenant)

    def admit_nvme(self, batch: list[PageRecord]) -> tuple[list[PageRecord], list[PageRecord]]:
        """The pages of a claimed write-down batch (chain order) their tenants' NVMe quotas allow, and
        the pages taken off NVMe to make that room: each tenant's own least recently used NVMe pages,
        never one the batch extends (its children would then be written for nothing). The caller
        deletes the victims first; pages refused (and the pages of the batch that extend them) stay in
        DRAM only, unsaved, marked so that write-back passes them over until their tenant holds less
        on NVMe. Returns (admitted, victims)."""
        admitted: list[PageRecord] = []
        victims: list[PageRecord] = []
        with self._lock:
            limited = [r for r in batch if self.ledger.nvme_limit(r.tenant)]
            if not limited:
                return batch, []
            kept = _nvme_ancestors(limited)
            for record in kept:
                record.pins += 1     # not victims of this batch's own room
            writing = self.ledger.nvme_writing_bytes
            refused: set[PageRecord] = set()
            for record in batch:
                tenant = record.tenant
                if self.ledger.nvme_limit(tenant) and (record.parent in refused or not self._nvme_room(
                        tenant, record.slot_bytes, victims)):
                    refused.add(record)
                    usage = self.index.usage.get(tenant)
                    record.nvme_refused_bytes = (usage.nvme_bytes if usage else 0) + writing.get(tenant, 0)
                    self.ledger.of(tenant).nvme_refused_pages += 1
                    continue
                record.nvme_refused_bytes = -1
                if self.ledger.nvme_limit(tenant):
                    writing[tenant] = writing.get(tenant, 0) + record.slot_bytes
                    self._nvme_admitted.add(record)
                admitted.append(record)
            self.index.unpin_all(kept)
            self._sync_events(victims)
            self.counters.nvme_evictions += len(victims)
            for record in victims:
                self.ledger.of(record.tenant).nvme_evictions += 1
            self._deleting([r.page_id for r in victims])
        if victims:
            log.info("NVMe quota: evicted pages=%d", len(victims))
        return admitted, victims

    def dram_fill(self) -> float:
        with self._lock:
            return self.allocator.used_bytes / max(self.allocator.capacity_bytes, 1)

    def finish_writedown(self, batch: list[PageRecord], on_disk: dict[PageRecord, int]) -> tuple[
            list[PageRecord], list[PageId]]:
        """The batch (chain order) is no longer moving; `on_disk` reached NVMe, each on its shard. A page is marked on
        NVMe only when its parent is, so the NVMe tier stays prefix-closed even when another
        shard's write failed. Returns (pages now on NVMe, ids deleted meanwhile: the caller
        deletes those from NVMe too)."""
        garbage, written = [], []
        with self._lock:
            for record in batch:
                if record not in on_disk:
                    continue
                if record.alive and (record.parent is None or record.parent.on_nvme):
                    self.index.set_on_nvme(record, True, on_disk[record])
                    written.append(record)
                else:  # deleted meanwhile, or its parent is not on NVMe: its bytes must not stay there
                    garbage.append(record.page_id)
            self._sync_events(written)
            self.counters.demotions += len(written)
            self.counters.demoted_bytes += sum(self._page_bytes(r) for r in written)
            for record in batch:
                self.index.release_busy(record)
                if record in self._nvme_admitted:
                    self._nvme_admitted.discard(record)
                    self.ledger.nvme_writing_bytes[record.tenant] -= record.slot_bytes
            self.index.unpin_all(batch)
            self._deleting(garbage)
            self._settled.notify_all()
        return written, garbage

    def nvme_deleted(self, page_ids: list[PageId]) -> None:
        """The NVMe deletes of these pages (from delete, eviction or garbage) are done."""
        with self._lock:
            for page_id in page_ids:
                left = self._nvme_deleting[page_id] - 1
                if left:
                    self._nvme_deleting[page_id] = left
                else:
                    del self._nvme_deleting[page_id]

    def leading_on_nvme(self, records: list[PageRecord]) -> tuple[int, bool]:
        """(leading pages of this chain on NVMe, whether the next one can never get there: it left)."""
        with self._lock:
            durable = sum(1 for _ in itertools.takewhile(lambda r: r.alive and r.on_nvme, records))
            return durable, durable < len(records) and not records[durable].alive

    def nvme_victims(self, shard: int, count: int) -> list[PageRecord]:
        """Take up to `count` least recently used pages off one NVMe shard (the caller deletes them)."""
        with self._lock:
            victims = self.index.evict_nvme(shard, count)
            self._sync_events(victims)
            self.counters.nvme_evictions += len(victims)
            for record in victims:
                self.ledger.of(record.tenant).nvme_evictions += 1
            self._deleting([r.page_id for r in victims])
        failpoints.hit("evict.after_victims")
        return victims

    def stored_page(self, record: PageRecord) -> tuple[int, bytes, bytes, int, int, memoryview] | None:
        """(namespace, key, parent key, page bytes, checksum, slot bytes) of a busy page to write down;
        None once it was deleted: it is not written (a removed page's parent may read None, and a
        page stored as a root would come back as one after a restart)."""
        with self._lock:
            assert record.busy and record.offset != NO_SLOT, "only a claimed DRAM page is written down"
            if not record.alive:
                return None
            page_bytes = self._page_bytes(record)
            parent_key = record.parent.page_id[1] if record.parent is not None else b""
            view = self.arena.view[record.offset:record.offset + page_bytes]
            return record.page_id[0], record.page_id[1], parent_key, page_bytes, record.checksum, view

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

    # -- for the controller: promotion -----------------------------------------------------

    def claim_for_promotion(self, records: list[PageRecord], evict: Evict) -> Claim:
        """Slots for NVMe-only pages, in chain order, each of its own size; pinned and busy."""
        with self._lock:
            todo = [r for r in dict.fromkeys(records) if r.alive and r.offset == NO_SLOT and r.on_nvme and not r.busy]
            slots: list[int] = []
            for record in todo:
                room = self._dram_room(record.tenant, record.slot_bytes, 1, evict)
                got = self._allocate(record.slot_bytes, room, evict, record.tenant)
                if not got:
                    if not room or self._at_slab_cap(record.tenant):   # the tenant's quota, not the node, is short
                        self.ledger.of(record.tenant).dram_refused_pages += 1
                    break
                slots += got
            short = len(todo) - len(slots)
            todo = todo[:len(slots)]
            for record in todo:
                record.busy = True
                record.pins += 1
            self._promoting += len(slots)
            if short:
                self.listener.on_dram_short()
        return Claim(todo, slots, short)

    def slot_view(self, record: PageRecord, slot: int) -> memoryview:
        return self.arena.view[slot:slot + self._page_bytes(record)]

    def finish_promotion(self, claim: Claim, read_ok: list[bool | None]) -> tuple[int, list[PageId]]:
        """Publish the slots whose bytes matched; drop pages that did not (with their descendants),
        as corrupt where read_ok is False, as gone (a quarantined shard's) where it is None.

        Returns (pages promoted, NVMe ids of dropped pages, for the caller to delete)."""
        promoted, promoted_bytes, garbage = 0, 0, []
        with self._lock:
            self._promoting -= len(claim.slots)
            for position, (record, slot) in enumerate(zip(claim.records, claim.slots)):
                ok = position < len(read_ok) and read_ok[position]
                self.index.release_busy(record)
                if ok and record.alive:
                    self.index.set_dram(record, slot)
                    promoted += 1
                    promoted_bytes += self._page_bytes(record)
                    continue
                self._free_slot(slot)
                if position < len(read_ok) and read_ok[position] is None and record.alive:
                    gone = self.index.remove_subtree(record)
                    self._sync_events(gone)
                    garbage += [r.page_id for r in gone if r.on_nvme]
                elif position < len(read_ok) and not ok and record.alive:
                    garbage += self._drop_corrupt(record)
            self.index.unpin_all(claim.records)
            self._sync_events(claim.records)
            self._deleting(garbage)
            self.counters.promotions += promoted
            self.counters.promoted_bytes += promoted_bytes
            self._settled.notify_all()
        return promoted, garbage

    def wait_settled(self, records: list[PageRecord], deadline: float) -> None:
        """Wait while one of these pages is still moving (up to `deadline`, in time.monotonic())."""
        with self._settled:
            while any(r.busy for r in records):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._settled.wait(remaining)

    # -- for the scrubber ---------------------------------------------------------------

    def scrub_batch(self, cursor: int, count: int) -> tuple[list[PageRecord], int | None]:
        """Up to `count` pages held and not moving, from index position `cursor` on, pinned (so a DRAM
        slot stays put), and the position to go on from (None: the pass is over)."""
        with self._lock:
            found, cursor = self.index.scan(cursor, SCAN_POSITIONS, found_max=count)
            batch = [r for r in found if not r.busy]
            for record in batch:
                record.pins += 1
            return batch, cursor

    def scrub_done(self, batch: list[PageRecord], bad: list[PageRecord]) -> list[PageId]:
        """Unpin a scrubbed batch; drop the bad pages with their descendants. NVMe ids to delete."""
        garbage: list[PageId] = []
        with self._lock:
            bad = [r for r in bad if r.alive]   # a page deleted meanwhile is not bad, only gone
            for record in bad:
                if record.alive:   # an earlier one's subtree may have taken it
                    garbage += self._drop_corrupt(record)
            self.index.unpin_all(batch)
            self._deleting(garbage)
            self.counters.scrub_pages_checked += len(batch)
            self.counters.scrub_pages_bad += len(bad)
        return garbage

    def drop_changed(self, lease_id: int, indices: list[int]) -> tuple[int, list[PageId]]:
        """A reader found these pages of its read lease not matching their checksums: each whose slot no
        longer hashes to it is dropped, with its descendants. Returns (pages dropped, NVMe ids to delete)."""
        with self._lock:
            lease = self._lease(lease_id, READ)
            if any(i >= len(lease.pinned) for i in indices):
                raise errors.InvalidArgument(f"changed_pages names a page past the {len(lease.pinned)} pages "
                                             f"of lease {lease_id:#x}: give indices of its hit pages")
            records = [lease.pinned[i] for i in indices]
        changed = [r for r in records if not self.dram_checksum_ok(r)]   # pinned: no slot is reused meanwhile
        garbage: list[PageId] = []
        with self._lock:
            for record in changed:
                if record.alive:   # an earlier one's subtree may have taken it
                    garbage += self._drop_corrupt(record)
            self._deleting(garbage)
        return len(changed), garbage

    def replace_memfd(self, tenant: str) -> bool:
        """Move the tenant's pages into a fresh memfd (Arena.replace_memfd) if nothing writes them now: no
        lease of the tenant open and no promotion under way. False: not now, ask again."""
        with self._lock:
            if self.leases.held_by(tenant) or self._promoting:
                return False
            self.arena.replace_memfd(tenant)
        return True

    def trim_arena(self) -> int:
        """Punch the tenants' memfds back to the slabs each holds (Arena.trim); bytes freed."""
        with self._lock:
            return self.arena.trim()

    def dram_checksum_ok(self, record: PageRecord) -> bool:
        """Re-hash a pinned page's DRAM copy (unlocked: a pinned slot is never reused)."""
        offset = record.offset
        if offset == NO_SLOT:
            return True
        return xxhash.xxh3_64_intdigest(self.arena.view[offset:offset + self._page_bytes(record)]) == record.checksum

    # -- Stats ---------------------------------------------------------------------------

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

    # -- internals (lock held) ------------------------------------------------------------

    def _allocate(self, slot_bytes: int, count: int, evict: Evict, tenant: str) -> list[int]:
        """Up to `count` free slots for `tenant`, evicting least recently used pages allowed by `evict`."""
        holder = self.arena.key(tenant)   # slabs are held whole by one tenant's memfd
        offsets = self.allocator.allocate_many(slot_bytes, count, holder, self._new_slabs_allowed(tenant))
        keep_unsaved = evict is Evict.CLEAN
        own = tenant if self.arena.tenants_apart else None   # whose victims free slots in `holder`'s slabs
        evicted = False
        while len(offsets) < count:
            # A victim of this size in this memfd's slabs frees one slot that allocation then hands out:
            # evict as many as are still needed before allocating again. A tenant below its share takes
            # a slab back from one above its own first (_slab_donors).
            freed: list[int] = []
            if self._slab_donors(tenant)[0] == own and self.events is not None:
                taken = self._evict_each(slot_bytes, keep_unsaved, count - len(offsets), own)
                if taken:
                    evicted = True
                    offsets += self.allocator.allocate_many(slot_bytes, count - len(offsets), holder,
                                                            self._new_slabs_allowed(tenant))
                    continue
            elif self._slab_donors(tenant)[0] == own:
                freed, tenants = self.index.evict_dram_many(slot_bytes, keep_unsaved, count - len(offsets),
                                                            tenant=own)
            if freed:
                self._evicted_many(slot_bytes, freed, tenants)
            elif not self._evict_for_slab(keep_unsaved, tenant):
                break
            evicted = True
            offsets += self.allocator.allocate_many(slot_bytes, count - len(offsets), holder,
                                                    self._new_slabs_allowed(tenant))
        self.ledger.took(tenant, slot_bytes, offsets)
        if evicted:
            failpoints.hit("evict.after_victims")
        return offsets

    def _dram_room(self, tenant: str, slot_bytes: int, count: int, evict: Evict) -> int:
        """How many of `count` slots the tenant's DRAM quota allows, after evicting its own least recently
        used pages (any size) to make room. The quota only ever limits. Under write_back it never takes
        an unsaved page, even when `evict` allows it: its own pages are written down first, or refused."""
        limit = self.ledger.dram_limit(tenant)
        if not limit:
            return count
        keep_unsaved = evict is Evict.CLEAN or self.protect_unsaved
        excess = self.ledger.dram_bytes.get(tenant, 0) + count * slot_bytes - limit
        if excess > 0 and self.events is not None:
            self._evict_each(None, keep_unsaved, len(self.index), tenant, until_bytes=excess)
        elif excess > 0:   # its own least recently used pages, any size, until their slots cover the excess
            freed, _ = self.index.evict_dram_many(None, keep_unsaved, len(self.index), tenant=tenant,
                                                  until_bytes=excess)
            for offset in freed:
                self._free_slot(offset)
            if freed:
                self.counters.evictions += len(freed)
                self.ledger.of(tenant).evictions += len(freed)
        return min(count, max(limit - self.ledger.dram_bytes.get(tenant, 0), 0) // slot_bytes)

    def _nvme_room(self, tenant: str, slot_bytes: int, victims: list[PageRecord]) -> bool:
        """Whether the tenant's NVMe quota takes one more page, after taking its own least recently used
        NVMe pages off (appended to `victims`) to make room."""
        limit = self.ledger.nvme_limit(tenant)
        while True:
            usage = self.index.usage.get(tenant)
            held = (usage.nvme_bytes if usage else 0) + self.ledger.nvme_writing_bytes.get(tenant, 0)
            if held + slot_bytes <= limit:
                return True
            taken = self.index.evict_nvme(None, 1, tenant)
            if not taken:
                return False
            victims += taken

    def _evict_each(self, slot_bytes: int | None, clean_only: bool, count: int, tenant: str | None,
                    until_bytes: int = 0) -> int:
        """evict_dram_many where page events are published: victim by victim, so that each one's record
        reaches the callbacks (_on_removed, _free_dram: they free its slot and announce it). Returns victims."""
        taken = freed_bytes = 0
        while taken < count:
            victim = self.index.evict_dram(slot_bytes, clean_only, tenant)
            if victim is None:
                break
            self._evicted(victim)
            taken += 1
            freed_bytes += victim.slot_bytes
            if 0 < until_bytes <= freed_bytes:
                break
        return taken

    def _sync_events(self, records: Iterable[PageRecord]) -> None:
        if self.events is not None:
            self.events.sync(records)

    def _evicted(self, record: PageRecord) -> None:
        self.counters.evictions += 1
        self.ledger.of(record.tenant).evictions += 1

    def _evicted_many(self, slot_bytes: int, offsets: list[int], tenants: list[str]) -> None:
        """Victims of one slot size taken by evict_dram_many: their slots freed, their evictions counted."""
        self.allocator.free_many(offsets, slot_bytes)
        self.ledger.freed_many(offsets, slot_bytes)
        self.counters.evictions += len(tenants)
        for tenant, victims in collections.Counter(tenants).items():
            self.ledger.of(tenant).evictions += victims

    def _evict_for_slab(self, keep_unsaved: bool, tenant: str) -> bool:
        """Evict the oldest pages of the tenants _slab_donors names, in its order, until `tenant` may take a
        whole free slab (bounded)."""
        budget = self.config.dram.slab_bytes // SLOT_ALIGN   # a slab's worth of the smallest slots
        while not self._slab_takeable(tenant) and budget > 0:
            for donor in self._slab_donors(tenant):
                victim = self.index.evict_dram(None, keep_unsaved, donor)
                if victim is not None:
                    break
            else:
                return False
            self._evicted(victim)
            budget -= 1
        return self._slab_takeable(tenant)

    def _slab_takeable(self, tenant: str) -> bool:
        allowed = self._new_slabs_allowed(tenant)
        return self.allocator.free_slabs() > 0 if allowed is None else allowed > 0

    def _new_slabs_allowed(self, tenant: str) -> int | None:
        """How many more slabs `tenant` may take now (None: any free one, where tenants share slabs): free ones
        not kept for another tenant's floor, and no more than its quota leaves."""
        if not self.arena.tenants_apart:
            return None
        held, shares = self.allocator.slabs_held, self.shares
        kept = sum(max(0, shares.floor(name) - held[name]) for name in shares.tenants() if name != tenant)
        allowed = max(0, self.allocator.free_slabs() - kept)
        cap = shares.cap(tenant)
        return min(allowed, max(0, cap - held[tenant])) if cap else allowed

    def _at_slab_cap(self, tenant: str) -> bool:
        cap = self.shares.cap(tenant)
        return bool(cap) and self.allocator.slabs_held[tenant] >= cap

    def _slab_donors(self, tenant: str) -> list[str | None]:
        """Whose pages are evicted for a slab `tenant` needs, in order; None: anyone's (tenants share slabs).

        Where slabs are each tenant's own, a tenant at its quota takes only its own. Otherwise it first
        takes from tenants holding more slabs past their floor than it would after the move, the most
        past first, then its own. Free slabs up to every tenant's floor are kept for it
        (_new_slabs_allowed), so nobody loses a slab of its floor to another's need, even to pages that
        cannot be evicted (leased), and under contention every tenant converges to its floor plus an
        equal part of the rest.
        """
        if not self.arena.tenants_apart:
            return [None]
        if self._at_slab_cap(tenant):
            return [tenant]
        held, shares = self.allocator.slabs_held, self.shares
        past = {name: slabs - shares.floor(name) for name, slabs in held.items() if slabs and name != tenant}
        bar = max(0, held[tenant] - shares.floor(tenant) + 1)
        donors: list[str | None] = sorted((name for name, over in past.items() if over > bar),
                                          key=lambda name: -past[name])
        return donors + [tenant]

    def _slab_refusal(self, tenant: str) -> str:
        return self.shares.refusal(tenant, self.allocator.slabs_held[tenant], self.ledger.dram_limit(tenant))

    def _deleting(self, page_ids: list[PageId]) -> None:
        """Lock held: these pages' NVMe copies are about to be deleted (see nvme_deleted)."""
        for page_id in page_ids:
            self._nvme_deleting[page_id] = self._nvme_deleting.get(page_id, 0) + 1

    def _drop_corrupt(self, record: PageRecord) -> list[PageId]:
        removed = self.index.remove_subtree(record)
        self._sync_events(removed)
        self.counters.corrupt_pages += len(removed)
        log.error("corrupt page dropped namespace=%016x key=%s pages_dropped=%d",
                  record.page_id[0], record.page_id[1].hex()[:32], len(removed))
        return [r.page_id for r in removed if r.on_nvme]

    def _end_lease(self, lease: Lease) -> None:
        if lease.ended:
            return
        lease.ended = True
        self._unclaim(lease)
        if not lease.transfers:  # else bytes still move through its slots: the last transfer frees them
            self._free_lease_memory(lease)
        if self.leases.get(lease.lease_id) is lease:
            self.leases.close(lease)

    def _fence(self, lease: Lease) -> None:
        """End a lease its owner did not end. A write lease whose owner maps the arena (a local
        connection) may still have a copy of the owner's running into its slots, past any deadline
        the owner checked before it began: those slots are kept from reuse until the owner says it
        is done (abort) or its connection closes, so a late copy lands in memory no page uses."""
        if lease.slots and getattr(lease.owner, "arena", None) is not None:
            self._unclaim(lease)
            self._fenced[lease.lease_id] = (lease.owner, list(lease.slots.values()))
            lease.slots.clear()
        self._end_lease(lease)

    def _unclaim(self, lease: Lease) -> None:
        """A write lease's uncommitted pages are claimed no more."""
        if not lease.slots:
            return
        claimed, keys = self._pending[lease.namespace_id], lease.keys
        for index in lease.slots:
            del claimed[keys[index]]

    def _unfence(self, lease_id: int) -> None:
        _, offsets = self._fenced.pop(lease_id)
        for offset in offsets:
            self._free_slot(offset)

    def _free_lease_memory(self, lease: Lease) -> None:
        for offset in lease.slots.values():
            self._free_slot(offset)
        lease.slots.clear()
        self.index.unpin_all(lease.pinned)
        lease.pinned = []

    def _lease(self, lease_id: int, kind: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise lease_not_found(lease_id)
        if lease.kind != kind:
            verb = "Abort or Commit" if lease.kind == WRITE else "Release"
            raise errors.InvalidArgument(f"lease {lease_id:#x} is a {lease.kind} lease: end it with {verb}")
        return lease

    def _pin(self, lease: Lease, record: PageRecord) -> None:
        self.index.pin(record)
        lease.pinned.append(record)

    def _page_bytes(self, record: PageRecord) -> int:
        return self.namespaces[record.page_id[0]].page_bytes

    def _on_removed(self, record: PageRecord) -> None:
        """A page left the index and no lease holds it: its DRAM slot may be reused."""
        if record.offset != NO_SLOT:
            self._free_slot(record.offset)
            record.offset = NO_SLOT
        if self.events is not None:
            self.events.sync((record,))

    def _free_dram(self, record: PageRecord) -> None:
        self._free_slot(record.offset)
        if self.events is not None:   # the index clears the record's offset after this call
            self.events.dram_dropped(record)

    def _free_slot(self, offset: int) -> None:
        self.ledger.freed(offset, self.allocator.free(offset))


def _nvme_ancestors(records: list[PageRecord]) -> list[PageRecord]:
    """The alive ancestors on NVMe of these pages, each once."""
    found: dict[PageRecord, None] = {}
    for record in records:
        node = record.parent
        while node is not None and node not in found:
            if node.alive and node.on_nvme:
                found[node] = None
            node = node.parent
    return list(found)


def _unsaved_chain(record: PageRecord, deleting: dict[PageId, int], batched: set[PageRecord],
                   room: int) -> tuple[list[PageRecord], PageRecord | None]:
    """The page and its ancestors not yet on NVMe nor in this batch, root first, and None; ([], None)
    if one is gone, moving, or its NVMe copy is being deleted; ([], the highest one reached) if there
    are more than `room` of them."""
    chain = []
    node: PageRecord | None = record
    while node is not None and not node.on_nvme and node not in batched:
        if not node.alive or node.offset == NO_SLOT or node.busy or node.page_id in deleting:
            return [], None
        if len(chain) == room:
            return [], node
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain, None
