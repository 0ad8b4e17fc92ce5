"""The node core's defects stay fixed: promotion sizes, duplicate prefetch, a get's own chain, no disk
I/O under the store's lock, durable commits, limits checked before work, bounded resources, scrubbing."""

import hashlib
import os
import threading
import time

import pytest

from kvstore.control import checks
from kvstore.control.store_types import NAMESPACES_MAX
from kvstore.tiers.nvme import record_key
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import ManualClock, close_node, drop_dram_copies, make_node, make_service, write_all_down

pytestmark = pytest.mark.usefixtures("index_kind")

SMALL, BIG = 8 << 10, 64 << 10
NODE = ["dram.arena_bytes=2MiB", "dram.slab_bytes=256KiB", "limits.page_bytes_max=64KiB",
        "nvme.map_bytes=64MiB", "controller.write_policy=write_through"]


def content(ns_id: int, key: bytes, page_bytes: int) -> bytes:
    """Bytes derived from the page's identity, so any page can be checked anywhere."""
    seed = hashlib.sha256(ns_id.to_bytes(8, "little") + key).digest()
    return (seed * (page_bytes // len(seed) + 1))[:page_bytes]


def open_ns(svc, page_bytes, model="m", tenant=""):
    spec = Namespace(model=model, page_bytes=page_bytes, tenant=tenant).to_proto()
    return svc.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id


def put(svc, ns, keys, page_bytes, parent=b"", durable=False):
    r = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, parent_key=parent, page_bytes=page_bytes), None)
    view = svc.store.arena.view
    for key, state, offset in zip(keys, r.states, r.offsets):
        if state == pb.RESERVED:
            view[offset:offset + page_bytes] = content(ns, key, page_bytes)
    if r.lease_id:
        return svc.commit(pb.CommitRequest(lease_id=r.lease_id, durable=durable), None)
    return None


def get(svc, ns, keys, page_bytes, policy=pb.WAIT_COMPLETE):
    """Acquire, check every page's bytes against its key, release; returns pages served."""
    a = svc.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys, policy=policy), None)
    view = svc.store.arena.view
    for key, offset in zip(keys, a.offsets[:a.hit_pages]):
        assert bytes(view[offset:offset + page_bytes]) == content(ns, key, page_bytes), f"wrong bytes for {key}"
    if a.lease_id:
        svc.release(pb.ReleaseRequest(lease_ids=[a.lease_id]), None)
    return a.hit_pages


def chain(name, n):
    return [f"{name}-{i}".encode() for i in range(n)]


@pytest.fixture
def node(tmp_path):
    svc = make_node(tmp_path, NODE)
    yield svc
    close_node(svc)


def test_promotion_gives_each_page_a_slot_of_its_own_size(node):
    small, big = open_ns(node, SMALL, "small"), open_ns(node, BIG, "big")
    small_keys, big_keys = chain("s", 8), chain("b", 8)
    put(node, small, small_keys, SMALL)
    put(node, big, big_keys, BIG)
    write_all_down(node)
    drop_dram_copies(node)
    index = node.store.index
    # One promotion of both namespaces' pages, the small ones first (as a shared prefetch queue holds them).
    records = [index.get((small, k)) for k in small_keys] + [index.get((big, k)) for k in big_keys]
    assert node.controller.promote(records, deadline=float("inf")) == (16, 0)
    assert node.counters.corrupt_pages == 0
    assert get(node, small, small_keys, SMALL) == 8 and get(node, big, big_keys, BIG) == 8
    node.store.check_invariants()


def test_a_page_wanted_twice_is_promoted_once_and_nothing_leaks(node):
    ns = open_ns(node, SMALL)
    keys = chain("d", 6)
    put(node, ns, keys, SMALL)
    write_all_down(node)
    drop_dram_copies(node)
    records = [node.store.index.get((ns, k)) for k in keys]
    node.controller.on_wanted(records)
    node.controller.on_wanted(records[2:])      # a second get sharing the chain
    prefetch = list(node.controller._prefetch)
    assert len(prefetch) == len(keys)
    assert node.controller.promote(records + records[2:], deadline=float("inf")) == (len(keys), 0)
    assert get(node, ns, keys, SMALL) == len(keys)
    node.delete(pb.DeleteRequest(namespace_id=ns, all_pages=True), None)
    assert node.store.allocator.used_bytes == 0, "a slot or pin leaked"


