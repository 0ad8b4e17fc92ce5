"""Read holds and promotion claims: Acquire pins the leading pages of a chain in any tier
(waiting for commits still in flight), pages only on NVMe are claimed DRAM slots and come up,
a lease is trimmed to what DRAM holds, Release ends it; pages a reader found changed are dropped.

A part of PageStore (store.py), which owns the state and the one lock these methods take.
"""

from __future__ import annotations

import collections
import time
from typing import Iterable

from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.control.leases import READ, Lease
from kvstore.control.store_types import Claim, Evict, PageId, SCAN_POSITIONS
from kvstore_client import errors


class ReadHolds:
    """Acquire's holds, promotion claims, release."""

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
            pinned = lease.pinned
            if self.index.ready_prefix(pinned) == len(pinned):   # the usual Acquire: every page in DRAM
                return []
            return [r for r in pinned if r.offset == NO_SLOT]

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
            ready = lease.pinned[:self.index.ready_prefix(lease.pinned)]
            self.index.unpin_all(lease.pinned[len(ready):])
            lease.pinned = ready
            from_dram = min(from_dram, len(ready))
            self.counters.dram_hits += from_dram
            self.counters.nvme_hits += len(ready) - from_dram
            self.counters.misses += keys_asked - len(ready)
            if not ready or lease.ended:
                self._end_lease(lease)
                return None
            self.index.read_all(ready)
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
        """Wait while one of these pages is still moving (up to `deadline`, in time.monotonic()).
        Those moving are found SCAN_POSITIONS at a time; then only they are watched (a write-down
        batch or a promotion's pages: none of the others starts to move once it left the index)."""
        moving: list[PageRecord] = []
        for start in range(0, len(records), SCAN_POSITIONS):
            with self._lock:
                moving += [r for r in records[start:start + SCAN_POSITIONS] if r.busy]
        with self._settled:
            while moving := [r for r in moving if r.busy]:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._settled.wait(remaining)

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
