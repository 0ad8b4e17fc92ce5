"""The service's rules, in process over a real arena: leases, commits, chains, limits, draining."""

import pytest
import xxhash

from node_parts import ManualClock, make_service

pytestmark = pytest.mark.usefixtures("index_kind")
from kvstore_client import errors, packed
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb

PAGE = 8192


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def service(clock):
    svc = make_service([
        "dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "limits.batch_pages_max=64",
        "leases.read_ttl_ms=100", "leases.write_ttl_ms=100"], clock)
    yield svc
    svc.store.arena.close()


def open_ns(svc, page_bytes=PAGE, **kw):
    spec = Namespace(model="m", page_bytes=page_bytes, **kw).to_proto()
    return svc.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id


def keys(prefix, n):
    return [f"{prefix}{i}".encode() for i in range(n)]


def put(svc, ns, ks, parent=b"", fill=7, anchor=False):
    r = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=ks, parent_key=parent, page_bytes=PAGE,
                                      anchor_absent_parent=anchor), None)
    for state, offset in zip(r.states, r.offsets):
        if state == pb.RESERVED:
            svc.store.arena.view[offset:offset + PAGE] = bytes([fill]) * PAGE
    if r.lease_id:
        svc.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    return r


def lookup(svc, ns, ks):
    return svc.lookup(pb.LookupRequest(namespace_id=ns, keys=ks), None).hit_pages


def test_uncommitted_pages_are_invisible_and_expire(service, clock):
    ns = open_ns(service)
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 4), page_bytes=PAGE), None)
    assert list(r.states) == [pb.RESERVED] * 4
    assert lookup(service, ns, keys("a", 4)) == 0
    assert service.store.allocator.used_bytes == 4 * PAGE
    clock.advance(0.15)
    assert service.reap_expired() == 1
    assert service.store.allocator.used_bytes == 0
    with pytest.raises(errors.LeaseNotFound):
        service.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    assert service.store.counters.leases_expired == 1


def test_commit_verifies_checksums_before_anything_is_visible(service):
    ns = open_ns(service)
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 2), page_bytes=PAGE), None)
    for offset in r.offsets:
        service.store.arena.view[offset:offset + PAGE] = b"\x01" * PAGE
    good = xxhash.xxh3_64_intdigest(b"\x01" * PAGE)
    with pytest.raises(errors.ChecksumMismatch, match="index 1"):
        service.commit(pb.CommitRequest(lease_id=r.lease_id, indices=[0, 1], checksums=[good, good ^ 1]), None)
    assert lookup(service, ns, keys("a", 2)) == 0
    done = service.commit(pb.CommitRequest(lease_id=r.lease_id, indices=[0, 1], checksums=[good, good]), None)
    assert list(done.checksums) == [good, good]
    assert lookup(service, ns, keys("a", 2)) == 2


def test_packed_reserve_and_commit_say_what_the_repeated_fields_say(service):
    """Limits.pages_packed: a Reserve answered packed gives the states and offsets the repeated fields give, a
    Commit of a run with packed checksums is checked and answered as one naming each index, and an Acquire
    answered packed gives the offsets and checksums the repeated fields give."""
    ns = open_ns(service)
    assert service.handle("Hello", pb.HelloRequest()).limits.pages_packed
    service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("p", 4)[3:], page_bytes=PAGE), None)   # in flight
    answer = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("p", 4), page_bytes=PAGE,
                                               packed_answer=True), None)
    assert not answer.states and not answer.offsets
    states, offsets = packed.reserve_states(answer), list(packed.offsets(answer))
    assert states == [pb.RESERVED] * 3 + [pb.IN_FLIGHT]
    assert offsets[3] == 0 and len(set(offsets[:3])) == 3 and all(o % PAGE == 0 for o in offsets)
    for offset in offsets[:3]:
        service.store.arena.view[offset:offset + PAGE] = b"\x02" * PAGE
    good = xxhash.xxh3_64_intdigest(b"\x02" * PAGE)
    with pytest.raises(errors.ChecksumMismatch, match="index 1"):
        service.commit(pb.CommitRequest(lease_id=answer.lease_id, first_index=0, index_count=3,
                                        checksums_packed=packed.u64s([good, good ^ 1, good]), packed_answer=True), None)
    done = service.commit(pb.CommitRequest(lease_id=answer.lease_id, first_index=0, index_count=3,
                                           checksums_packed=packed.u64s([good] * 3), packed_answer=True), None)
    assert not done.states and not done.checksums
    assert list(packed.commit_states(done)) == [pb.COMMITTED] * 3
    assert list(packed.checksums(done)) == [good] * 3
    assert lookup(service, ns, keys("p", 3)) == 3
    plain, packs = (service.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys("p", 4), packed_answer=p), None)
                    for p in (False, True))
    assert plain.hit_pages == packs.hit_pages == 3 and not packs.offsets and not packs.checksums
    assert list(packed.offsets(packs)) == list(plain.offsets) == offsets[:3]
    assert list(packed.checksums(packs)) == list(plain.checksums) == [good] * 3