def test_a_get_never_evicts_its_own_chain(node):
    ns = open_ns(node, BIG)
    keys = chain("c", 24)                       # 1.5 MiB of a 2 MiB arena
    put(node, ns, keys, BIG)
    write_all_down(node)
    drop_dram_copies(node)
    put(node, ns, chain("head", 4), BIG)        # unrelated pages keep some of DRAM
    node.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys[:6]), None)   # head in DRAM, leased
    served = get(node, ns, keys, BIG)
    lookup = node.lookup(pb.LookupRequest(namespace_id=ns, keys=keys), None).hit_pages
    assert lookup == len(keys)
    assert served >= 6, f"the get evicted its own chain's head: served {served}"


def test_write_back_makes_room_with_no_disk_io_under_the_lock(tmp_path):
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back"])
    writes_under_lock = []
    real_write = svc.nvme.write

    def write(shard, pages):
        writes_under_lock.append(svc.store._lock.locked())
        return real_write(shard, pages)

    svc.nvme.write = write
    ns = open_ns(svc, BIG)
    for i in range(12):                          # 96 pages of 64 KiB into a 2 MiB arena
        put(svc, ns, chain(f"w{i}", 8), BIG)
    assert writes_under_lock and not any(writes_under_lock), "a write-down ran under the store's lock"
    assert svc.counters.evictions > 0 and svc.counters.demotions > 0
    lost = [i for i in range(12) if svc.lookup(pb.LookupRequest(namespace_id=ns, keys=chain(f"w{i}", 8)),
                                               None).hit_pages < 8]
    assert not lost, f"write_back lost committed chains {lost}"
    close_node(svc)


def test_write_back_keeps_a_hot_page_in_dram_once_it_is_on_nvme(tmp_path):
    """Under write_back, DRAM short of slots drops a page already on NVMe only while it is older than every unsaved
    page; else the oldest unsaved pages are written down and dropped. A page read all along stays in DRAM."""
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back"])
    ns = open_ns(svc, BIG)
    put(svc, ns, [b"hot"], BIG)
    write_all_down(svc)                          # on NVMe: the one page DRAM could drop without writing
    for i in range(12):                          # 96 unsaved pages of 64 KiB through a 2 MiB arena
        put(svc, ns, chain(f"w{i}", 8), BIG)
        assert get(svc, ns, [b"hot"], BIG) == 1  # read between the puts: the most recently used page
    assert svc.counters.evictions > 0 and svc.counters.demotions > 0
    assert svc.counters.promotions == 0, "the hot page was dropped from DRAM and read back from NVMe"
    assert svc.counters.dram_hits == 12
    close_node(svc)


def test_write_back_that_can_write_nothing_down_drops_a_page_on_nvme_before_an_unsaved_one(tmp_path):
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back"])
    ns = open_ns(svc, BIG)
    put(svc, ns, [b"saved"], BIG)
    write_all_down(svc)
    for shard in svc.nvme.shards:                # damaged disks: cut short, each shard is quarantined at its
        os.truncate(os.path.join(shard.path, "data.mdb"), 4096)   # next write, and nothing more is written down
    for i in range(3):
        put(svc, ns, chain(f"w{i}", 8), BIG)     # 25 of the arena's 32 slots
    assert get(svc, ns, [b"saved"], BIG) == 1    # now newer than every unsaved page
    put(svc, ns, chain("w3", 8), BIG)            # one slot short
    held = [svc.lookup(pb.LookupRequest(namespace_id=ns, keys=chain(f"w{i}", 8)), None).hit_pages for i in range(4)]
    assert held == [8] * 4, f"an unsaved page was dropped while a page on NVMe could go: {held}"
    assert svc.lookup(pb.LookupRequest(namespace_id=ns, keys=[b"saved"]), None).hit_pages == 1   # on NVMe
    close_node(svc)


