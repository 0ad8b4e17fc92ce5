"""One tenant holds at most leases.per_tenant_max leases open: the next is refused, its neighbours are not affected."""

from __future__ import annotations

import pytest

from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import ManualClock, make_service

pytestmark = pytest.mark.usefixtures("index_kind")
PAGE = 4096


@pytest.fixture
def service():
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "leases.per_tenant_max=2"], ManualClock())
    yield svc
    svc.store.arena.close()


def open_ns(svc, tenant: str) -> int:
    spec = Namespace(model="m", page_bytes=PAGE, tenant=tenant).to_proto()
    return svc.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id


def reserve(svc, ns: int, key: bytes) -> pb.ReserveResponse:
    return svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=[key], page_bytes=PAGE), None)


def test_a_tenant_over_its_lease_cap_is_refused_and_others_are_not(service):
    alice, bob = open_ns(service, "alice"), open_ns(service, "bob")
    first, second = reserve(service, alice, b"a0"), reserve(service, alice, b"a1")
    with pytest.raises(errors.CapacityExhausted, match="tenant 'alice' holds 2 open leases.*leases.per_tenant_max"):
        reserve(service, alice, b"a2")
    with pytest.raises(errors.CapacityExhausted):   # read leases count too
        service.acquire(pb.AcquireRequest(namespace_id=alice, keys=[b"a0"]), None)
    assert reserve(service, bob, b"b0").lease_id    # a neighbour keeps its room
    service.commit(pb.CommitRequest(lease_id=first.lease_id), None)
    service.abort(pb.AbortRequest(lease_id=second.lease_id), None)
    held = service.acquire(pb.AcquireRequest(namespace_id=alice, keys=[b"a0"]), None)
    assert held.lease_id and held.hit_pages == 1     # room again once its leases ended
    service.release(pb.ReleaseRequest(lease_ids=[held.lease_id]), None)
    assert len(service.store.leases) == 1            # bob's


def test_a_group_acquire_opens_every_part_or_none(service):
    alice = open_ns(service, "alice")
    other = service.open_namespace(pb.OpenNamespaceRequest(
        spec=Namespace(model="m-state", page_bytes=PAGE, tenant="alice").to_proto()), None).namespace_id
    reserve(service, alice, b"a0")
    before = len(service.store.leases)
    with pytest.raises(errors.CapacityExhausted):    # two parts, room for one
        service.store.hold_group([(alice, [b"a0"]), (other, [b"a0"])], 1000, None)
    assert len(service.store.leases) == before