@pytest.mark.parametrize("fields, message", [
    (dict(indices=[0], first_index=0, index_count=1), "not both"),
    (dict(first_index=2), "send index_count too"),
    (dict(index_count=1, checksums=[1], checksums_packed=bytes(8)), "not both"),
    (dict(index_count=1, checksums_packed=bytes(7)), "7 bytes"),
])
def test_a_commit_that_mixes_or_breaks_its_packed_forms_is_refused_before_any_work(service, fields, message):
    ns = open_ns(service)
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("q", 1), page_bytes=PAGE), None)
    with pytest.raises(errors.InvalidArgument, match=message):
        service.handle("Commit", pb.CommitRequest(lease_id=r.lease_id, **fields))
    assert lookup(service, ns, keys("q", 1)) == 0
    assert service.store.leases.get(r.lease_id).slots   # still open, its slot uncommitted


def test_present_and_in_flight_pages_are_not_written_twice(service):
    ns = open_ns(service)
    put(service, ns, keys("a", 2))
    first = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 4), page_bytes=PAGE), None)
    assert list(first.states) == [pb.PRESENT, pb.PRESENT, pb.RESERVED, pb.RESERVED]
    second = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 4), page_bytes=PAGE), None)
    assert list(second.states) == [pb.PRESENT, pb.PRESENT, pb.IN_FLIGHT, pb.IN_FLIGHT]
    assert second.lease_id == 0


def test_a_child_of_a_missing_parent_is_refused_unless_it_asks_to_be_anchored(service):
    ns = open_ns(service)
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"c"], parent_key=b"gone", page_bytes=PAGE), None)
    assert list(r.states) == [pb.PARENT_MISSING] and r.lease_id == 0


def test_a_chain_whose_parent_is_absent_is_stored_anchored_at_it(service):
    ns = open_ns(service)
    r = put(service, ns, keys("b", 3), parent=b"a-gone", anchor=True)
    assert list(r.states) == [pb.RESERVED] * 3 and r.lease_id
    assert lookup(service, ns, keys("b", 3)) == 3                  # found from the anchored page on
    assert lookup(service, ns, [b"a-gone"] + keys("b", 3)) == 0    # from the chain's start: the gap
    assert service.store.index.anchored((ns, b"a-gone")) == {service.store.index.get((ns, b"b0"))}
    # The parent comes back: the anchored chain hangs under it again.
    put(service, ns, [b"a-gone"])
    assert lookup(service, ns, [b"a-gone"] + keys("b", 3)) == 4
    assert service.store.index.get((ns, b"b0")).parent is service.store.index.get((ns, b"a-gone"))
    assert not service.store.index.anchored((ns, b"a-gone"))
    service.store.check_invariants()


def test_commit_drops_pages_whose_in_flight_parent_was_aborted(service):
    ns = open_ns(service)
    writer = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"p"], page_bytes=PAGE), None)
    child = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"c"], parent_key=b"p", page_bytes=PAGE), None)
    assert list(child.states) == [pb.RESERVED]
    service.abort(pb.AbortRequest(lease_id=writer.lease_id), None)
    done = service.commit(pb.CommitRequest(lease_id=child.lease_id), None)
    assert list(done.states) == [pb.COMMIT_PARENT_MISSING]
    assert lookup(service, ns, [b"c"]) == 0 and service.store.allocator.used_bytes == 0