def test_a_durable_commit_answers_once_its_pages_are_on_disk(node, tmp_path):
    ns = open_ns(node, SMALL)
    keys = chain("dur", 5)
    answer = put(node, ns, keys, SMALL, durable=True)
    assert answer.durable_pages == 5
    on_disk = 0
    for shard in node.nvme.shards:               # what a committed LMDB read transaction sees
        with shard.env.begin() as txn:
            on_disk += sum(txn.get(record_key(ns, k), db=shard.data) == content(ns, k, SMALL) for k in keys)
    assert on_disk == 5


def test_a_durable_commit_needs_the_nvme_tier():
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB"], ManualClock())
    ns = open_ns(svc, SMALL)
    r = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"k"], page_bytes=SMALL), None)
    with pytest.raises(errors.InvalidArgument, match="NVMe"):
        svc.commit(pb.CommitRequest(lease_id=r.lease_id, durable=True), None)


def test_a_token_lookup_is_sized_before_any_token_is_hashed(node, monkeypatch):
    spec = Namespace(model="t", page_bytes=SMALL, page_tokens=16).to_proto()
    ns = node.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id
    hashed = []
    monkeypatch.setattr(checks, "prefix_hashes", lambda *a: hashed.append(a) or [])
    tokens = [1] * (16 * (node.limits.lookup_pages_max + 1))
    with pytest.raises(errors.BatchTooLarge, match="split"):
        node.lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens), None)
    assert not hashed


def test_namespace_names_are_bounded(node):
    with pytest.raises(errors.InvalidArgument, match="name_bytes_max"):
        open_ns(node, SMALL, model="m" * 50_000_000)


def test_idle_namespaces_are_reclaimed_and_busy_ones_are_not(tmp_path):
    svc = make_node(tmp_path, NODE + ["limits.namespaces_per_tenant_max=4"])
    kept = open_ns(svc, SMALL, "kept", tenant="a")
    put(svc, kept, [b"k"], SMALL)
    for i in range(50):                          # junk: opened, never used
        open_ns(svc, SMALL, f"junk{i}", tenant="a")
    assert open_ns(svc, SMALL, "new-model", tenant="a")
    assert svc.lookup(pb.LookupRequest(namespace_id=kept, keys=[b"k"]), None).hit_pages == 1
    for i in range(3):
        put(svc, open_ns(svc, SMALL, f"busy{i}", tenant="a"), [b"k"], SMALL)
    with pytest.raises(errors.CapacityExhausted, match="namespaces_per_tenant_max"):
        open_ns(svc, SMALL, "one-too-many", tenant="a")
    assert open_ns(svc, SMALL, "other-tenant", tenant="b")
    assert len(svc.store.namespaces) <= NAMESPACES_MAX
    close_node(svc)


def test_waits_are_capped_by_promote_wait_ms_max(node):
    request = pb.AcquireRequest(policy=pb.TIMEOUT, timeout_ms=10**9)
    assert checks.promote_wait_s(request, node.config) == node.config.controller.promote_wait_ms_max / 1000


def test_stats_answers_namespaces_in_pages(tmp_path):
    svc = make_node(tmp_path, NODE + ["limits.stats_namespaces_max=20"])
    ids = sorted(open_ns(svc, SMALL, f"m{i}") for i in range(50))
    first = svc.stats(pb.StatsRequest(), None)
    assert first.namespaces_total == 50 and len(first.namespaces) == 20
    seen = []
    for offset in range(0, 50, 20):
        seen += [n.namespace_id for n in svc.stats(pb.StatsRequest(namespaces_offset=offset), None).namespaces]
    assert seen == ids
    with pytest.raises(errors.InvalidArgument, match="stats_namespaces_max"):
        svc.stats(pb.StatsRequest(namespaces_max=21), None)
    close_node(svc)


