"""The service's data-plane hooks: tokens, slot checks, grants that outlive their lease, cut writes, reads vouched
for until their memory is exposed."""

import threading

import pytest
import xxhash

from node_parts import ManualClock, make_service
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb

PAGE = 8192


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def service(clock):
    svc = make_service([
        "dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "leases.read_ttl_ms=100", "leases.write_ttl_ms=100"], clock)
    yield svc
    svc.store.arena.close()


def reserve(svc, keys, ttl_ms=0):
    ns = svc.open_namespace(pb.OpenNamespaceRequest(spec=Namespace(model="m", page_bytes=PAGE).to_proto()),
                            None).namespace_id
    return ns, svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, page_bytes=PAGE, lease_ttl_ms=ttl_ms), None)


def test_tokens_are_random_per_lease_and_checked(service):
    _, a = reserve(service, [b"a0", b"a1"])
    _, b = reserve(service, [b"b0"])
    assert len(a.data_token) == 16 and a.data_token != b.data_token
    with pytest.raises(errors.TokenMismatch):
        service.grants.resolve_write(a.lease_id, b.data_token, 0, PAGE)
    with pytest.raises(errors.LeaseNotFound):
        service.grants.resolve_write(12345, a.data_token, 0, PAGE)
    with pytest.raises(errors.SlotNotInLease):
        service.grants.resolve_write(a.lease_id, a.data_token, 2, PAGE)
    with pytest.raises(errors.SlotNotInLease, match="write lease"):
        service.grants.resolve_read(a.lease_id, a.data_token, 0, PAGE)
    with pytest.raises(errors.LengthMismatch):
        service.grants.resolve_write(a.lease_id, a.data_token, 0, PAGE - 1)
    grant = service.grants.resolve_write(a.lease_id, a.data_token, 1, PAGE)
    assert len(grant.view) == PAGE and grant.write
    with pytest.raises(errors.SlotBusy):
        service.grants.resolve_write(a.lease_id, a.data_token, 1, PAGE)


def test_a_slot_being_written_cannot_be_committed_until_its_transfer_ends(service):
    ns, r = reserve(service, [b"k0", b"k1"])
    grant = service.grants.resolve_write(r.lease_id, r.data_token, 1, PAGE)
    with pytest.raises(errors.SlotBusy):
        service.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    grant.view[:] = b"\x05" * PAGE
    service.grants.finish_transfer(grant)
    assert list(service.commit(pb.CommitRequest(lease_id=r.lease_id), None).states) == [pb.COMMITTED] * 2
    acquired = service.acquire(pb.AcquireRequest(namespace_id=ns, keys=[b"k0", b"k1"]), None)
    read = service.grants.resolve_read(acquired.lease_id, acquired.data_token, 1, PAGE)
    assert bytes(read.view) == b"\x05" * PAGE and not read.write
    with pytest.raises(errors.SlotNotInLease):
        service.grants.resolve_read(acquired.lease_id, acquired.data_token, 2, PAGE)
    service.grants.finish_transfer(read)


def test_a_lease_ended_mid_transfer_frees_its_slot_only_when_the_transfer_ends(service):
    _, r = reserve(service, [b"x0"])
    grant = service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    service.abort(pb.AbortRequest(lease_id=r.lease_id), None)
    assert service.store.allocator.used_bytes == PAGE     # still being written: not handed to anyone else
    _, other = reserve(service, [b"y0"])
    assert other.offsets[0] != r.offsets[0]
    service.grants.finish_transfer(grant)
    assert service.store.allocator.used_bytes == PAGE     # only the other lease's slot is left


def test_an_expired_lease_is_refused_and_reaped_after_its_transfer(service, clock):
    _, r = reserve(service, [b"e0"], ttl_ms=50)
    grant = service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    clock.advance(0.08)
    with pytest.raises(errors.LeaseNotFound):
        service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    assert service.reap_expired() == 1
    assert service.store.allocator.used_bytes == PAGE
    service.grants.finish_transfer(grant)
    assert service.store.allocator.used_bytes == 0


def test_a_cut_write_ends_its_lease_and_nothing_becomes_visible(service):
    ns, r = reserve(service, [b"c0", b"c1"])
    done = service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    service.grants.finish_transfer(done)
    cut = service.grants.resolve_write(r.lease_id, r.data_token, 1, PAGE)
    service.grants.cut_transfer(cut)
    assert service.store.allocator.used_bytes == 0 and service.open_leases() == 0
    with pytest.raises(errors.LeaseNotFound):
        service.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    assert service.lookup(pb.LookupRequest(namespace_id=ns, keys=[b"c0"]), None).hit_pages == 0


