"""How leases end: expiry, a client's connection closing, draining; fenced slots (a write
lease ended while its writer may still copy) and the bookkeeping every ending shares.

A part of PageStore (store.py), which owns the state and the one lock these methods take.
"""

from __future__ import annotations

from kvstore.control.index import PageRecord
from kvstore.control.leases import WRITE, Lease
from kvstore.control.store_types import lease_not_found
from kvstore_client import errors


class LeaseEnds:
    """Leases ending: expiry, connections closing, draining, fenced slots."""

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
