"""Write leases and commits: Reserve claims keys and DRAM slots, the client copies, Commit
checks and publishes (one chain, or a page group's parts at once), Abort ends a lease; and the
data plane's transfers into those slots.

A part of PageStore (store.py), which owns the state and the one lock these methods take.
"""

from __future__ import annotations

import hmac
import logging

import xxhash

from kvstore import failpoints
from kvstore.control.index import PageRecord
from kvstore.control.leases import READ, WRITE, Lease
from kvstore.control.store_types import CommitPart, Evict, PageId, Reservation, lease_not_found
from kvstore.tiers.dram import slot_bytes_for
from kvstore_client import errors, native
from kvstore_client.proto import pb

log = logging.getLogger(__name__)


class WriteLeases:
    """Reserve, fill, commit and abort; the data plane's copies into reserved slots."""

    def reserve(self, ns_id: int, keys: list[bytes], parent_key: bytes, lease_id: int, ttl_ms: int,
                owner: object | None, absent_parent: str = "refuse",
                parents: dict[int, bytes] | None = None) -> Reservation:
        """Step one: a write lease, the state of each key, pages of the chain pinned. No slots yet.

        The keys are distinct (checks.keys). `parents`: given (Reserve's parent_keys), the keys' parents
        where they are not the key before (checks.parent_keys); an extending Reserve may then also name a
        parent_key other than the lease's last key."""
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
                    if parents is None:
                        raise errors.InvalidArgument(
                            "parent_key of an extending Reserve must be the last key reserved under the lease")
                    parents = {0: parent_key, **parents}
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
            if parents:
                lease.parents.update((first_index + i, key) for i, key in parents.items())
            held = self.index.positions_held(ns_id, keys)
            if not held and _claim_all(claimed, keys, lease.lease_id):
                # The usual Reserve: every page new. Claimed now, in this lock section, so no other lease
                # reserves one meanwhile.
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

    def commit_written(self, lease_id: int, indices: list[int], checksums: list[int], records: bool = False,
                       copied_by_node: bytes = b"") -> tuple[list[int], list[int], list[PageRecord]]:
        """Publish slots whose checksums the lease's writer computed as it copied them in (one pass over
        the bytes: kvstore_native.copy_hash), without reading the slots back. A page is still never
        published without a checksum from its writer or from this node; the scrubber, promotion from
        NVMe and reads with verify check it later, like any page. `copied_by_node`: a byte per index, 1
        where this node copied the page in itself (a shared-buffer move) and recorded its checksum then;
        that one is used, never the writer's. Returns what commit() returns."""
        failpoints.hit("commit.before_publish")   # the writer hashed the slots; nothing visible yet
        with self._lock:
            lease = self._lease(lease_id, WRITE)
            indices = self._committable(lease, indices)
            if len(checksums) != len(indices):
                raise errors.InvalidArgument(
                    f"{len(checksums)} checksums for {len(indices)} pages: checksums_from_writer needs one per page")
            if copied_by_node and len(copied_by_node) != len(indices):
                raise errors.InvalidArgument(
                    f"{len(copied_by_node)} copied_by_node flags for {len(indices)} pages: give one per page or none")
            if copied_by_node:
                checksums = _node_copied(lease, indices, checksums, copied_by_node)
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
                parent_key = lease.parent_of(position)
                if (parent_key and (ns_id, parent_key) not in visible and self.index.get((ns_id, parent_key)) is None
                        and not lease.may_anchor(position)):
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
        the lease named that parent to anchor at (Lease.may_anchor). Returns (states, the published
        pages' records when `records` is asked for, else [])."""
        ns_id, keys, index = lease.namespace_id, lease.keys, self.index
        slot_bytes = slot_bytes_for(self.namespaces[ns_id].page_bytes)
        first = indices[0] if indices else 0
        parent_key = lease.parent_of(first)
        chain_parent = index.get((ns_id, parent_key)) if parent_key else None
        wants_commits = self.listener.wants_commits or self.events is not None
        one_chain = not lease.parents or not any(map(lease.parents.__contains__, indices[1:]))
        if (indices and indices[-1] - first == len(indices) - 1 and (chain_parent is not None or not parent_key)
                and one_chain):
            # The usual commit: consecutive pages under a parent held here (or none), one index call,
            # and no object per page unless someone reads them.
            offsets = list(map(lease.slots.pop, indices))
            if lease.arrived:
                for position in indices:
                    lease.arrived.pop(position, None)
            chain_keys = keys[first:first + len(indices)]
            _unclaim(self._pending[ns_id], chain_keys)
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
        """_publish page by page: a gap in the chain, a parent gone, or a page anchored at an absent parent."""
        ns_id, keys, index = lease.namespace_id, lease.keys, self.index
        claimed = self._pending[ns_id]
        states, published = [], []
        for position, checksum in zip(indices, sums):
            key = keys[position]
            offset = lease.slots.pop(position)
            lease.arrived.pop(position, None)
            del claimed[key]
            parent_key = lease.parent_of(position)
            parent = index.get((ns_id, parent_key)) if parent_key else None
            anchor = b""
            if parent_key and parent is None:
                if not lease.may_anchor(position):
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

    def begin_transfer(self, lease_id: int, token: bytes, kind: str, slot: int, nbytes: int) -> tuple[Lease, int, bool]:
        """Check a frame against its lease; (lease, slot offset, whether this node vouches for the bytes of a
        read: store_exposure.py), held until end_transfer."""
        with self._lock:
            return self._begin_transfer(lease_id, token, kind, slot, nbytes)

    def begin_transfers(self, lease_id: int, token: bytes, kind: str, slots: list[int],
                        nbytes: int) -> list[tuple[Lease, int, bool]]:
        """begin_transfer of each slot, under one hold of the lock: all of them, or none and the first error."""
        begun: list[tuple[Lease, int, bool]] = []
        with self._lock:
            try:
                for slot in slots:
                    begun.append(self._begin_transfer(lease_id, token, kind, slot, nbytes))
            except BaseException:
                for (lease, _, vouched), slot in zip(begun, slots):
                    self._end_transfer(lease, slot, None, vouched)
                raise
        return begun

    def end_transfers(self, lease: Lease, slots: list[int], arrived: list[int | None], vouched: list[bool]) -> None:
        """end_transfer of each slot of `lease`, under one hold of the lock."""
        with self._lock:
            for slot, checksum, vouch in zip(slots, arrived, vouched):
                self._end_transfer(lease, slot, checksum, vouch)

    def _begin_transfer(self, lease_id: int, token: bytes, kind: str, slot: int, nbytes: int) -> tuple[Lease, int, bool]:
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
        return lease, offset, kind == READ and self._vouch(lease.tenant)

    def end_transfer(self, lease: Lease, slot: int, arrived_checksum: int | None = None, vouched: bool = False) -> None:
        """A transfer is over; `arrived_checksum`: the xxh3 this node took of a written slot's bytes once
        all of them had landed, which its Commit records without hashing the slot again; `vouched`: what
        begin_transfer said of this read."""
        with self._lock:
            self._end_transfer(lease, slot, arrived_checksum, vouched)

    def _end_transfer(self, lease: Lease, slot: int, arrived_checksum: int | None, vouched: bool) -> None:
        self._transfer_ended(lease, slot)
        if vouched:
            self._unvouch(lease.tenant)
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


def _claim_all(claimed: dict[bytes, int], keys: list[bytes], lease_id: int) -> bool:
    """Claim every key for the lease if none of them is claimed yet (else claim nothing): a Reserve of new pages."""
    if native.claim_keys is not None:   # one pass: a third of the time of the two below
        return native.claim_keys(claimed, keys, lease_id)
    if not claimed.keys().isdisjoint(keys):
        return False
    claimed.update(dict.fromkeys(keys, lease_id))
    return True


def _unclaim(claimed: dict[bytes, int], keys: list[bytes]) -> None:
    """The keys of pages just published are claimed no more."""
    if native.unclaim_keys is not None:
        native.unclaim_keys(claimed, keys)
        return
    for key in keys:
        del claimed[key]


def _node_copied(lease: Lease, indices: list[int], checksums: list[int], copied_by_node: bytes) -> list[int]:
    """The writer's checksums, but for each page this node copied in itself the one it recorded then
    (Lease.arrived); InvalidArgument where it has none: no move of this node copied that page."""
    sums = list(checksums)
    for position, flag in enumerate(copied_by_node):
        if not flag:
            continue
        known = lease.arrived.get(indices[position])
        if known is None:
            raise errors.InvalidArgument(
                f"index {indices[position]} of lease {lease.lease_id:#x} is flagged copied_by_node, but no move of "
                "this node copied it: send its checksum, or MOVE_PAGES before this Commit on the same connection")
        sums[position] = known
    return sums
