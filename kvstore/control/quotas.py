"""Tenant quotas: what each tenant may hold in DRAM and on NVMe, and what it holds now.

A tenant's DRAM bytes are the arena slots it holds, whatever they hold: committed pages,
slots reserved for its writes, slots filling from NVMe for its reads. The ledger records
the owner of every slot as the store takes it and forgets it as the store frees it, so the
figure is exact at every step and needs no walk of the index. NVMe bytes come from the
index (`PageIndex.usage`), plus pages of the tenant being written down now.

Enforcement is the store's and the controller's (store.py `_allocate`, `admit_nvme`): a
tenant at its limit makes room by evicting its own least recently used pages, under the
same rules as any eviction (leaf-first, prefix-closed, write_back never drops an unsaved
page); what its own pages cannot make room for is refused, never taken from another tenant.

Where each tenant's pages live in slabs of its own (tenants told apart, tiers/dram.py), what a
tenant holds is whole slabs, each of one page size, however few of its slots are used: a
tenant storing one page of each of 16 sizes holds 16 slabs. SlabShares counts quotas in those
slabs too, and gives each tenant with a quota a floor: slabs no other tenant's need takes
from it, and free slabs kept for it while it holds fewer (store.py `_slab_donors`,
`_new_slabs_allowed`). A quota is so a reservation as well as a limit: a neighbour, however it
spreads its pages or holds its leases, can neither evict a tenant within its quota nor starve
it of the room the quota promises. Quotas adding up to more than the arena have their floors
scaled down to fit.

Not thread-safe: the page store's lock guards every call.
"""

from __future__ import annotations

import array
import dataclasses


@dataclasses.dataclass
class TenantCounters:
    evictions: int = 0           # DRAM copies of this tenant's pages dropped (by anyone's need)
    nvme_evictions: int = 0
    dram_refused_pages: int = 0  # pages a Reserve or promotion could not place within the DRAM quota
    nvme_refused_pages: int = 0  # pages a write-down left in DRAM only, over the NVMe quota