def test_extending_a_lease_continues_its_chain(service):
    ns = open_ns(service)
    first = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 2), page_bytes=PAGE), None)
    with pytest.raises(errors.InvalidArgument, match="last key"):
        service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"x"], parent_key=b"a0",
                                          lease_id=first.lease_id, page_bytes=PAGE), None)
    more = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"a2"], parent_key=b"a1",
                                             lease_id=first.lease_id, page_bytes=PAGE), None)
    assert more.lease_id == first.lease_id and more.first_index == 2
    service.commit(pb.CommitRequest(lease_id=first.lease_id, indices=[0, 1, 2]), None)
    assert lookup(service, ns, keys("a", 3)) == 3
    service.store.index.check_prefix_closed()


def test_eviction_under_pressure_keeps_the_index_prefix_closed(service):
    ns = open_ns(service)
    capacity = service.store.allocator.capacity_bytes // PAGE
    for chain in range(capacity // 8 * 3):
        put(service, ns, keys(f"c{chain}-", 8))
        service.store.index.check_prefix_closed()
    assert service.store.counters.evictions > 0
    for chain in range(capacity // 8 * 3):
        ks = keys(f"c{chain}-", 8)
        present = [lookup(service, ns, [k]) for k in ks]
        assert present == sorted(present, reverse=True), f"chain {chain} has a hole: {present}"


def test_read_leases_pin_pages_and_lookups_extend_nothing(service, clock):
    ns = open_ns(service)
    put(service, ns, keys("hot", 4), fill=9)
    acquired = service.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys("hot", 4)), None)
    assert acquired.hit_pages == 4
    for chain in range(64):  # far more than the arena holds
        put(service, ns, keys(f"c{chain}-", 4))
    assert lookup(service, ns, keys("hot", 4)) == 4
    for offset in acquired.offsets:
        assert bytes(service.store.arena.view[offset:offset + PAGE]) == b"\x09" * PAGE
    for _ in range(5):  # lookups during the lease do not extend it
        lookup(service, ns, keys("hot", 4))
        clock.advance(0.03)
    assert service.reap_expired() >= 1
    with pytest.raises(errors.LeaseNotFound):
        service.release(pb.ReleaseRequest(lease_ids=[acquired.lease_id]), None)


def test_capacity_exhausted_when_everything_is_pinned(service):
    ns = open_ns(service)
    capacity = service.store.allocator.capacity_bytes // PAGE
    service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("w", 64), page_bytes=PAGE), None)
    service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("v", capacity - 64), page_bytes=PAGE), None)
    with pytest.raises(errors.CapacityExhausted):
        service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"one-more"], page_bytes=PAGE), None)


@pytest.mark.parametrize("request_, error", [
    (pb.ReserveRequest(namespace_id=1, keys=[b"a"], page_bytes=PAGE), errors.NamespaceNotFound),
    (pb.ReserveRequest(keys=[b"a"], page_bytes=PAGE + 1), errors.PageSizeMismatch),
    (pb.ReserveRequest(keys=[b"a", b"a"], page_bytes=PAGE), errors.DuplicateKey),
    (pb.ReserveRequest(keys=[b"a"] * 0, page_bytes=PAGE), errors.InvalidArgument),
    (pb.ReserveRequest(keys=[b"k%d" % i for i in range(65)], page_bytes=PAGE), errors.BatchTooLarge),
    (pb.ReserveRequest(keys=[b"x" * 65], page_bytes=PAGE), errors.InvalidArgument),
    (pb.ReserveRequest(keys=[b"a"], page_bytes=PAGE, lease_ttl_ms=10**9), errors.InvalidArgument),
    (pb.CommitRequest(lease_id=12345), errors.LeaseNotFound),
    (pb.ReleaseRequest(lease_ids=[12345]), errors.LeaseNotFound),
])
def test_bad_requests_get_their_error(service, request_, error):
    ns = open_ns(service)
    if hasattr(request_, "namespace_id") and not request_.namespace_id:
        request_.namespace_id = ns
    method = {"ReserveRequest": "Reserve", "CommitRequest": "Commit", "ReleaseRequest": "Release"}
    with pytest.raises(error):
        service.handle(method[type(request_).__name__], request_)