def test_the_scrubber_drops_pages_whose_bytes_rotted(node, tmp_path):
    ns = open_ns(node, SMALL)
    keys = chain("rot", 6)
    put(node, ns, keys, SMALL)
    write_all_down(node)
    rotten_in_dram = node.store.index.get((ns, keys[4]))
    node.store.arena.view[rotten_in_dram.offset] ^= 0xFF
    # And one page's NVMe copy: its DRAM copy is dropped, and the disk bytes overwritten.
    drop_dram_copies(node)
    rotten_on_disk = keys[2]
    shard = node.nvme.shards[node.nvme.shard_of(ns, rotten_on_disk)]
    with shard.env.begin(write=True) as txn:
        txn.put(record_key(ns, rotten_on_disk), b"\0" * SMALL, db=shard.data)
    checked, bad = node.scrubber.run_pass()
    assert checked == 6 and bad >= 1
    stats = node.stats(pb.StatsRequest(), None)
    assert stats.scrub_pages_checked == 6 and stats.scrub_pages_bad == bad and stats.scrub_passes == 1
    assert get(node, ns, keys, SMALL) == 2, "the chain ends before the page that rotted on disk"


def test_concurrent_gets_of_shared_chains_never_serve_wrong_bytes(node):
    """Many gets racing promotions of chains that share their head, over two page sizes."""
    small, big = open_ns(node, SMALL, "small"), open_ns(node, BIG, "big")
    shared = chain("shared", 4)
    for i in range(6):
        put(node, small, shared + chain(f"s{i}", 4), SMALL)
        put(node, big, shared + chain(f"b{i}", 2), BIG)
    write_all_down(node)
    drop_dram_copies(node)
    failures = []

    def reader(i):
        try:
            for round_ in range(10):
                policy = pb.BEST_EFFORT if round_ % 2 else pb.WAIT_COMPLETE
                get(node, small, shared + chain(f"s{(i + round_) % 6}", 4), SMALL, policy)
                get(node, big, shared + chain(f"b{(i + round_) % 6}", 2), BIG, policy)
                for records in (list(node.controller._prefetch),):
                    node.controller._prefetch.clear()
                    node.controller.promote(records, deadline=float("inf"))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert node.counters.corrupt_pages == 0
    node.delete(pb.DeleteRequest(namespace_id=small, all_pages=True), None)
    node.delete(pb.DeleteRequest(namespace_id=big, all_pages=True), None)
    assert node.store.allocator.used_bytes == 0 and node.store.open_leases() == 0
    node.store.check_invariants()


def test_gets_beyond_the_waiter_cap_are_answered_best_effort(tmp_path):
    svc = make_node(tmp_path, NODE)
    ns = open_ns(svc, SMALL)
    keys = chain("wait", 4)
    put(svc, ns, keys, SMALL)
    write_all_down(svc)
    drop_dram_copies(svc)
    while svc.controller.take_waiter():          # every waiting place taken (by slow gets, say)
        pass
    assert get(svc, ns, keys, SMALL) == 0        # answered at once with what DRAM holds
    assert len(svc.controller._prefetch) == 4    # and the rest is promoted in the background
    svc.controller.leave_waiter()
    assert get(svc, ns, keys, SMALL) == 4
    close_node(svc)


def test_a_delete_answers_only_once_a_write_down_in_flight_cannot_bring_its_pages_back(node):
    ns = open_ns(node, SMALL)
    keys = chain("del", 3)
    put(node, ns, keys, SMALL)
    written, release = threading.Event(), threading.Event()
    real_write = node.nvme.write

    def write_then_stall(shard, pages):          # a write-down whose LMDB commit is done, not yet told
        real_write(shard, pages)
        written.set()
        release.wait(10)

    node.nvme.write = write_then_stall
    batch = node.store.claim_unsaved([node.store.index.get((ns, k)) for k in keys], 10)
    writer = threading.Thread(target=node.controller._write_down, args=(batch,))
    writer.start()
    assert written.wait(10)
    deleter = threading.Thread(target=node.delete, args=(pb.DeleteRequest(namespace_id=ns, all_pages=True), None))
    deleter.start()
    deleter.join(1.0)

    def on_disk():
        found = 0
        for shard in node.nvme.shards:
            with shard.env.begin() as txn:
                found += sum(txn.get(record_key(ns, k), db=shard.data) is not None for k in keys)
        return found

    answered_early = not deleter.is_alive()
    assert not (answered_early and on_disk()), "Delete answered while its pages were on disk"
    release.set()
    writer.join(10)
    deleter.join(10)
    assert on_disk() == 0


