"""Leases: time-limited holds on pages.

A write lease owns reserved slots until they are committed or aborted, and pins the
already-cached pages its new pages hang from. A read lease pins pages while a client
copies them. Both expire, so a crashed client never leaks slots or pins pages forever;
a lease can also belong to a local-channel connection, and ends when it closes.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import os
import threading
from typing import Iterator

from kvstore.control.index import PageRecord
from kvstore_client import errors


class Unguessable:
    """Random bytes for lease ids and data-plane tokens, from the OS CSPRNG a block at a time, each byte handed
    out once. A lease is opened under the store's lock, and each os.urandom is a system call that gives up the
    interpreter lock: a busy thread (a put's Reserve) may then keep it for up to its switch interval, 5 ms,
    while the store's lock waits with it."""

    BLOCK_BYTES = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._block, self._at = b"", 0
        os.register_at_fork(after_in_child=self._forget)   # a child never hands out its parent's bytes

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._block, self._at = b"", 0

    def bytes(self, count: int) -> bytes:
        with self._lock:
            if self._at + count > len(self._block):
                self._block, self._at = os.urandom(max(self.BLOCK_BYTES, count)), 0
            self._at += count
            return self._block[self._at - count:self._at]

    def bits64(self) -> int:
        return int.from_bytes(self.bytes(8), "little")


UNGUESSABLE = Unguessable()

READ = "read"
WRITE = "write"
TOKEN_BYTES = 16   # 128 random bits: unguessable, so one client cannot move another's slots


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: int
    kind: str
    namespace_id: int
    deadline: float                      # time.monotonic() after which the lease is expired
    ttl_ms: int
    owner: object | None                 # the connection it ends with, or None
    tenant: str = ""                     # whose lease it is: its namespace's tenant
    pinned: list[PageRecord] = dataclasses.field(default_factory=list)
    # write leases only:
    parent_key: bytes = b""
    anchored: bool = False      # parent_key was absent at Reserve: keys[0] is stored anchored at it
    keys: list[bytes] = dataclasses.field(default_factory=list)
    # key index -> its parent's key where that is not the key before it (Reserve's parent_keys: a chain
    # placed across nodes); such a page is stored anchored at that key when it is absent here
    parents: dict[int, bytes] = dataclasses.field(default_factory=dict)
    slots: dict[int, int] = dataclasses.field(default_factory=dict)  # key index -> offset, not yet committed
    busy: int = 0                        # commits checking bytes outside the lock; not reaped meanwhile
    # data plane (TCP/RDMA): frames for this lease's slots must carry this token
    token: bytes = dataclasses.field(default_factory=lambda: UNGUESSABLE.bytes(TOKEN_BYTES))
    transfers: int = 0                   # data-plane transfers in flight; its memory is freed after the last
    writing: set[int] = dataclasses.field(default_factory=set)  # key indices whose slot is being written
    committing: set[int] = dataclasses.field(default_factory=set)  # key indices a Commit is hashing now
    # key index -> xxh3 the node took of the slot as its last data-plane write landed (TCP); a
    # Commit records it instead of reading the slot again, and a new write to the slot voids it
    arrived: dict[int, int] = dataclasses.field(default_factory=dict)
    rdma_qp_num: int = 0                 # the node's queue pair moving its bytes over RDMA, if any
    ended: bool = False

    def parent_of(self, index: int) -> bytes:
        """The key of the page before keys[index] ("" for a root)."""
        if index in self.parents:
            return self.parents[index]
        return self.keys[index - 1] if index else self.parent_key

    def may_anchor(self, index: int) -> bool:
        """Whether keys[index] is stored anchored at its parent's key when that page is absent."""
        return index in self.parents or (index == 0 and self.anchored)


class LeaseTable:
    def __init__(self, per_tenant_max: int) -> None:
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []
        # Open leases per tenant, capped (leases.per_tenant_max): each holds memory and may pin pages,
        # so one tenant that never releases must not take the node's memory or another tenant's room.
        self._held: collections.Counter[str] = collections.Counter()
        self._per_tenant_max = per_tenant_max

    def __len__(self) -> int:
        return len(self._leases)

    def room(self, tenant: str, count: int = 1) -> None:
        """CapacityExhausted unless `tenant` may open `count` more leases."""
        if self._held[tenant] + count > self._per_tenant_max:
            raise errors.CapacityExhausted(
                f"tenant {tenant!r} holds {self._held[tenant]} open leases, and leases.per_tenant_max is "
                f"{self._per_tenant_max}: release finished gets (Release) and commit or abort puts, or raise it")

    def open(self, kind: str, namespace_id: int, now: float, ttl_ms: int, owner: object | None,
             tenant: str = "") -> Lease:
        self.room(tenant)
        lease_id = 0
        while lease_id == 0 or lease_id in self._leases:
            lease_id = UNGUESSABLE.bits64()
        lease = Lease(lease_id, kind, namespace_id, now + ttl_ms / 1000, ttl_ms, owner, tenant)
        self._leases[lease_id] = lease
        self._held[tenant] += 1
        heapq.heappush(self._deadlines, (lease.deadline, lease_id))
        return lease

    def restart(self, lease: Lease, now: float) -> None:
        """Start the lease's TTL again from `now` (a read lease whose pages took a while to come up)."""
        lease.deadline = now + lease.ttl_ms / 1000
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def close(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        self._held[lease.tenant] -= 1
        if not self._held[lease.tenant]:
            del self._held[lease.tenant]

    def expired(self, now: float) -> Iterator[Lease]:
        """Leases past their deadline and not busy; the caller closes each one it is given."""
        postponed, given = [], set()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is None or lease.deadline > now or lease_id in given:   # gone, restarted, or an older entry
                continue
            if lease.busy:
                postponed.append((deadline, lease_id))
                continue
            given.add(lease_id)
            yield lease
        for entry in postponed:
            heapq.heappush(self._deadlines, entry)

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    def held_by(self, tenant: str) -> int:
        return self._held[tenant]

    def any_owned_by(self, owner: object) -> bool:
        return any(lease.owner is owner for lease in self._leases.values())

    def owned_by(self, owner: object) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.owner is owner]
