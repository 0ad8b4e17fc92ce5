"""A lease that runs out is counted and logged once, however often its TTL was restarted; an Acquire
naming no PrefetchPolicy is refused before any work."""

from __future__ import annotations

import pytest

from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import ManualClock, make_service

pytestmark = pytest.mark.usefixtures("index_kind")
PAGE = 4096


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def service(clock):
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB"], clock)
    yield svc
    svc.store.arena.close()


def stored(svc) -> int:
    ns = svc.open_namespace(pb.OpenNamespaceRequest(spec=Namespace(model="m", page_bytes=PAGE).to_proto()),
                            None).namespace_id
    lease = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"k"], page_bytes=PAGE), None)
    svc.commit(pb.CommitRequest(lease_id=lease.lease_id), None)
    return ns


def test_an_unreleased_read_lease_is_counted_once_when_it_expires(service, clock, caplog):
    ns = stored(service)
    held = service.acquire(pb.AcquireRequest(namespace_id=ns, keys=[b"k"]), None)
    assert held.hit_pages == 1
    clock.advance(service.config.leases.read_ttl_ms / 1000 + 1)
    with caplog.at_level("INFO", logger="kvstore.control.service"):
        assert service.reap_expired() == 1
    assert service.store.counters.leases_expired == 1
    assert sum("lease expired" in r.getMessage() for r in caplog.records) == 1
    assert len(service.store.leases) == 0


@pytest.mark.parametrize("policy", [3, 99, -1])
def test_an_acquire_with_an_undefined_policy_is_refused(service, policy):
    ns = stored(service)
    with pytest.raises(errors.InvalidArgument, match=rf"policy={policy} is not a PrefetchPolicy.*WAIT_COMPLETE"):
        service.acquire(pb.AcquireRequest(namespace_id=ns, keys=[b"k"], policy=policy), None)
    part = pb.AcquireRequest(namespace_id=ns, keys=[b"k"], policy=policy)
    with pytest.raises(errors.InvalidArgument, match=rf"parts\[0\].policy={policy}"):
        service.acquire_group(pb.AcquireGroupRequest(parts=[part]), None)
    assert len(service.store.leases) == 0