def test_bad_namespace_specs(service):
    for spec, match in [(dict(model="", page_bytes=PAGE), "model"), (dict(model="m", page_bytes=0), "page_bytes"),
                        (dict(model="m", page_bytes=PAGE, tp_rank=2, tp_size=2), "tp_rank"),
                        (dict(model="m", page_bytes=PAGE, hash_seed="zz"), "hash_seed")]:
        with pytest.raises(errors.InvalidArgument, match=match):
            service.open_namespace(pb.OpenNamespaceRequest(spec=pb.NamespaceSpec(**spec)), None)


def test_a_write_lease_cannot_be_released_nor_a_read_lease_aborted(service):
    ns = open_ns(service)
    w = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"a"], page_bytes=PAGE), None)
    with pytest.raises(errors.InvalidArgument, match="Abort or Commit"):
        service.release(pb.ReleaseRequest(lease_ids=[w.lease_id]), None)


def test_lookup_by_tokens_uses_the_namespace_chain(service):
    from kvstore_client.keys import encode_key, prefix_hashes
    ns = open_ns(service, page_tokens=4)
    tokens = list(range(12))
    put(service, ns, [encode_key(k) for k in prefix_hashes(tokens, 4)])
    assert service.lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens), None).hit_pages == 3
    assert service.lookup(pb.LookupRequest(namespace_id=ns, tokens=[0, 1, 2, 3, 9, 9, 9, 9]), None).hit_pages == 1


def test_lookup_by_tokens_continues_the_chain_from_parent_key(service):
    from kvstore_client.keys import encode_key, prefix_hashes
    ns = open_ns(service, page_tokens=4, hash_seed="ab" * 32)
    tokens = list(range(40))
    chain = [encode_key(k) for k in prefix_hashes(tokens, 4, "ab" * 32)]
    put(service, ns, chain)
    first = service.lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens[:16]), None)
    assert first.hit_pages == 4 and first.last_key == chain[3]
    rest = service.lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens[16:], parent_key=first.last_key), None)
    assert rest.hit_pages == 6 and rest.last_key == chain[-1]
    # the same tokens without their parent are another chain
    assert service.lookup(pb.LookupRequest(namespace_id=ns, tokens=tokens[16:]), None).hit_pages == 0


@pytest.mark.parametrize("request_fields, error, message", [
    ({"keys": [b"k"], "parent_key": b"ab"}, errors.InvalidArgument, "with tokens"),
    ({"tokens": [1, 2, 3, 4], "parent_key": b"not hex"}, errors.InvalidArgument, "hex"),
    ({"tokens": list(range(4 * 129))}, errors.BatchTooLarge, "lookup_pages_max is 128"),
    ({"keys": [b"k%d" % i for i in range(129)]}, errors.BatchTooLarge, "lookup_pages_max is 128"),
])
def test_lookup_input_is_refused_before_any_hashing(clock, request_fields, error, message):
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "limits.batch_pages_max=64",
                        "limits.lookup_pages_max=128"], clock)
    ns = open_ns(svc, page_tokens=4)
    with pytest.raises(error, match=message):
        svc.lookup(pb.LookupRequest(namespace_id=ns, **request_fields), None)
    # a Lookup may name more pages than a Reserve (it holds no slot and no lease per page)
    assert svc.lookup(pb.LookupRequest(namespace_id=ns, keys=[b"k%d" % i for i in range(128)]), None).hit_pages == 0
    assert svc.hello(pb.HelloRequest(), None).limits.lookup_pages_max == 128
    svc.store.arena.close()


def test_draining_refuses_new_leases_but_finishes_open_ones(service):
    ns = open_ns(service)
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"a"], page_bytes=PAGE), None)
    service.start_draining()
    with pytest.raises(errors.Draining):
        service.acquire(pb.AcquireRequest(namespace_id=ns, keys=[b"a"]), None)
    service.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    assert service.open_leases() == 0