def test_a_key_claimed_by_a_reservation_in_progress_is_in_flight_for_everyone_else(node):
    """Reserve finds slots in a second lock section; the keys it wants are claimed in the first."""
    from kvstore.control.store_types import Evict

    ns = open_ns(node, SMALL)
    first = node.store.reserve(ns, [b"k"], b"", 0, 1000, None)        # step one only, as a slow Reserve
    second = node.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"k"], page_bytes=SMALL), None)
    assert list(second.states) == [pb.IN_FLIGHT]
    node.store.fill(first, Evict.ANY)
    node.store.finish_reservation(first)
    node.store.arena.view[first.offsets[0]:first.offsets[0] + SMALL] = content(ns, b"k", SMALL)
    node.commit(pb.CommitRequest(lease_id=first.lease.lease_id), None)
    assert get(node, ns, [b"k"], SMALL) == 1
    short = node.store.reserve(ns, [b"j"], b"k", 0, 1000, None)        # a claim that gets no slot ...
    with pytest.raises(errors.CapacityExhausted):
        node.store.finish_reservation(short)
    again = node.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"j"], parent_key=b"k", page_bytes=SMALL), None)
    assert list(again.states) == [pb.RESERVED]                          # ... is given back


def test_a_read_lease_runs_its_ttl_from_the_answer_not_from_before_promotion(tmp_path):
    clock = ManualClock()
    svc = make_node(tmp_path, NODE + ["leases.read_ttl_ms=1000"], clock)
    ns = open_ns(svc, SMALL)
    keys = chain("ttl", 3)
    put(svc, ns, keys, SMALL)
    write_all_down(svc)
    drop_dram_copies(svc)
    real_promote = svc.controller.promote

    def slow_promote(records, deadline):      # the disk took 0.9 s of the 1 s TTL
        clock.advance(0.9)
        return real_promote(records, deadline)

    svc.controller.promote = slow_promote
    acquired = svc.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys), None)
    assert acquired.hit_pages == 3
    clock.advance(0.5)
    assert svc.reap_expired() == 0, "the lease expired 0.5 s after it was answered"
    clock.advance(0.6)
    assert svc.reap_expired() == 1
    close_node(svc)


def test_no_data_plane_write_starts_while_a_commit_hashes_its_slots(node, monkeypatch):
    """Else the page would be published with the checksum of bytes that are then overwritten."""
    from kvstore.control import store_writes as store_module   # where commits hash their slots

    ns = open_ns(node, SMALL)
    r = node.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"k"], page_bytes=SMALL), None)
    hashing, go_on = threading.Event(), threading.Event()
    real_hash = store_module.xxhash.xxh3_64_intdigest

    def slow_hash(data):
        hashing.set()
        go_on.wait(10)
        return real_hash(data)

    monkeypatch.setattr(store_module.xxhash, "xxh3_64_intdigest", slow_hash)
    committer = threading.Thread(target=node.commit, args=(pb.CommitRequest(lease_id=r.lease_id), None))
    committer.start()
    assert hashing.wait(10)
    with pytest.raises(errors.SlotBusy):
        node.grants.resolve_write(r.lease_id, r.data_token, 0, SMALL)
    with pytest.raises(errors.SlotBusy):
        node.commit(pb.CommitRequest(lease_id=r.lease_id, indices=[0]), None)
    go_on.set()
    committer.join(10)
    assert node.lookup(pb.LookupRequest(namespace_id=ns, keys=[b"k"]), None).hit_pages == 1


