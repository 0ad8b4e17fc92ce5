"""Where tenants share one memfd (rdma.enabled with authentication), a reserved slot never shows a page freed before it."""

from __future__ import annotations

import pytest

from kvstore import config
from kvstore.control.service import KVStoreService
from kvstore.control.store import PageStore
from kvstore.tiers.dram import Arena
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import ManualClock

PAGE = 64 << 10
SETTINGS = ["dram.arena_bytes=256KiB", "dram.slab_bytes=256KiB", "auth.tokens_file=/nonexistent/tokens"]


def service_over(tenants_apart: bool) -> KVStoreService:
    cfg = config.load(environ={}, overrides=SETTINGS)
    return KVStoreService(PageStore(cfg, Arena(cfg.dram.arena_bytes, cfg.dram.slab_bytes, tenants_apart=tenants_apart),
                                    ManualClock()))


def reserve(svc: KVStoreService, ns: int, names: list[bytes]) -> pb.ReserveResponse:
    return svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=names, page_bytes=PAGE), None)


@pytest.mark.parametrize("tenants_apart, cleared", [(False, True), (True, False)])
def test_a_freed_slot_is_zeroed_before_it_is_handed_out_again(tenants_apart, cleared):
    svc = service_over(tenants_apart)
    try:
        assert svc.clear_reserved_slots is cleared
        spec = Namespace(model="m", page_bytes=PAGE).to_proto()
        ns = svc.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id
        first = reserve(svc, ns, [b"secret"])
        [offset] = first.offsets
        svc.store.arena.view[offset:offset + PAGE] = b"S" * PAGE
        svc.commit(pb.CommitRequest(lease_id=first.lease_id), None)
        svc.delete(pb.DeleteRequest(namespace_id=ns, keys=[b"secret"]), None)
        again = reserve(svc, ns, [b"other"])            # the freed slot comes back (one slab, LIFO)
        assert list(again.offsets) == [offset]
        left = bytes(svc.store.arena.view[offset:offset + PAGE])
        # Without a memfd per tenant the node clears the slot; with one, a slot stays in its tenant's memfd.
        assert left == (bytes(PAGE) if cleared else b"S" * PAGE)
    finally:
        svc.store.arena.close()
