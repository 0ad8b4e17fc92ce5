"""Page groups in process over a real arena (and real LMDB for eviction to NVMe): one commit makes every
part of a position visible or none, one lookup answers every part from one snapshot, one acquire pins them."""

import threading

import pytest
import xxhash

from node_parts import ManualClock, close_node, make_node, make_service

pytestmark = pytest.mark.usefixtures("index_kind")
from kvstore_client import groups
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb

KV, STATE = 8192, 4096
ALL, TRAILING = pb.GROUP_ALL_PAGES, pb.GROUP_TRAILING_PAGES


@pytest.fixture
def service():
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "limits.batch_pages_max=64",
                        "leases.read_ttl_ms=1000", "leases.write_ttl_ms=1000"], ManualClock())
    yield svc
    svc.store.arena.close()


def open_ns(svc, page_bytes, layout, tenant=""):
    spec = Namespace(model="hybrid", page_bytes=page_bytes, layout=layout, tenant=tenant).to_proto()
    return svc.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id


def keys(n, start=0):
    return [f"k{i}".encode() for i in range(start, start + n)]


def reserve(svc, ns, page_bytes, ks, parent=b"", fill=7, anchor=False):
    """A filled, uncommitted write lease (and the checksum of each page it filled)."""
    r = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=ks, parent_key=parent, page_bytes=page_bytes,
                                      anchor_absent_parent=anchor), None)
    assert list(r.states) == [pb.RESERVED] * len(ks)
    for offset in r.offsets:
        svc.store.arena.view[offset:offset + page_bytes] = bytes([fill]) * page_bytes
    return r.lease_id, xxhash.xxh3_64_intdigest(bytes([fill]) * page_bytes)


def commit_group(svc, *parts):
    return svc.commit_group(pb.CommitGroupRequest(parts=list(parts)), None)


def lookup(svc, ns, ks):
    return svc.lookup(pb.LookupRequest(namespace_id=ns, keys=ks), None).hit_pages


def lookup_group(svc, ks, *parts):
    return svc.lookup_group(pb.LookupGroupRequest(keys=ks, parts=list(parts)), None)


def part(ns, policy=ALL, trailing=0):
    return pb.GroupPart(namespace_id=ns, hit_policy=policy, trailing_pages=trailing)


@pytest.fixture
def hybrid(service):
    """A KV namespace and a Mamba-state namespace of the same model."""
    return open_ns(service, KV, "kv"), open_ns(service, STATE, "mamba")


def test_a_group_commit_publishes_every_part_together(service, hybrid):
    kv, state = hybrid
    kv_lease, _ = reserve(service, kv, KV, keys(4))
    state_lease, _ = reserve(service, state, STATE, keys(4))
    answer = commit_group(service, pb.CommitRequest(lease_id=kv_lease), pb.CommitRequest(lease_id=state_lease))
    assert [list(p.states) for p in answer.parts] == [[pb.COMMITTED] * 4] * 2
    assert lookup(service, kv, keys(4)) == lookup(service, state, keys(4)) == 4
    assert service.store.open_leases() == 0
    service.store.check_invariants()


def test_one_bad_checksum_makes_nothing_of_the_group_visible(service, hybrid):
    kv, state = hybrid
    kv_lease, kv_sum = reserve(service, kv, KV, keys(2))
    state_lease, state_sum = reserve(service, state, STATE, keys(2))
    with pytest.raises(errors.ChecksumMismatch, match=f"index 1 of lease {state_lease:#x}.*nothing in this group"):
        commit_group(service, pb.CommitRequest(lease_id=kv_lease, checksums=[kv_sum, kv_sum]),
                     pb.CommitRequest(lease_id=state_lease, checksums=[state_sum, state_sum ^ 1]))
    assert lookup(service, kv, keys(2)) == lookup(service, state, keys(2)) == 0
    # Every lease is left as it was: the group commits once it is right.
    commit_group(service, pb.CommitRequest(lease_id=kv_lease, checksums=[kv_sum, kv_sum]),
                 pb.CommitRequest(lease_id=state_lease, checksums=[state_sum, state_sum]))
    assert lookup(service, kv, keys(2)) == lookup(service, state, keys(2)) == 2