def test_a_chain_longer_than_a_write_down_batch_is_written_from_its_saved_end(tmp_path):
    # Making the last 8 pages of a 6,000-page unsaved chain durable needs every page before them on
    # NVMe first; no claim walks more than a batch of the chain, yet the whole chain gets there.
    svc = make_node(tmp_path, ["dram.arena_bytes=4MiB", "dram.slab_bytes=256KiB", "nvme.map_bytes=64MiB",
                               "controller.write_policy=write_back"])
    try:
        ns, keys = open_ns(svc, 256), chain("long", 6000)
        for start in range(0, len(keys), 1000):
            put(svc, ns, keys[start:start + 1000], 256, parent=keys[start - 1] if start else b"")
        tail = [svc.store.index.get((ns, k)) for k in keys[-8:]]
        assert not any(r.on_nvme for r in tail)
        assert svc.controller.make_durable(tail, deadline=time.monotonic() + 60) == 8
        assert all(svc.store.index.get((ns, k)).on_nvme for k in keys)
        assert sum(get(svc, ns, keys[i:i + 1000], 256) for i in range(0, len(keys), 1000)) == len(keys)
    finally:
        close_node(svc)


def test_pages_written_to_disk_whose_parent_is_not_on_nvme_are_deleted_from_it(node):
    ns = open_ns(node, SMALL)
    keys = chain("orphan", 2)
    put(node, ns, keys, SMALL)
    parent, child = (node.store.index.get((ns, k)) for k in keys)
    batch = node.store.claim_unsaved([child], 10)
    assert batch == [parent, child]
    written, garbage = node.store.finish_writedown(batch, {child: 0})    # the parent's shard write failed
    assert written == [] and garbage == [child.page_id] and not child.on_nvme
    node.store.nvme_deleted(garbage)


def test_a_get_that_waited_for_commits_still_has_its_time_to_promote(node):
    # wait_ms (pages not yet committed) and timeout_ms (pages coming up from NVMe) are two budgets:
    # the wait for a tail nobody commits must not use up the promotion of the head.
    ns = open_ns(node, SMALL)
    keys = chain("handoff", 3)
    put(node, ns, keys, SMALL)
    write_all_down(node)
    drop_dram_copies(node)
    a = node.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys + [b"never-committed"], wait_ms=300,
                                       policy=pb.TIMEOUT, timeout_ms=200), None)
    assert a.hit_pages == 3 and a.promoted_pages == 3
    node.release(pb.ReleaseRequest(lease_ids=[a.lease_id]), None)
    node.store.check_invariants()


def test_a_page_deleted_while_claimed_for_write_down_is_not_written(tmp_path):
    """Else a deleted page (whose parent the C index reads as None once removed) could reach NVMe as a
    root, and come back as one after a restart that cut its garbage delete short."""
    node = make_node(tmp_path, [*NODE, "controller.write_policy=write_back"])
    try:
        ns = open_ns(node, SMALL)
        keys = chain("d", 3)
        put(node, ns, keys, SMALL)
        records = [node.store.index.get((ns, key)) for key in keys]
        batch = node.store.claim_unsaved(records, 8)
        assert batch == records
        node.delete(pb.DeleteRequest(namespace_id=ns, keys=[keys[1]]), None)   # takes keys[2] with it
        written, write = [], node.nvme.write
        def recording_write(shard, pages):   # the real LMDB write, and what it was given
            written.extend((page.key, page.parent_key) for page, _ in pages)
            return write(shard, pages)
        node.nvme.write = recording_write
        assert [r.page_id[1] for r in node.controller._write_down(batch)] == [keys[0]]
        assert written == [(keys[0], b"")]
        assert len(list(node.nvme.scan())) == 1
        node.store.check_invariants()
    finally:
        close_node(node)


def test_a_write_down_writes_its_shards_at_once_and_returns_once_each_is_over(node):
    """A batch over both shards: the first shard's transaction waits until the other's has been written, which
    only a write of its own can let happen; the write-down answers after both, with every page on NVMe."""
    ns = open_ns(node, SMALL)
    keys = chain("both", 16)
    put(node, ns, keys, SMALL)
    first = node.nvme.shard_of(ns, keys[0])      # written first where shards take turns
    assert {node.nvme.shard_of(ns, k) for k in keys} == {0, 1}
    other_written, write = threading.Event(), node.nvme.write
    overlapped = []

    def write_after_the_other(shard, pages):
        if shard == first:
            overlapped.append(other_written.wait(10))
        write(shard, pages)
        if shard != first:
            other_written.set()

    node.controller._nvme.write = write_after_the_other
    try:
        assert node.controller.make_durable([node.store.index.get((ns, k)) for k in keys], time.monotonic() + 30) == 16
    finally:
        node.controller._nvme.write = write
    assert overlapped and all(overlapped), "the first shard was written only after the other's turn had passed"
    assert all(node.store.index.get((ns, k)).on_nvme for k in keys)


