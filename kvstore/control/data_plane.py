"""The data planes' view of the node: a frame's (lease, token, slot, length) resolved to slot bytes.

Transports (kvstore/transport/) know nothing of leases or tiers; they are given this
SlotResolver. A grant holds its slot (neither freed nor reused) until finish_transfer, or
cut_transfer when a write stopped part-way, which ends the lease so the torn page is never
visible. The checks and the holding are the store's; this module only shapes them.
"""

from __future__ import annotations

from kvstore.control.leases import READ, WRITE
from kvstore.control.store import PageStore
from kvstore.transport.slots import Grant


class SlotGrants:
    def __init__(self, store: PageStore):
        self._store = store

    def resolve_write(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant:
        """The arena bytes of an uncommitted reserved slot."""
        lease, offset = self._store.begin_transfer(lease_id, token, WRITE, slot, nbytes)
        return Grant(lease, slot, self._store.arena.view[offset:offset + nbytes], lease.deadline, True)

    def resolve_read(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant:
        """The arena bytes of the slot-th page pinned by a read lease."""
        lease, offset = self._store.begin_transfer(lease_id, token, READ, slot, nbytes)
        return Grant(lease, slot, self._store.arena.view[offset:offset + nbytes], lease.deadline, False)

    def finish_transfer(self, grant: Grant) -> None:
        self._store.end_transfer(grant.lease, grant.slot)

    def cut_transfer(self, grant: Grant) -> None:
        self._store.cut_transfer(grant.lease, grant.slot)
