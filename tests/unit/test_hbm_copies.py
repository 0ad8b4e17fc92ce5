"""The HBM tier's rules under random traffic, in process over a real arena, real LMDB shards and a host pool
(the CUDA pool's seam): puts of two page sizes (some anchored at absent parents), GPU reads that hold their
leases a while, deletes, write-downs and DRAM evictions, under write-through and write-back, with the mover
run by hand between them. After every step the store's invariants hold (check_invariants: the index
prefix-closed; the copies prefix-closed and where they were copied; child counts, leaves and the pool's used
bytes as the copies make them), every copy in the pool holds its page's committed bytes, and every page a
still-open lease was answered from the pool still reads as it did."""

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

SIZES = (32 << 10, 16 << 10)
POOL = 256 << 10       # 8 to 16 pages; DRAM holds 32 to 64


def page_of(key: bytes, size: int) -> bytes:
    return hashlib.blake2b(key, digest_size=64).digest() * (size // 64)


@pytest.fixture(params=["write_through", "write_back"])
def node(tmp_path, request):
    svc = make_node(tmp_path, ["dram.arena_bytes=1MiB", "dram.slab_bytes=128KiB", f"hbm.pool_bytes={POOL}",
                               "hbm.promote_hits=1", f"controller.write_policy={request.param}"])
    pool = HostPool(0, POOL)
    svc.hbm_mover = HbmMover(svc.store, pool, promote_hits=1, page_bytes_max=max(SIZES))   # run by hand
    yield svc, pool
    pool.close()
    close_node(svc)


def local_gpu_reader() -> Caller:
    caller = Caller(TRUSTED)
    caller.arena = ""          # a connection that mapped the arena: a reader on this host
    return caller


@pytest.mark.parametrize("seed", [5, 6])
def test_random_traffic_keeps_every_hbm_rule(node, seed):
    svc, pool = node
    store, mover = svc.store, svc.hbm_mover
    namespaces = {size: svc.open_namespace(pb.OpenNamespaceRequest(
        spec=Namespace(model=f"m{size}", page_bytes=size).to_proto()), None).namespace_id for size in SIZES}
    rng = random.Random(seed)
    parents: dict[tuple[int, bytes], bytes] = {}   # (size, key) of every key ever put -> its parent key
    held: dict[int, list[tuple[int, bytes]]] = {}  # open read leases -> (pool offset, bytes) answered from HBM
    reader = local_gpu_reader()
    answered_from_hbm = refused = anchored = 0

    def path(size: int, key: bytes) -> list[bytes]:
        keys = [key]
        while parents.get((size, keys[-1])):
            keys.append(parents[(size, keys[-1])])
        return keys[::-1]

    for step in range(700):
        size = rng.choice(SIZES)
        ns, known = namespaces[size], [k for s, k in parents if s == size]
        op = rng.random()
        if op < 0.3 or not known:
            parent = rng.choice(known) if known and rng.random() < 0.7 else b""
            anchor = rng.random() < 0.1
            if anchor:     # a parent the node may not hold: the page is stored anchored at it
                parent, anchored = b"gone%d" % step, anchored + 1
            keys = [f"k{step}.{i}".encode() for i in range(rng.randint(1, 4))]
            try:
                reserved = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, parent_key=parent,
                                                         page_bytes=size, anchor_absent_parent=anchor), None)
            except errors.CapacityExhausted:     # every slot leased or unsaved: a full node's answer
                refused += 1
                continue
            for key, state, offset in zip(keys, reserved.states, reserved.offsets):
                if state == pb.RESERVED:
                    store.arena.view[offset:offset + size] = page_of(key, size)
            if reserved.lease_id:
                svc.commit(pb.CommitRequest(lease_id=reserved.lease_id), None)
            for key, prior in zip(keys, [b"" if anchor else parent, *keys]):
                parents[(size, key)] = prior
        elif op < 0.65:
            keys = path(size, rng.choice(known))
            try:
                answer = svc.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys, hbm_reader=True), reader)
            except errors.CapacityExhausted:     # on NVMe, and DRAM is all pinned: nothing to answer now
                refused += 1
                continue
            seen = []
            for position, offset in enumerate(answer.hbm_offsets):
                if offset >= 0:
                    assert pool.read(offset, size) == page_of(keys[position], size)
                    seen.append((offset, page_of(keys[position], size)))
            answered_from_hbm += len(seen)
            if answer.lease_id:
                held[answer.lease_id] = seen
            if len(held) > 6:                    # readers finish: a few leases open at a time
                svc.release(pb.ReleaseRequest(lease_ids=[next(iter(held))]), None)
                held.pop(next(iter(held)))
        elif op < 0.8 and held:
            lease_id = rng.choice(list(held))
            svc.release(pb.ReleaseRequest(lease_ids=[lease_id]), None)
            held.pop(lease_id)
        elif op < 0.85:
            svc.delete(pb.DeleteRequest(namespace_id=ns, keys=[rng.choice(known)]), None)
        elif op < 0.92:
            svc.controller.clean(8)              # written down: their DRAM copies may be dropped for room
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
                size = next(s for s, n in namespaces.items() if n == record.page_id[0])
                assert pool.read(offset, size) == page_of(record.page_id[1], size)
        for seen in held.values():              # a leased copy is never dropped nor its slot reused
            assert all(pool.read(offset, len(data)) == data for offset, data in seen)
    counters = store.hbm_counters
    assert answered_from_hbm > 20 and counters.demotions > 0 and anchored > 0, (answered_from_hbm, counters)
    svc.release(pb.ReleaseRequest(lease_ids=list(held)), None)
    store.hbm_sweep(0)
    store.check_invariants()