def test_background_writers_add_writer_nice_and_a_callers_writers_do_not(tmp_path):
    svc = make_node(tmp_path, NODE + ["controller.writer_idle=false", "controller.writer_nice=7"])
    try:
        def niceness():
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        own = niceness()
        assert svc.controller._background_writers.submit(niceness).result() == min(own + 7, 19)
        assert svc.controller._foreground_writers.submit(niceness).result() == own
        assert svc.controller._background_writers.submit(os.sched_getscheduler, 0).result() == os.SCHED_OTHER
    finally:
        close_node(svc)


def test_background_writers_run_under_sched_idle_and_a_callers_writers_do_not(tmp_path):
    svc = make_node(tmp_path, NODE)
    try:
        assert svc.controller._background_writers.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
        assert svc.controller._foreground_writers.submit(os.sched_getscheduler, 0).result() == os.SCHED_OTHER
    finally:
        close_node(svc)


def test_background_writers_refused_sched_idle_take_writer_nice_and_say_so(tmp_path, monkeypatch, caplog):
    """Where the host refuses SCHED_IDLE (a seccomp filter), the writers still start, at writer_nice."""
    def refused(*_):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_setscheduler", refused)
    svc = make_node(tmp_path, NODE + ["controller.writer_nice=5"])
    try:
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        niceness = svc.controller._background_writers.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
        assert niceness == min(own + 5, 19)
        assert svc.controller._background_writers.submit(os.sched_getscheduler, 0).result() == os.SCHED_OTHER
        assert "SCHED_IDLE refused" in caplog.text and "controller.writer_nice applies" in caplog.text
    finally:
        close_node(svc)


def test_the_controllers_write_down_runs_on_a_background_writer_even_with_one_shard(tmp_path):
    """Its own thread claims and releases the batch at the node's priority (it holds the store's lock meanwhile);
    the LMDB writes, most of a write-down's CPU, run on a SCHED_IDLE writer that a woken serving thread preempts.
    They ran on the controller's own thread where a batch was one shard's."""
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back", "controller.high_watermark=0.01",
                                           "controller.write_batch_pages=8"])
    policies, write = [], svc.nvme.write
    def noted_write(shard, pages):
        policies.append(os.sched_getscheduler(0))
        return write(shard, pages)
    svc.nvme.write = noted_write
    try:
        ns = open_ns(svc, SMALL)
        keys = [key for key in chain("idle", 200) if svc.nvme.shard_of(ns, key) == 0][:16]   # one shard's
        assert len(keys) == 16
        put(svc, ns, keys, SMALL)
        assert svc.controller._pass([], [], False) is True
        assert policies and set(policies) == {os.SCHED_IDLE}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER   # the caller's thread is left as it was
        policies.clear()
        assert svc.controller.clean(8) == 8   # a caller's own write-down (room for its Reserve) is serving
        assert policies and set(policies) == {os.SCHED_OTHER}
    finally:
        svc.nvme.write = write
        close_node(svc)


class _CountedWaits(threading.Condition):
    """The controller's queue, counting how often its thread went to sleep on it."""

    def __init__(self):
        super().__init__()
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(timeout)


