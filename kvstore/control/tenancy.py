"""Tenancy: what an identity may name in a request, checked before the service does any work.

The tenant comes from the identity, never from the request. OpenNamespace fills in the
caller's tenant (a spec naming another tenant is refused), and since a namespace's id is a
digest of its whole spec, each tenant's pages live in a key space of their own: another
tenant's pages simply do not exist for a caller. A namespace id or lease id of another
tenant is answered exactly as an unknown one (NamespaceNotFound, LeaseNotFound, the same
message, raised on the same path), so a probe learns nothing about what exists. Methods
that touch every tenant (Scrub) or expose the whole arena (RdmaConnect) need the admin role;
an admin may name any tenant. A local connection maps the memfd of its own tenant only
(tiers/dram.py), so its shared-memory Reserve and Acquire name only that tenant's namespaces.
"""

from __future__ import annotations

from typing import Any

from kvstore.control.identity import Identity
from kvstore.control.store import PageStore
from kvstore.control.store_types import lease_not_found, namespace_not_found
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb

# Methods whose request names a namespace by id, and those that name leases.
# ListPages answers the namespace's pages and the caller's own tenant stream (the namespace's tenant).
_BY_NAMESPACE = frozenset({"Lookup", "Reserve", "Acquire", "Delete", "Route", "ListKeys", "ListPages"})
_BY_LEASE = frozenset({"Commit", "Abort", "Release"})
# Methods whose request names several namespaces or leases, one per part (page groups).
_BY_PARTS = frozenset({"CommitGroup", "LookupGroup", "AcquireGroup"})
# What a tenant may call at all: a method added later stays admin-only until its rules are written here.
_TENANT_METHODS = _BY_NAMESPACE | _BY_LEASE | _BY_PARTS | {"Hello", "OpenNamespace", "Stats"}
# Planes whose region is the whole arena (every tenant's pages): an RDMA rkey is handed to admins
# only; a tenant's client moves its pages over shared memory (its own memfd) or TCP.
_WHOLE_ARENA = frozenset({"RdmaConnect", "RdmaDisconnect"})
# Requests that may name such a queue pair (rdma_qp_num): a tenant has none to name.
_NAMING_QUEUE_PAIR = frozenset({"Reserve", "Acquire"})


def admit(store: PageStore, method: str, request: Any, identity: Identity) -> None:
    """Raise what the identity may not do with this request; fill in its tenant where it is implied."""
    if method == "OpenNamespace":
        spec = request.spec
        if not spec.tenant:
            spec.tenant = identity.tenant
        elif spec.tenant != identity.tenant and not identity.admin:
            raise errors.PermissionDenied(
                f"spec.tenant={spec.tenant!r} is not the caller's tenant: leave spec.tenant empty and the node "
                "fills in the tenant of the caller's token")
        return
    if identity.admin:
        return
    if method in _WHOLE_ARENA:
        raise errors.PermissionDenied(f"{method} would expose the whole arena, every tenant's pages: only admin "
                                      "identities connect; use the TCP data plane")
    if method not in _TENANT_METHODS:
        raise errors.PermissionDenied(f"{method} needs the admin role; the caller is tenant {identity.tenant!r}")
    if method in _BY_NAMESPACE:
        own_namespace(store, request.namespace_id, identity)
        if method in _NAMING_QUEUE_PAIR and request.rdma_qp_num:
            raise errors.PermissionDenied(
                "rdma_qp_num names a queue pair of RdmaConnect, which only admin identities open "
                "(a lease naming one keeps it alive and fences it if the lease ends uncommitted): send 0 "
                "and move pages over TCP")
        if method == "Reserve" and request.lease_id:   # extending a lease: it must be the caller's too
            own_lease(store, request.lease_id, identity)
    elif method == "CommitGroup":
        for part in request.parts:
            own_lease(store, part.lease_id, identity)
    elif method in ("LookupGroup", "AcquireGroup"):
        for part in request.parts:
            own_namespace(store, part.namespace_id, identity)
            if getattr(part, "rdma_qp_num", 0):
                raise errors.PermissionDenied("rdma_qp_num names a queue pair of RdmaConnect, which only admin "
                                              "identities open: send 0 and move pages over TCP")
    elif method in ("Commit", "Abort"):
        own_lease(store, request.lease_id, identity)
    elif method == "Release":
        for lease_id in request.lease_ids:
            own_lease(store, lease_id, identity)


def own_arena(store: PageStore, method: str, request: Any, arena: str | None) -> None:
    """Raise if a connection that mapped tenant `arena`'s memfd reserves or acquires pages another memfd
    holds (an admin naming another tenant's namespace): its offsets would point into the wrong memory."""
    if arena is None or method not in ("Reserve", "Acquire", "AcquireGroup"):
        return
    for namespace_id in [p.namespace_id for p in request.parts] if method == "AcquireGroup" else [request.namespace_id]:
        namespace = store.namespaces.get(namespace_id)
        if namespace is not None and store.arena.key(namespace.tenant) != arena:
            raise errors.PermissionDenied(
                f"this local connection mapped the memfd of tenant {arena!r}, which does not hold the pages of "
                f"tenant {namespace.tenant!r}: move them over TCP (KVStoreClient(transport='tcp'))")


def own_namespace(store: PageStore, namespace_id: int, identity: Identity) -> None:
    namespace = store.namespaces.get(namespace_id)
    if namespace is None or _foreign(namespace, identity):
        raise namespace_not_found(namespace_id)


def own_lease(store: PageStore, lease_id: int, identity: Identity) -> None:
    namespace_id = store.lease_namespace(lease_id)
    namespace = store.namespaces.get(namespace_id) if namespace_id is not None else None
    if namespace is not None and _foreign(namespace, identity):
        raise lease_not_found(lease_id)


def _foreign(namespace: Namespace, identity: Identity) -> bool:
    """Another tenant's namespace, which this identity may not name (an admin names any)."""
    return namespace.tenant != identity.tenant and not identity.admin


def tenant_stats(store: PageStore, request: pb.StatsRequest, identity: Identity, most: int) -> pb.StatsResponse:
    """Stats as one tenant sees them: its own namespaces and their pages, nothing node-wide.

    The node's tier counters (hits, misses, fill) sum every tenant's traffic, so they are an
    oracle of what others do; a tenant is shown none of them, only its own TenantStats.
    """
    _, _, namespaces, _ = store.snapshot(0, len(store.namespaces) + 1)
    own = [ns for ns in namespaces if ns.tenant == identity.tenant]
    count = request.namespaces_max or most
    return pb.StatsResponse(namespaces=own[request.namespaces_offset:request.namespaces_offset + count],
                            namespaces_total=len(own), tenants=store.tenant_stats(identity.tenant))


def scoped(method: str, response: Any) -> Any:
    """A tenant's answer: the HBM pool is mapped only by admins, as it holds every tenant's pages."""
    if method == "Hello":
        response.ClearField("hbm")
    return response