def test_an_unknown_lease_in_the_group_is_named_and_publishes_nothing(service, hybrid):
    kv, _ = hybrid
    kv_lease, _ = reserve(service, kv, KV, keys(2))
    with pytest.raises(errors.LeaseNotFound, match=f"{0xdead:#x}"):
        commit_group(service, pb.CommitRequest(lease_id=kv_lease), pb.CommitRequest(lease_id=0xdead))
    assert lookup(service, kv, keys(2)) == 0
    commit_group(service, pb.CommitRequest(lease_id=kv_lease))
    assert lookup(service, kv, keys(2)) == 2


def test_a_part_whose_parent_left_fails_the_whole_group(service, hybrid):
    kv, state = hybrid
    for ns, size in ((kv, KV), (state, STATE)):
        lease, _ = reserve(service, ns, size, keys(1))
        commit_group(service, pb.CommitRequest(lease_id=lease))
    kv_lease, _ = reserve(service, kv, KV, keys(2, 1), parent=b"k0")
    state_lease, _ = reserve(service, state, STATE, keys(2, 1), parent=b"k0")
    service.delete(pb.DeleteRequest(namespace_id=state, keys=[b"k0"]), None)   # the state chain's parent goes
    with pytest.raises(errors.GroupIncomplete, match=f"index 0 of lease {state_lease:#x}"):
        commit_group(service, pb.CommitRequest(lease_id=kv_lease), pb.CommitRequest(lease_id=state_lease))
    assert lookup(service, kv, keys(3)) == 1
    assert service.abort(pb.AbortRequest(lease_id=state_lease), None).aborted_pages == 2


def test_group_requests_are_checked_whole(service, hybrid):
    kv, state = hybrid
    kv_lease, _ = reserve(service, kv, KV, keys(1))
    cases = [
        (pb.CommitGroupRequest(), errors.InvalidArgument, "parts is empty"),
        (pb.CommitGroupRequest(parts=[pb.CommitRequest(lease_id=kv_lease)] * 2), errors.InvalidArgument, "twice"),
        (pb.CommitGroupRequest(parts=[pb.CommitRequest(lease_id=kv_lease, durable=True)]), errors.InvalidArgument,
         "durable"),
        (pb.CommitGroupRequest(parts=[pb.CommitRequest(lease_id=i + 1) for i in range(17)]), errors.BatchTooLarge,
         "at most 16"),
    ]
    for request, error, message in cases:
        with pytest.raises(error, match=message):
            service.commit_group(request, None)
    with pytest.raises(errors.InvalidArgument, match="GROUP_ALL_PAGES"):
        lookup_group(service, keys(1), part(kv, TRAILING), part(state))
    with pytest.raises(errors.InvalidArgument, match="twice"):
        lookup_group(service, keys(1), part(kv), part(kv))
    with pytest.raises(errors.NamespaceNotFound):
        lookup_group(service, keys(1), part(kv), part(12345))
    with pytest.raises(errors.InvalidArgument, match="wait_ms"):
        service.acquire_group(pb.AcquireGroupRequest(parts=[pb.AcquireRequest(namespace_id=kv, keys=keys(1),
                                                                              wait_ms=5)]), None)
    assert lookup(service, kv, keys(1)) == 0   # nothing was committed by a refused request


def test_leases_of_two_tenants_are_not_one_group(service):
    kv = open_ns(service, KV, "kv", tenant="a")
    other = open_ns(service, KV, "kv", tenant="b")
    one, _ = reserve(service, kv, KV, keys(1))
    two, _ = reserve(service, other, KV, keys(1))
    with pytest.raises(errors.InvalidArgument, match="one tenant"):
        commit_group(service, pb.CommitRequest(lease_id=one), pb.CommitRequest(lease_id=two))
    assert lookup(service, kv, keys(1)) == lookup(service, other, keys(1)) == 0


