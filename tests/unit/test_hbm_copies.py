"""The HBM tier's rules under random traffic, in process over a real arena, real LMDB shards and a host pool
(the CUDA pool's seam): puts, reads that hold their leases for a while, deletes, write-downs and DRAM
evictions, with the mover run by hand between them. After every step the store's invariants hold
(check_invariants: the index prefix-closed, every HBM copy's page pinned and in DRAM, the copies
prefix-closed, the child counts right), and every copy in the pool holds its page's committed bytes."""

from __future__ import annotations

import hashlib
import random

import pytest

from node_parts import close_node, make_node
from kvstore.control.hbm_mover import HbmMover
from kvstore.control.identity import TRUSTED, Caller
from kvstore.tiers.hbm import HostPool
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb

pytestmark = pytest.mark.usefixtures("index_kind")

PAGE = 32 << 10
POOL = 256 << 10       # 8 pages; DRAM holds 32


def page_of(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (PAGE // 64)


@pytest.fixture
def node(tmp_path):
    svc = make_node(tmp_path, ["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", f"hbm.pool_bytes={POOL}",
                               "hbm.promote_hits=1", "controller.write_policy=write_through"])
    pool = HostPool(0, POOL)
    svc.hbm_mover = HbmMover(svc.store, pool, promote_hits=1, page_bytes_max=PAGE)   # not started: run by hand
    yield svc, pool
    pool.close()
    close_node(svc)


def local_reader() -> Caller:
    caller = Caller(TRUSTED)
    caller.arena = ""          # a connection that mapped the arena: a reader on this host
    return caller


def test_random_traffic_keeps_every_hbm_rule(node):
    svc, pool = node
    store, mover = svc.store, svc.hbm_mover
    ns = svc.open_namespace(pb.OpenNamespaceRequest(spec=Namespace(model="m", page_bytes=PAGE).to_proto()),
                            None).namespace_id
    rng = random.Random(5)
    parents: dict[bytes, bytes] = {}        # every key ever put -> its parent key (b"" for a root)
    held: list[int] = []                     # read leases not yet released
    reader = local_reader()
    answered_from_hbm = refused = 0

    def path(key: bytes) -> list[bytes]:
        keys = [key]
        while parents[keys[-1]]:
            keys.append(parents[keys[-1]])
        return keys[::-1]

    for step in range(600):
        op = rng.random()
        if op < 0.3 or not parents:
            parent = rng.choice([b"", *parents]) if parents and rng.random() < 0.7 else b""
            keys = [f"k{step}.{i}".encode() for i in range(rng.randint(1, 4))]
            try:
                reserved = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, parent_key=parent,
                                                         page_bytes=PAGE), None)
            except errors.CapacityExhausted:     # every slot pinned by leases and copies: a full node's answer
                refused += 1
                continue
            for key, state, offset in zip(keys, reserved.states, reserved.offsets):
                if state == pb.RESERVED:
                    store.arena.view[offset:offset + PAGE] = page_of(key)
            if reserved.lease_id:
                svc.commit(pb.CommitRequest(lease_id=reserved.lease_id), None)
            for key, prior in zip(keys, [parent, *keys]):
                parents[key] = prior
        elif op < 0.65:
            keys = path(rng.choice(list(parents)))
            try:
                answer = svc.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys, hbm_reader=True), reader)
            except errors.CapacityExhausted:     # on NVMe, and DRAM is all pinned: nothing to answer now
                refused += 1
                continue
            for position, offset in enumerate(answer.hbm_offsets):
                if offset >= 0:     # what the pool holds there is the page, while the lease holds it
                    assert pool.read(offset, PAGE) == page_of(keys[position])
                    answered_from_hbm += 1
            if answer.lease_id:
                held.append(answer.lease_id)
            if len(held) > 6:                    # readers finish: at most a few leases at a time
                svc.release(pb.ReleaseRequest(lease_ids=[held.pop(0)]), None)
        elif op < 0.8 and held:
            svc.release(pb.ReleaseRequest(lease_ids=[held.pop(rng.randrange(len(held)))]), None)
        elif op < 0.85:
            svc.delete(pb.DeleteRequest(namespace_id=ns, keys=[rng.choice(list(parents))]), None)
        elif op < 0.92:
            svc.controller.clean(8)            # written down: their DRAM copies may be dropped for room
        else:
            while mover._offered:
                batch = list(mover._offered)[:16]
                for record in batch:
                    del mover._offered[record]
                mover._move(batch)
            store.hbm_sweep(0)
        store.check_invariants()
        for record, (offset, _) in list(store._hbm.items()):
            if record.alive:
                assert pool.read(offset, PAGE) == page_of(record.page_id[1])
    copies, used, capacity = store.hbm_usage()
    assert answered_from_hbm > 50 and store.hbm_counters.demotions > 0 and capacity == POOL, \
        (answered_from_hbm, store.hbm_counters, refused)
    svc.release(pb.ReleaseRequest(lease_ids=held), None)
    for _ in range(4):
        store.hbm_sweep(0)
    store.check_invariants()