def test_delete_takes_descendants(service):
    ns = open_ns(service)
    put(service, ns, keys("a", 4))
    assert service.delete(pb.DeleteRequest(namespace_id=ns, keys=[b"a1"]), None).deleted_pages == 3
    assert lookup(service, ns, keys("a", 4)) == 1
    assert service.store.allocator.used_bytes == PAGE


def test_delete_takes_the_pages_anchored_at_a_key_it_does_not_hold_and_can_name_what_it_removed(service):
    ns = open_ns(service)
    put(service, ns, keys("b", 3), parent=b"a-gone", anchor=True)     # a chain's piece whose parent is elsewhere
    put(service, ns, keys("c", 2))
    answer = service.delete(pb.DeleteRequest(namespace_id=ns, keys=[b"a-gone"], report_keys=True), None)
    assert answer.deleted_pages == 3 and sorted(answer.removed_keys) == keys("b", 3) and not answer.removed_keys_cut
    assert lookup(service, ns, keys("b", 3)) == 0 and lookup(service, ns, keys("c", 2)) == 2
    assert not service.delete(pb.DeleteRequest(namespace_id=ns, keys=[b"c0"]), None).removed_keys   # not asked


def test_each_page_records_the_parent_its_reserve_names_held_here_or_not(service):
    """parent_keys: a cluster's piece of a chain (pages 0, 2, 3 and 5 here, 1 and 4 on other nodes)."""
    ns = open_ns(service)
    put(service, ns, [b"p0"])
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"p2", b"p3", b"p5"], page_bytes=PAGE,
                                          parent_keys=[b"p1", b"p2", b"p4"]), None)
    assert list(r.states) == [pb.RESERVED] * 3
    more = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=[b"p6"], page_bytes=PAGE, lease_id=r.lease_id,
                                             parent_keys=[b"p0"]), None)   # extending, under another parent
    assert more.first_index == 3
    assert list(service.commit(pb.CommitRequest(lease_id=r.lease_id), None).states) == [pb.COMMITTED] * 4
    index = service.store.index
    assert index.get((ns, b"p3")).parent is index.get((ns, b"p2"))        # its parent is here: a child
    assert index.get((ns, b"p6")).parent is index.get((ns, b"p0"))
    assert index.anchored((ns, b"p1")) == {index.get((ns, b"p2"))}         # elsewhere: anchored at it
    assert index.anchored((ns, b"p4")) == {index.get((ns, b"p5"))}
    service.store.check_invariants()
    # Deleting a page on another node reaches the pages here that extend it, and only those.
    answer = service.delete(pb.DeleteRequest(namespace_id=ns, keys=[b"p4"], report_keys=True), None)
    assert answer.deleted_pages == 1 and list(answer.removed_keys) == [b"p5"]
    answer = service.delete(pb.DeleteRequest(namespace_id=ns, keys=[b"p1"], report_keys=True), None)
    assert sorted(answer.removed_keys) == [b"p2", b"p3"]
    assert lookup(service, ns, [b"p0", b"p6"]) == 2


@pytest.mark.parametrize("fields, message", [
    (dict(keys=[b"a", b"b"], parent_keys=[b"z"]), "1 parent_keys for 2 keys"),
    (dict(keys=[b"a", b"b"], parent_keys=[b"z", b""]), r"parent_keys\[1\] has 0 bytes"),
    (dict(keys=[b"a"], parent_keys=[b"x" * 65]), r"parent_keys\[0\] has 65 bytes"),
    (dict(keys=[b"a", b"b"], parent_keys=[b"z", b"b"]), "cannot extend itself"),
    (dict(keys=[b"a"], parent_key=b"y", parent_keys=[b"z"]), "parent_key and parent_keys"),
])
def test_parent_keys_that_cannot_be_a_chain_are_refused_before_any_work(service, fields, message):
    ns = open_ns(service)
    with pytest.raises(errors.InvalidArgument, match=message):
        service.reserve(pb.ReserveRequest(namespace_id=ns, page_bytes=PAGE, **fields), None)
    assert not service.store.leases._leases and service.store.allocator.used_bytes == 0