def test_lookup_group_answers_the_policies_of_each_part(service, hybrid):
    kv, state = hybrid
    swa = open_ns(service, STATE, "swa")
    lease, _ = reserve(service, kv, KV, keys(6))
    commit_group(service, pb.CommitRequest(lease_id=lease))
    # The state holds positions 1, 2 and 4 (0-based), the sliding-window pool 0..3.
    for ns, present in ((state, [1, 2, 4]), (swa, [0, 1, 2, 3])):
        for position in present:
            lease, _ = reserve(service, ns, STATE, [keys(6)[position]], parent=keys(6)[position - 1] if position
                               else b"", anchor=True)
            commit_group(service, pb.CommitRequest(lease_id=lease))
    only_kv = lookup_group(service, keys(6), part(kv))
    assert (only_kv.hit_pages, list(only_kv.restorable_pages)) == (6, [1, 2, 3, 4, 5, 6])
    answer = lookup_group(service, keys(6), part(kv), part(state, TRAILING, 2))
    assert (answer.hit_pages, list(answer.part_hit_pages), list(answer.restorable_pages)) == (3, [6, 3], [3])
    answer = lookup_group(service, keys(6), part(kv), part(state, TRAILING, 1), part(swa, ALL))
    assert (answer.hit_pages, list(answer.part_hit_pages), list(answer.restorable_pages)) == (3, [6, 5, 4], [2, 3])
    answer = lookup_group(service, keys(6), part(kv), part(swa, ALL), part(state, ALL))
    assert (answer.hit_pages, list(answer.part_hit_pages)) == (0, [6, 4, 0])


def test_the_fold_matches_prefix_by_prefix_rules():
    """groups.fold against the rule written out per prefix length, over every presence pattern of 5 pages."""
    import itertools

    for bits in itertools.product([False, True], repeat=5):
        for trailing in (1, 2, 3):
            hits = groups.fold(5, [list(bits)], [part(1), part(2, TRAILING, trailing)])
            want = [n for n in range(1, 6) if all(bits[max(0, n - trailing):n])]
            assert hits.restorable_pages == want and hits.hit_pages == max(want, default=0)
        hits = groups.fold(5, [list(bits)], [part(1), part(2, ALL)])
        assert hits.hit_pages == next((i for i, b in enumerate(bits) if not b), 5)