def test_rdma_connect_without_rdma_is_a_clear_error(service):
    with pytest.raises(errors.TransportUnavailable, match="no RDMA data plane"):
        service.rdma_connect(pb.RdmaConnectRequest(queue_pair=pb.RdmaQueuePair(qp_num=1)), None)


def test_a_commit_records_the_checksum_taken_as_the_page_landed_without_reading_the_slot(service):
    ns, r = reserve(service, [b"h0"])
    grant = service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    grant.view[:] = b"\x07" * PAGE
    service.grants.finish_transfer(grant, arrived_checksum=0x1234)   # not the bytes' hash: shows it is not re-read
    committed = service.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    assert list(committed.states) == [pb.COMMITTED] and list(committed.checksums) == [0x1234]


def test_a_new_write_to_a_slot_voids_the_checksum_its_earlier_write_landed_with(service):
    ns, r = reserve(service, [b"v0"])
    first = service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    first.view[:] = b"\x01" * PAGE
    service.grants.finish_transfer(first, arrived_checksum=xxhash.xxh3_64_intdigest(b"\x01" * PAGE))
    again = service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    again.view[:] = b"\x02" * PAGE
    service.grants.finish_transfer(again)        # a path that took no checksum: the node hashes at Commit
    committed = service.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    assert list(committed.checksums) == [xxhash.xxh3_64_intdigest(b"\x02" * PAGE)]


def test_a_writer_checksum_is_checked_against_the_one_taken_as_the_page_landed(service):
    ns, r = reserve(service, [b"w0"])
    grant = service.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    grant.view[:] = b"\x03" * PAGE
    landed = xxhash.xxh3_64_intdigest(b"\x03" * PAGE)
    service.grants.finish_transfer(grant, arrived_checksum=landed)
    with pytest.raises(errors.ChecksumMismatch):
        service.commit(pb.CommitRequest(lease_id=r.lease_id, checksums=[landed ^ 1]), None)
    assert service.lookup(pb.LookupRequest(namespace_id=ns, keys=[b"w0"]), None).hit_pages == 0
    assert list(service.commit(pb.CommitRequest(lease_id=r.lease_id, checksums=[landed]), None).states) == [
        pb.COMMITTED]


def committed_page(svc, key: bytes) -> tuple[int, pb.AcquireResponse]:
    ns, r = reserve(svc, [key])
    grant = svc.grants.resolve_write(r.lease_id, r.data_token, 0, PAGE)
    assert not grant.vouched
    grant.view[:] = b"\x07" * PAGE
    svc.grants.finish_transfer(grant)
    svc.commit(pb.CommitRequest(lease_id=r.lease_id), None)
    return ns, svc.acquire(pb.AcquireRequest(namespace_id=ns, keys=[key]), None)


def test_reads_are_vouched_until_the_memory_is_exposed_and_exposing_waits_for_those_in_flight(service):
    _, acquired = committed_page(service, b"v0")
    first = service.grants.resolve_read(acquired.lease_id, acquired.data_token, 0, PAGE)
    assert first.vouched
    assert not service.store.expose("", wait_s=0.05)       # the vouched read is still being sent
    second = service.grants.resolve_read(acquired.lease_id, acquired.data_token, 0, PAGE)
    assert not second.vouched                              # exposed from the first call on, for good
    exposed = []
    waiting = threading.Thread(target=lambda: exposed.append(service.store.expose("", wait_s=30)))
    waiting.start()
    service.grants.finish_transfer(second)
    waiting.join(0.2)
    assert waiting.is_alive() and not exposed              # an unvouched read ending frees nothing
    service.grants.finish_transfer(first)
    waiting.join(10)
    assert exposed == [True]
    assert service.store.expose("", wait_s=0)              # nothing in flight: at once


def test_no_read_is_vouched_where_rdma_peers_can_write_the_arena(clock):
    svc = make_service(["dram.arena_bytes=1MiB", "dram.slab_bytes=256KiB", "rdma.enabled=true"], clock)
    try:
        _, acquired = committed_page(svc, b"r0")
        read = svc.grants.resolve_read(acquired.lease_id, acquired.data_token, 0, PAGE)
        assert not read.vouched
        svc.grants.finish_transfer(read)
    finally:
        svc.store.arena.close()
