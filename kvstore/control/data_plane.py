"""The data planes' view of the node: a frame's (lease, token, slot, length) resolved to slot bytes.

Transports (kvstore/transport/) know nothing of leases or tiers; they are given this
SlotResolver. A grant holds its slot (neither freed nor reused) until finish_transfer, or
cut_transfer when a write stopped part-way, which ends the lease so the torn page is never
visible. The checks and the holding are the store's; this module only shapes them.

A connection that showed a data ticket (its HELLO) gets its own SlotGrants, bound to that
identity: a lease of another tenant is answered as an unknown one, before any slot is held.
A ticket sealed from a token carries the token's digest, so revoking or expiring that token
refuses the connection's next frame (UNAUTHENTICATED), however long it has been open.
A connection that carries control calls instead of pages serves them as that same identity
(open_calls, tcp_calls.py).
"""

from __future__ import annotations

from kvstore.config import AuthConfig
from kvstore.control import tenancy
from kvstore.control.identity import TRUSTED, Authenticator, Identity, TokenStanding
from kvstore.control.leases import READ, WRITE
from kvstore.control.store import PageStore
from kvstore.control.tcp_calls import ConnectionCalls
from kvstore.transport.slots import Grant
from kvstore_client import errors


class SlotGrants:
    def __init__(self, store: PageStore, auth: Authenticator | None = None, identity: Identity = TRUSTED,
                 service=None):
        """`service`: the KVStoreService that serves control calls (open_calls); None: this node carries none."""
        self._store = store
        self._auth = auth or Authenticator(AuthConfig())
        self._identity = identity
        self._standing = TokenStanding(self._auth, identity)
        self._service = service

    def bind(self, ticket: bytes) -> "SlotGrants":
        grants = SlotGrants(self._store, self._auth, self._auth.ticket_identity(ticket), self._service)
        grants._standing.check("tcp")   # a ticket issued before its token was revoked opens nothing
        return grants

    def open_calls(self) -> ConnectionCalls:
        """The control calls of one connection, served as this resolver's identity."""
        if self._service is None:
            raise errors.TransportUnavailable("this node carries no control calls on its TCP data plane: use gRPC")
        return ConnectionCalls(self._service, self._identity, self._standing)

    def resolve_write(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant:
        """The arena bytes of an uncommitted reserved slot."""
        self._own(lease_id)
        lease, offset, _ = self._store.begin_transfer(lease_id, token, WRITE, slot, nbytes)
        return Grant(lease, slot, self._store.arena.view[offset:offset + nbytes], lease.deadline, True)

    def resolve_read(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant:
        """The arena bytes of the slot-th page pinned by a read lease."""
        self._own(lease_id)
        lease, offset, vouched = self._store.begin_transfer(lease_id, token, READ, slot, nbytes)
        return Grant(lease, slot, self._store.arena.view[offset:offset + nbytes], lease.deadline, False, vouched)

    def finish_transfer(self, grant: Grant, arrived_checksum: int | None = None) -> None:
        self._store.end_transfer(grant.lease, grant.slot, arrived_checksum, grant.vouched)

    def cut_transfer(self, grant: Grant) -> None:
        self._store.cut_transfer(grant.lease, grant.slot)

    def _own(self, lease_id: int) -> None:
        self._standing.check("tcp")
        if not self._identity.admin:
            tenancy.own_lease(self._store, lease_id, self._identity)