def test_write_back_above_the_watermark_writes_batch_after_batch_without_waiting(tmp_path):
    """Six batches of unsaved pages and DRAM above high_watermark: the controller writes one batch after another.
    Waiting for the watermark's next check between them (a tenth of a second each) left a saturated node's
    Reserves to write the rest down themselves."""
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back", "controller.high_watermark=0.01",
                                           "controller.write_batch_pages=8"])
    queue = svc.controller._queue = _CountedWaits()
    slept_before, write_down = [], svc.controller._write_down
    def counted_write_down(batch, background=False):   # how often the controller slept before each batch
        slept_before.append(queue.waits)
        return write_down(batch, background)
    svc.controller._write_down = counted_write_down
    try:
        ns, keys = open_ns(svc, SMALL), []
        for i in range(6):   # six chains of a batch each
            keys += chain(f"behind{i}", 8)
            put(svc, ns, keys[-8:], SMALL)
        assert svc.store.dram_fill() > 0.01 and not any(svc.store.index.get((ns, k)).on_nvme for k in keys)
        svc.controller.start()
        deadline = time.monotonic() + 60   # a bound on a hang, not a timing
        while not all(svc.store.index.get((ns, k)).on_nvme for k in keys) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert all(svc.store.index.get((ns, k)).on_nvme for k in keys) and len(slept_before) == 6
        waits = slept_before[-1]   # not what it slept since, its passes that found nothing left
        assert waits <= 2, f"the controller slept {waits} times writing 6 batches down"   # was 6: one a batch
    finally:
        svc.controller.stop()
        close_node(svc)


def test_a_write_back_pass_that_reaches_no_disk_is_not_repeated_at_once(tmp_path):
    """With every shard quarantined a pass writes nothing down: it reports no backlog, so the controller waits for
    the next check instead of retrying the failing disk in a loop; on a working disk it reports one."""
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back", "controller.high_watermark=0.01",
                                           "controller.write_batch_pages=8"])
    try:
        ns, keys = open_ns(svc, SMALL), chain("stuck", 24)
        put(svc, ns, keys, SMALL)
        assert svc.controller._pass([], [], False) is True          # wrote a batch; more are unsaved
        for shard in svc.nvme.shards:
            shard.quarantine_now("a test's damaged shard")
        assert svc.controller._pass([], [], False) is False
        assert not all(svc.store.index.get((ns, k)).on_nvme for k in keys)
    finally:
        close_node(svc)


def test_a_claim_walks_a_long_unsaved_chain_to_its_saved_end_and_write_back_writes_it_down(tmp_path):
    """A 48-page unsaved chain (one put) and batches of 8: its leaf's claim is the chain's first 8 pages (each step
    up the chain a lock section of its own); it was nothing, a step a call, so write-back and a Reserve short of
    clean slots wrote nothing down until a call reached the chain's saved end."""
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back", "controller.write_batch_pages=8"])
    try:
        ns, keys = open_ns(svc, SMALL), chain("long", 48)
        put(svc, ns, keys, SMALL)
        leaf = svc.store.index.get((ns, keys[-1]))
        batch = svc.store.claim_unsaved([leaf], 8)
        assert [r.page_id[1] for r in batch] == keys[:8]
        svc.store.finish_writedown(batch, {})                  # released unwritten
        assert svc.controller.clean(8) == 8                    # a Reserve's own write-down: the saved end first
        assert [svc.store.index.get((ns, k)).on_nvme for k in keys[:9]] == [True] * 8 + [False]
        svc.store.check_invariants()
    finally:
        close_node(svc)


def test_a_long_unsaved_chain_is_walked_once_not_once_a_batch(tmp_path):
    """After the first claim walked a 96-page chain up to its saved end, each later claim starts where that walk
    stopped nearest the saved end: two lock sections a batch, where one from the leaf took a section for each 8
    pages between the leaf and the saved end."""
    svc = make_node(tmp_path, NODE[:-1] + ["controller.write_policy=write_back", "controller.write_batch_pages=8"])
    try:
        ns, keys = open_ns(svc, SMALL), chain("once", 96)
        put(svc, ns, keys, SMALL)
        steps, step = [], svc.store._claim_step
        svc.store._claim_step = lambda records, pages_max: steps.append(1) or step(records, pages_max)
        leaf = svc.store.index.get((ns, keys[-1]))
        for written in range(8, 96, 8):
            steps.clear()
            batch = svc.store.claim_unsaved([leaf], 8)
            assert [r.page_id[1] for r in batch] == keys[written - 8:written]
            assert len(svc.controller._write_down(batch)) == 8
            assert len(steps) <= (12 if written == 8 else 2), f"{len(steps)} steps for the batch ending at {written}"
        svc.store.check_invariants()
    finally:
        close_node(svc)
