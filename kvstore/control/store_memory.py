"""Allocation and eviction of DRAM slots: slots from the slab allocator within each tenant's
quota, leaf-first eviction for room, slabs moved between page sizes and tenants, and freeing a
removed page's slot.

A part of PageStore (store.py), which owns the state and the one lock these methods take.
"""

from __future__ import annotations

import collections
from typing import Iterable

from kvstore import failpoints
from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.control.store_types import Evict
from kvstore.tiers.dram import SLOT_ALIGN


class DramSlots:
    """DRAM slots: allocation, eviction for room, slabs, freeing."""

    def _allocate(self, slot_bytes: int, count: int, evict: Evict, tenant: str) -> list[int]:
        """Up to `count` free slots for `tenant`, evicting least recently used pages allowed by `evict`."""
        holder = self.arena.key(tenant)   # slabs are held whole by one tenant's memfd
        offsets = self.allocator.allocate_many(slot_bytes, count, holder, self._new_slabs_allowed(tenant))
        own = tenant if self.arena.tenants_apart else None   # whose victims free slots in `holder`'s slabs
        evicted = False
        while len(offsets) < count:
            # A victim of this size in this memfd's slabs frees one slot that allocation then hands out:
            # evict as many as are still needed before allocating again. A tenant below its share takes
            # a slab back from one above its own first (_slab_donors).
            freed: list[int] = []
            if self._slab_donors(tenant)[0] == own and self.events is not None:
                taken = self._evict_each(slot_bytes, evict, count - len(offsets), own)
                if taken:
                    evicted = True
                    offsets += self.allocator.allocate_many(slot_bytes, count - len(offsets), holder,
                                                            self._new_slabs_allowed(tenant))
                    continue
            elif self._slab_donors(tenant)[0] == own:
                freed, tenants = self.index.evict_dram_many(slot_bytes, evict.clean_only, count - len(offsets),
                                                            tenant=own, older_than_unsaved=evict.cold)
            if freed:
                self._evicted_many(slot_bytes, freed, tenants)
            elif not self._evict_for_slab(evict, tenant):
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
        if evict is Evict.ANY and self.protect_unsaved:
            evict = Evict.CLEAN
        excess = self.ledger.dram_bytes.get(tenant, 0) + count * slot_bytes - limit
        if excess > 0 and self.events is not None:
            self._evict_each(None, evict, len(self.index), tenant, until_bytes=excess)
        elif excess > 0:   # its own least recently used pages, any size, until their slots cover the excess
            freed, _ = self.index.evict_dram_many(None, evict.clean_only, len(self.index), tenant=tenant,
                                                  until_bytes=excess, older_than_unsaved=evict.cold)
            self._free_sized(freed)
            if freed:
                self.counters.evictions += len(freed)
                self.ledger.of(tenant).evictions += len(freed)
        return min(count, max(limit - self.ledger.dram_bytes.get(tenant, 0), 0) // slot_bytes)

    def _evict_each(self, slot_bytes: int | None, evict: Evict, count: int, tenant: str | None,
                    until_bytes: int = 0) -> int:
        """evict_dram_many where page events are published: victim by victim, so that each one's record
        reaches the callbacks (_on_removed, _free_dram: they free its slot and announce it). Returns victims."""
        taken = freed_bytes = 0
        while taken < count:
            victim = self.index.evict_dram(slot_bytes, evict.clean_only, tenant, older_than_unsaved=evict.cold)
            if victim is None:
                break
            self._evicted(victim)
            taken += 1
            freed_bytes += victim.slot_bytes
            if 0 < until_bytes <= freed_bytes:
                break
        return taken

    def _evicted(self, record: PageRecord) -> None:
        self.counters.evictions += 1
        self.ledger.of(record.tenant).evictions += 1

    def _evicted_many(self, slot_bytes: int, offsets: list[int], tenants: list[str]) -> None:
        """Victims of one slot size taken by evict_dram_many: their slots freed, their evictions counted."""
        self._free_run(offsets, slot_bytes)
        self.counters.evictions += len(tenants)
        for tenant, victims in collections.Counter(tenants).items():
            self.ledger.of(tenant).evictions += victims

    def _evict_for_slab(self, evict: Evict, tenant: str) -> bool:
        """Evict the oldest pages `evict` allows of the tenants _slab_donors names, in its order, until `tenant`
        may take a whole free slab (bounded)."""
        budget = self.config.dram.slab_bytes // SLOT_ALIGN   # a slab's worth of the smallest slots
        while not self._slab_takeable(tenant) and budget > 0:
            for donor in self._slab_donors(tenant):
                victim = self.index.evict_dram(None, evict.clean_only, donor, older_than_unsaved=evict.cold)
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

    def _on_removed(self, record: PageRecord) -> None:
        """A page left the index and no lease holds it: its DRAM slot may be reused."""
        if record.offset != NO_SLOT:
            self._free_slot(record.offset)
            record.offset = NO_SLOT
        if self.events is not None:
            self.events.sync((record,))

    def _free_slots(self, records: list[PageRecord], offsets: list[int]) -> None:
        """The DRAM slots removed pages gave up (the index's remove_subtree_slots), freed a size at a time: a
        run of slots in one call each to the allocator and the ledger, where a callback a page cost 2 us."""
        self._free_by_size((record.slot_bytes, offset) for record, offset in zip(records, offsets)
                           if offset != NO_SLOT)

    def _free_sized(self, offsets: list[int]) -> None:
        """Slots of any sizes, freed a size at a time as _free_slots frees them."""
        self._free_by_size((self.allocator.slot_bytes_of(offset), offset) for offset in offsets)

    def _free_by_size(self, sized: Iterable[tuple[int, int]]) -> None:
        """(slot bytes, offset) pairs: each size's slots freed as one run (_free_run), in the order given."""
        by_size: dict[int, list[int]] = collections.defaultdict(list)
        for slot_bytes, offset in sized:
            by_size[slot_bytes].append(offset)
        for slot_bytes, run in by_size.items():
            self._free_run(run, slot_bytes)

    def _free_run(self, offsets: list[int], slot_bytes: int) -> None:
        """Slots of one size back to the allocator and off their tenants' ledger, in one call each."""
        self.allocator.free_many(offsets, slot_bytes)
        self.ledger.freed_many(offsets, slot_bytes)

    def _free_dram(self, record: PageRecord) -> None:
        self._free_slot(record.offset)
        if self.events is not None:   # the index clears the record's offset after this call
            self.events.dram_dropped(record)

    def _free_slot(self, offset: int) -> None:
        self.ledger.freed(offset, self.allocator.free(offset))

    def _page_bytes(self, record: PageRecord) -> int:
        return self.namespaces[record.page_id[0]].page_bytes

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