def test_the_mover_thread_and_readers_at_once_keep_every_rule(node):
    """The mover on its own thread while two reader threads put, read as GPU engines and delete at once:
    every byte a reader is answered from the pool is its page's, and the invariants hold at the end."""
    import threading
    import time

    svc, pool = node
    store, mover = svc.store, svc.hbm_mover
    size = SIZES[0]
    ns = svc.open_namespace(pb.OpenNamespaceRequest(spec=Namespace(model="t", page_bytes=size).to_proto()),
                            None).namespace_id
    wrong: list[str] = []
    answered = [0]

    def work(seed: int) -> None:
        rng = random.Random(seed)
        reader = local_gpu_reader()
        for _ in range(300):
            time.sleep(0.002)      # the mover gets its turns (the GIL): its copies land between reads
            chain = rng.randrange(6)
            keys = [f"c{seed}.{chain}.{i}".encode() for i in range(rng.randint(1, 4))]
            op = rng.random()
            try:
                if op < 0.3:
                    reserved = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, page_bytes=size), None)
                    for key, state, offset in zip(keys, reserved.states, reserved.offsets):
                        if state == pb.RESERVED:
                            store.arena.view[offset:offset + size] = page_of(key, size)
                    if reserved.lease_id:
                        svc.commit(pb.CommitRequest(lease_id=reserved.lease_id), None)
                elif op < 0.9:
                    answer = svc.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys, hbm_reader=True), reader)
                    for position, offset in enumerate(answer.hbm_offsets):
                        if offset >= 0:
                            answered[0] += 1
                            if pool.read(offset, size) != page_of(keys[position], size):
                                wrong.append(f"{keys[position]!r} at {offset}")
                    if answer.lease_id:
                        svc.release(pb.ReleaseRequest(lease_ids=[answer.lease_id]), None)
                else:
                    svc.delete(pb.DeleteRequest(namespace_id=ns, keys=keys[:1]), None)
            except (errors.CapacityExhausted, errors.LeaseNotFound):
                continue

    mover.start()
    try:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        reader, keys = local_gpu_reader(), [b"last.0", b"last.1"]   # one read more once the mover is idle
        reserved = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, page_bytes=size), None)
        for key, offset in zip(keys, reserved.offsets):
            store.arena.view[offset:offset + size] = page_of(key, size)
        svc.commit(pb.CommitRequest(lease_id=reserved.lease_id), None)
        for _ in range(2):
            answer = svc.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys, hbm_reader=True), reader)
            for offset, key in zip(answer.hbm_offsets, keys):
                answered[0] += offset >= 0
                assert offset < 0 or pool.read(offset, size) == page_of(key, size)
            svc.release(pb.ReleaseRequest(lease_ids=[answer.lease_id]), None)
            while not mover.idle():
                time.sleep(0.01)
    finally:
        mover.stop()
    assert not wrong, wrong[:5]
    assert answered[0] > 0 and mover.alive() is False, (answered, store.hbm_counters, store.hbm_usage())
    store.hbm_sweep(0)
    store.check_invariants()