class SlabShares:
    """Each tenant's DRAM quota in whole slabs (rounded down, at least one) and its floor: its quota,
    scaled down when the quotas add up to more slabs than the arena has."""

    def __init__(self, limits: dict[str, tuple[int, int]], slab_bytes: int, slabs: int):
        self.slab_bytes = slab_bytes
        self._caps = {tenant: max(1, dram // slab_bytes) for tenant, (dram, _) in limits.items() if dram}
        promised = sum(self._caps.values())
        self._floors = {tenant: cap * slabs // promised if promised > slabs else cap
                        for tenant, cap in self._caps.items()}

    def tenants(self) -> list[str]:
        """Those with a quota, and so a floor."""
        return list(self._caps)

    def cap(self, tenant: str) -> int:
        """Slabs the tenant may hold; 0: no limit."""
        return self._caps.get(tenant, 0)

    def floor(self, tenant: str) -> int:
        return self._floors.get(tenant, 0)

    def refusal(self, tenant: str, held: int, quota_bytes: int) -> str:
        return (f"tenant {tenant!r} holds {held} slabs of {self.slab_bytes} bytes, as many as its DRAM quota "
                f"(tenants.quotas dram_bytes = {quota_bytes}) allows: a slab holds pages of one size, so each page "
                "size it stores takes a slab of its own, and none of its own pages can be evicted for more (they "
                "are leased, moving, or not yet written down); use fewer page sizes, release leases, delete "
                "pages, or raise the quota")


class TenantLedger:
    def __init__(self, limits: dict[str, tuple[int, int]], slab_bytes: int):
        self._limits = limits                              # tenant -> (dram_bytes, nvme_bytes); 0 = none
        # The owner of each slot of each slab in use, two bytes a slot (where a dict entry per slot
        # cost a hundred bytes of every indexed page); 0: no owner. A slab's table goes when its last
        # slot is freed, as the allocator's slab does, so a slab reused for another size gets a new one.
        self._slab_bytes = slab_bytes
        self._owners: dict[int, array.array] = {}          # slab base -> owner id of each slot
        self._owned: dict[int, int] = {}                   # slab base -> slots with an owner
        self._owner_names: list[str] = [""]
        self._owner_ids: dict[str, int] = {}
        self.dram_bytes: dict[str, int] = {}
        self.nvme_writing_bytes: dict[str, int] = {}       # admitted to a write-down still in flight
        self.counters: dict[str, TenantCounters] = {}

    def dram_limit(self, tenant: str) -> int:
        return self._limits.get(tenant, (0, 0))[0]

    def nvme_limit(self, tenant: str) -> int:
        return self._limits.get(tenant, (0, 0))[1]

    def tenants(self) -> set[str]:
        """Tenants with a quota, a slot, or a counted event."""
        return set(self._limits) | set(self.dram_bytes) | set(self.counters)

    def took(self, tenant: str, slot_bytes: int, offsets: list[int]) -> None:
        owner = self._owner_ids.get(tenant)
        if owner is None:
            assert len(self._owner_names) < 1 << 16, "at most 65535 tenants hold DRAM slots"
            owner = self._owner_ids[tenant] = len(self._owner_names)
            self._owner_names.append(tenant)
        runs = self._runs(offsets, slot_bytes)
        if runs is not None:
            # Slots one after another (the allocator's usual answer): one slice a slab, no step per slot.
            for base, first, count in runs:
                owners = self._table(base, slot_bytes)
                assert owners[first:first + count].count(0) == count, \
                    f"a slot of {offsets[0]}..{offsets[-1]} is taken twice"
                owners[first:first + count] = array.array("H", [owner]) * count
                self._owned[base] += count
        else:
            for offset in offsets:
                base, slot = self._slot(offset, slot_bytes)
                owners = self._table(base, slot_bytes)
                assert not owners[slot], f"slot {offset} is taken twice"
                owners[slot] = owner
                self._owned[base] += 1
        self.dram_bytes[tenant] = self.dram_bytes.get(tenant, 0) + slot_bytes * len(offsets)

    def freed(self, offset: int, slot_bytes: int) -> None:
        base, slot = self._slot(offset, slot_bytes)
        owners = self._owners.get(base)
        owner = owners[slot] if owners is not None and slot < len(owners) else 0
        assert owner, f"slot {offset} is freed but was not taken"
        owners[slot] = 0
        self._drop(base, 1)
        self.dram_bytes[self._owner_names[owner]] -= slot_bytes

    def freed_many(self, offsets: list[int], slot_bytes: int) -> None:
        """freed() of each of these slots, all of size `slot_bytes`."""
        runs = self._runs(offsets, slot_bytes)
        if runs is not None:
            # Slots one after another, up or down, of one owner (eviction's usual victims: a commit's pages,
            # leaf first): one slice a slab, no step per slot.
            tables = [self._owners.get(base) for base, _, _ in runs]
            owner = tables[0][runs[0][1]] if tables[0] is not None else 0
            if owner and all(owners is not None and owners[first:first + count].count(owner) == count
                             for owners, (_, first, count) in zip(tables, runs)):
                for owners, (base, first, count) in zip(tables, runs):
                    owners[first:first + count] = array.array("H", bytes(2 * count))
                    self._drop(base, count)
                self.dram_bytes[self._owner_names[owner]] -= slot_bytes * len(offsets)
                return
        for offset in offsets:
            self.freed(offset, slot_bytes)

    def _slot(self, offset: int, slot_bytes: int) -> tuple[int, int]:
        """(slab base, slot number in it) of the slot starting at `offset`."""
        base = offset - offset % self._slab_bytes
        assert (offset - base) % slot_bytes == 0, f"offset {offset} is not the start of a {slot_bytes}-byte slot"
        return base, (offset - base) // slot_bytes

    def _table(self, base: int, slot_bytes: int) -> array.array:
        owners = self._owners.get(base)
        if owners is None:
            owners = self._owners[base] = array.array("H", bytes(2 * (self._slab_bytes // slot_bytes)))
            self._owned[base] = 0
        assert len(owners) == self._slab_bytes // slot_bytes, f"the slab at {base} holds slots of another size"
        return owners

    def _drop(self, base: int, count: int) -> None:
        self._owned[base] -= count
        if not self._owned[base]:
            del self._owners[base], self._owned[base]

    def _runs(self, offsets: list[int], slot_bytes: int) -> list[tuple[int, int, int]] | None:
        """(slab base, first slot number, slots) of each slab's part of these slots when they are more than
        one and follow one another, up or down; None otherwise."""
        count = len(offsets)
        step = offsets[1] - offsets[0] if count > 1 else 0
        if abs(step) != slot_bytes or offsets != list(range(offsets[0], offsets[0] + step * count, step)):
            return None
        low = min(offsets[0], offsets[-1])
        high = low + slot_bytes * count
        runs = []
        while low < high:
            base, first = self._slot(low, slot_bytes)
            end = min(high, base + self._slab_bytes)
            runs.append((base, first, (end - low) // slot_bytes))
            low = end
        return runs

    def of(self, tenant: str) -> TenantCounters:
        counters = self.counters.get(tenant)
        if counters is None:
            counters = self.counters[tenant] = TenantCounters()
        return counters

    def dram_refusal(self, tenant: str) -> str:
        return (f"tenant {tenant!r} holds {self.dram_bytes.get(tenant, 0)} bytes of DRAM and its quota "
                f"(tenants.quotas dram_bytes) is {self.dram_limit(tenant)}: none of its own pages can be "
                "evicted for more (they are leased, moving, or not yet written down); release leases, "
                "delete pages, or raise the quota")