def test_a_part_deleted_or_evicted_answers_its_position_absent(service, hybrid):
    kv, state = hybrid
    kv_lease, _ = reserve(service, kv, KV, keys(4))
    state_lease, _ = reserve(service, state, STATE, keys(4))
    commit_group(service, pb.CommitRequest(lease_id=kv_lease), pb.CommitRequest(lease_id=state_lease))
    assert lookup_group(service, keys(4), part(kv), part(state)).hit_pages == 4
    service.delete(pb.DeleteRequest(namespace_id=state, keys=[b"k2"]), None)
    assert lookup_group(service, keys(4), part(kv), part(state)).hit_pages == 2
    # Fill DRAM with other chains of the state namespace: its old leaves go first (leaf-first LRU).
    capacity = service.store.allocator.capacity_bytes // STATE
    for chain in range(capacity // 8 + 8):
        lease, _ = reserve(service, state, STATE, [f"x{chain}-{i}".encode() for i in range(8)])
        commit_group(service, pb.CommitRequest(lease_id=lease))
    answer = lookup_group(service, keys(4), part(kv), part(state))
    assert lookup(service, state, keys(4)) < 2
    assert answer.hit_pages == min(lookup(service, kv, keys(4)), lookup(service, state, keys(4)))
    service.store.index.check_prefix_closed()


def test_a_concurrent_group_lookup_never_sees_kv_without_its_state(service, hybrid):
    """One thread commits groups position by position; another hammers LookupGroup: the KV part's own
    boundary never runs ahead of the group's (KV is never seen without its state)."""
    kv, state = hybrid
    ks = keys(40)
    done, seen = threading.Event(), []

    def writer():
        try:
            for i, key in enumerate(ks):
                parent = ks[i - 1] if i else b""
                kv_lease, _ = reserve(service, kv, KV, [key], parent=parent)
                state_lease, _ = reserve(service, state, STATE, [key], parent=parent)
                commit_group(service, pb.CommitRequest(lease_id=kv_lease), pb.CommitRequest(lease_id=state_lease))
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        answer = lookup_group(service, ks, part(kv), part(state))
        kv_pages, parts = answer.hit_pages, list(answer.part_hit_pages)
        seen.append(kv_pages)
        assert parts[0] == kv_pages, f"KV seen at {parts[0]} pages with its state at {kv_pages}"
    thread.join()
    assert seen == sorted(seen) and lookup_group(service, ks, part(kv), part(state)).hit_pages == 40


def test_acquire_group_pins_every_part_in_one_step(service, hybrid):
    kv, state = hybrid
    kv_lease, _ = reserve(service, kv, KV, keys(3), fill=1)
    state_lease, _ = reserve(service, state, STATE, keys(2), fill=2)
    commit_group(service, pb.CommitRequest(lease_id=kv_lease), pb.CommitRequest(lease_id=state_lease))
    held = service.acquire_group(pb.AcquireGroupRequest(parts=[
        pb.AcquireRequest(namespace_id=kv, keys=keys(3)), pb.AcquireRequest(namespace_id=state, keys=keys(3))]), None)
    assert [p.hit_pages for p in held.parts] == [3, 2]
    assert [p.page_bytes for p in held.parts] == [KV, STATE]
    view = service.store.arena.view
    assert bytes(view[held.parts[1].offsets[1]:held.parts[1].offsets[1] + STATE]) == b"\x02" * STATE
    records = [service.store.index.get((state, k)) for k in keys(2)] + [service.store.index.get((kv, k))
                                                                        for k in keys(3)]
    assert all(r.pins == 1 for r in records)
    service.release(pb.ReleaseRequest(lease_ids=[p.lease_id for p in held.parts]), None)
    assert all(r.pins == 0 for r in records) and service.store.open_leases() == 0


def test_acquire_group_brings_every_part_up_from_nvme(tmp_path):
    """Real LMDB: every part written down and dropped from DRAM comes back under the group's leases."""
    from node_parts import drop_dram_copies, write_all_down

    svc = make_node(tmp_path, ["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "nvme.map_bytes=16MiB"])
    try:
        kv, state = open_ns(svc, KV, "kv"), open_ns(svc, STATE, "mamba")
        kv_lease, _ = reserve(svc, kv, KV, keys(3), fill=3)
        state_lease, _ = reserve(svc, state, STATE, keys(3), fill=4)
        commit_group(svc, pb.CommitRequest(lease_id=kv_lease), pb.CommitRequest(lease_id=state_lease))
        write_all_down(svc)
        drop_dram_copies(svc)
        assert svc.store.index.dram_pages == 0
        held = svc.acquire_group(pb.AcquireGroupRequest(parts=[
            pb.AcquireRequest(namespace_id=kv, keys=keys(3)), pb.AcquireRequest(namespace_id=state, keys=keys(3))]),
            None)
        assert [(p.hit_pages, p.promoted_pages) for p in held.parts] == [(3, 3), (3, 3)]
        offset = held.parts[1].offsets[2]
        assert bytes(svc.store.arena.view[offset:offset + STATE]) == b"\x04" * STATE
        svc.release(pb.ReleaseRequest(lease_ids=[p.lease_id for p in held.parts]), None)
    finally:
        close_node(svc)


def test_a_tenant_names_no_other_tenants_lease_or_namespace_in_a_group(service):
    from kvstore.control.identity import TENANT, Caller, Identity

    alice, bob = Caller(Identity("alice", TENANT)), Caller(Identity("bob", TENANT))
    spec = Namespace(model="hybrid", page_bytes=KV, layout="kv").to_proto()
    theirs = service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=spec), bob).namespace_id
    mine = service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=spec), alice).namespace_id
    their_lease = service.handle("Reserve", pb.ReserveRequest(namespace_id=theirs, keys=keys(1), page_bytes=KV),
                                 bob).lease_id
    my_lease = service.handle("Reserve", pb.ReserveRequest(namespace_id=mine, keys=keys(1), page_bytes=KV),
                              alice).lease_id
    with pytest.raises(errors.LeaseNotFound, match=f"{their_lease:#x}"):
        service.handle("CommitGroup", pb.CommitGroupRequest(parts=[pb.CommitRequest(lease_id=my_lease),
                                                                   pb.CommitRequest(lease_id=their_lease)]), alice)
    with pytest.raises(errors.NamespaceNotFound):
        service.handle("LookupGroup", pb.LookupGroupRequest(keys=keys(1), parts=[part(mine), part(theirs)]), alice)
    with pytest.raises(errors.NamespaceNotFound):
        service.handle("AcquireGroup", pb.AcquireGroupRequest(parts=[
            pb.AcquireRequest(namespace_id=theirs, keys=keys(1))]), alice)
    assert lookup(service, mine, keys(1)) == lookup(service, theirs, keys(1)) == 0