def list_all(service, ns, keys_max=3) -> list[bytes]:
    listed, cursor = [], 0
    while True:
        answer = service.list_keys(pb.ListKeysRequest(namespace_id=ns, cursor=cursor, keys_max=keys_max), None)
        assert len(answer.keys) <= (keys_max or service.limits.lookup_pages_max)
        listed += answer.keys
        if not answer.more:
            return listed
        cursor = answer.cursor


def test_list_keys_pages_through_a_namespace_by_its_cursor_each_key_once(service):
    ns, other = open_ns(service), open_ns(service, layout="x")
    put(service, ns, keys("a", 5))
    put(service, ns, keys("b", 3), parent=b"a4")       # one chain: a0..a4 b0..b2
    put(service, other, keys("z", 2))
    listed = list_all(service, ns)
    assert sorted(listed) == sorted(keys("a", 5) + keys("b", 3)) and len(set(listed)) == len(listed)
    assert list_all(service, other, keys_max=0) == keys("z", 2)
    with pytest.raises(errors.InvalidArgument, match="lookup_pages_max"):
        service.list_keys(pb.ListKeysRequest(namespace_id=ns, keys_max=service.limits.lookup_pages_max + 1), None)
    with pytest.raises(errors.InvalidArgument, match="cursor"):
        service.list_keys(pb.ListKeysRequest(namespace_id=ns, cursor=1 << 40), None)
    with pytest.raises(errors.NamespaceNotFound):
        service.list_keys(pb.ListKeysRequest(namespace_id=12345), None)


def test_an_unreleased_read_lease_is_counted_once_when_it_expires(service, clock, caplog):
    """However often its TTL was restarted (an Acquire restarts it at once)."""
    ns = open_ns(service)
    put(service, ns, [b"k"])
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
    ns = open_ns(service)
    put(service, ns, [b"k"])
    with pytest.raises(errors.InvalidArgument, match=rf"policy={policy} is not a PrefetchPolicy.*WAIT_COMPLETE"):
        service.acquire(pb.AcquireRequest(namespace_id=ns, keys=[b"k"], policy=policy), None)
    part = pb.AcquireRequest(namespace_id=ns, keys=[b"k"], policy=policy)
    with pytest.raises(errors.InvalidArgument, match=rf"parts\[0\].policy={policy}"):
        service.acquire_group(pb.AcquireGroupRequest(parts=[part]), None)
    assert len(service.store.leases) == 0


def _local_writer(tenant_arena: str = "") -> object:
    """A local connection's caller that mapped the arena: it copies into its slots itself."""
    from kvstore.control.identity import TRUSTED, Caller

    caller = Caller(TRUSTED)
    caller.arena = tenant_arena
    return caller


def test_a_copy_landing_after_its_lease_expired_hits_no_page(service, clock):
    """The slots of a write lease that expired while its shared-memory writer may still be copying are
    not reused until the writer aborts it or its connection closes: a late copy lands on no page."""
    ns = open_ns(service)
    stalled = _local_writer()
    late = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 4), page_bytes=PAGE), stalled)
    clock.advance(0.15)
    assert service.reap_expired() == 1
    other = put(service, ns, keys("b", 4), fill=9)           # another writer, while the slots are fenced
    assert set(other.offsets).isdisjoint(late.offsets)
    for offset in late.offsets:                              # the stalled writer's copy lands now
        service.store.arena.view[offset:offset + PAGE] = b"\xee" * PAGE
    got = service.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys("b", 4)), None)
    assert all(service.store.arena.view[o:o + PAGE] == bytes([9]) * PAGE for o in got.offsets)
    service.release(pb.ReleaseRequest(lease_ids=[got.lease_id]), None)
    used = service.store.allocator.used_bytes
    assert used == 8 * PAGE and service.store.fenced_slots() == 4
    # Its own Abort, sent once its copies returned, frees them; someone else's does not.
    with pytest.raises(errors.LeaseNotFound):
        service.abort(pb.AbortRequest(lease_id=late.lease_id), _local_writer())
    assert service.store.fenced_slots() == 4
    service.abort(pb.AbortRequest(lease_id=late.lease_id), stalled)
    assert service.store.fenced_slots() == 0
    assert service.store.allocator.used_bytes == used - 4 * PAGE   # the fenced slots freed, b's stay
    service.store.check_invariants()


