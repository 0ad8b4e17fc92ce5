"""A page's hit count saturates at one bound in both page indexes (the C one's 32 bits): a page read
past it is still acquired and its lease released, and no setting waits for a count past it."""

import pytest

from kvstore import config
from kvstore.config import PAGE_HITS_MAX
from kvstore.control import native_index
from kvstore.control.index import PageIndex
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import ManualClock, make_service

PAGE = 8192
KEYS = [b"hot0", b"hot1"]


@pytest.fixture
def service(index_kind):
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB"], ManualClock())
    yield svc
    svc.store.arena.close()


def test_the_bound_is_the_c_index_uint32():
    assert PAGE_HITS_MAX == 2**32 - 1


@pytest.mark.parametrize("make", [pytest.param(PageIndex, id="python"),
                                  pytest.param(getattr(native_index, "NativePageIndex", None), id="native",
                                               marks=pytest.mark.skipif(not native_index.available(),
                                                                        reason="kvstore_native is not built"))])
def test_both_indexes_saturate_hits_at_the_bound(make):
    index = make(lambda record: None, lambda record: None)
    record = index.add((1, b"hot"), None, 0, 4096, 0)
    record.hits = PAGE_HITS_MAX - 1
    index.pin_all([record], hit=True)      # the index's count of a hit
    index.pin_all([record], hit=True)
    record.hits += 1                       # the store's
    assert record.hits == PAGE_HITS_MAX and record.pins == 2
    record.hits = 2**70
    assert record.hits == PAGE_HITS_MAX
    index.unpin_all([record, record])
    assert record.pins == 0


def test_a_page_hit_past_the_bound_is_still_acquired_and_its_lease_released(service):
    spec = Namespace(model="m", page_bytes=PAGE).to_proto()
    ns = service.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=KEYS, page_bytes=PAGE), None)
    service.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    records = [service.store.index.get((ns, key)) for key in KEYS]
    for record in records:
        record.hits = PAGE_HITS_MAX - 1
    for _ in range(3):
        got = service.acquire(pb.AcquireRequest(namespace_id=ns, keys=KEYS), None)
        assert got.hit_pages == 2 and got.lease_id and len(service.store.leases) == 1
        assert [service.store.index.get((ns, key)).pins for key in KEYS] == [1, 1]
        service.release(pb.ReleaseRequest(lease_ids=[got.lease_id]), None)
    for key in KEYS:
        record = service.store.index.get((ns, key))
        assert record.hits == PAGE_HITS_MAX and record.pins == 0
    assert len(service.store.leases) == 0


def test_selective_hits_past_the_bound_is_refused_with_its_name():
    assert config.load(environ={}, overrides=[f"controller.selective_hits={PAGE_HITS_MAX}"])
    with pytest.raises(config.ConfigError, match="controller.selective_hits"):
        config.load(environ={}, overrides=[f"controller.selective_hits={PAGE_HITS_MAX + 1}"])