def test_fenced_slots_are_freed_when_their_connection_closes(service, clock):
    ns = open_ns(service)
    stalled = _local_writer()
    service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 4), page_bytes=PAGE), stalled)
    clock.advance(0.15)
    service.reap_expired()
    assert service.store.owns_leases(stalled)                # an idle-connection sweep does not close it
    service.end_owner(stalled)
    assert service.store.fenced_slots() == 0 and service.store.allocator.used_bytes == 0


def test_a_write_lease_aborted_by_another_connection_is_fenced_from_its_writer(service):
    ns = open_ns(service)
    writer = _local_writer()
    r = service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 2), page_bytes=PAGE), writer)
    assert service.abort(pb.AbortRequest(lease_id=r.lease_id), _local_writer()).aborted_pages == 2
    assert service.store.fenced_slots() == 2
    service.end_owner(writer)
    assert service.store.allocator.used_bytes == 0


def test_a_writer_over_grpc_or_tcp_frees_its_slots_at_expiry(service, clock):
    """Only a writer that maps the arena copies on its own; the node's own data-plane copies are fenced
    by their transfer count, so an expired gRPC caller's slots are free at once."""
    ns = open_ns(service)
    service.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys("a", 4), page_bytes=PAGE), None)
    clock.advance(0.15)
    service.reap_expired()
    assert service.store.fenced_slots() == 0 and service.store.allocator.used_bytes == 0


def test_list_pages_answers_tiers_parents_and_checks_its_input(service):
    ns = open_ns(service)
    put(service, ns, keys("p", 3))
    answer = service.list_pages(pb.ListPagesRequest(namespace_id=ns), None)
    assert not answer.more and not answer.events_enabled and answer.events_topic == b""
    pages = {p.key: (p.parent_key, p.dram, p.nvme) for p in answer.pages}
    assert pages == {b"p0": (b"", True, False), b"p1": (b"p0", True, False), b"p2": (b"p1", True, False)}
    with pytest.raises(errors.InvalidArgument, match="pages_max"):
        service.list_pages(pb.ListPagesRequest(namespace_id=ns, pages_max=service.limits.lookup_pages_max + 1), None)
    with pytest.raises(errors.InvalidArgument, match="cursor"):
        service.list_pages(pb.ListPagesRequest(namespace_id=ns, cursor=1 << 40), None)
    with pytest.raises(errors.NamespaceNotFound):
        service.list_pages(pb.ListPagesRequest(namespace_id=12345), None)


def test_list_pages_is_scoped_to_the_callers_tenant_and_names_its_own_stream(service):
    from kvstore.control.identity import TENANT, Caller, Identity
    from kvstore.control.store_events import StoreEvents, topic_of

    service.store.events = StoreEvents(8, 64)
    alice, bob = Caller(Identity("alice", TENANT)), Caller(Identity("bob", TENANT))
    spec = Namespace(model="m", page_bytes=PAGE).to_proto()
    theirs = service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=spec), bob).namespace_id
    mine = service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=spec), alice).namespace_id
    put(service, theirs, keys("b", 2))
    with pytest.raises(errors.NamespaceNotFound):
        service.handle("ListPages", pb.ListPagesRequest(namespace_id=theirs), alice)
    answer = service.handle("ListPages", pb.ListPagesRequest(namespace_id=mine), alice)
    assert answer.events_enabled and answer.events_topic == topic_of("alice") and not answer.pages
    assert answer.events_run == service.instance_id
    batches = service.store.events.take()
    assert {b.tenant for b in batches} == {"alice", "bob"}   # bob's pages went to bob's stream only
    assert all(e.namespace_id == theirs for b in batches if b.tenant == "bob" for e in b.events if e.key)
