"""A commit may carry the checksums its writer took while copying: the node publishes them without reading
the slots back, refuses such a commit without one checksum per page, and checks them later like any page
(the scrubber drops a page whose bytes do not match; promotion from NVMe refuses it)."""

import pytest
import xxhash

from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import close_node, drop_dram_copies, make_node, write_all_down

SMALL = 8 << 10
NODE = ["dram.arena_bytes=2MiB", "dram.slab_bytes=256KiB", "nvme.map_bytes=64MiB"]


@pytest.fixture
def node(tmp_path):
    svc = make_node(tmp_path, NODE)
    yield svc
    close_node(svc)


def open_ns(svc):
    spec = Namespace(model="w", page_bytes=SMALL).to_proto()
    return svc.open_namespace(pb.OpenNamespaceRequest(spec=spec), None).namespace_id


def reserve_and_fill(svc, ns, keys):
    """Reserve keys and fill each slot with its own bytes; returns (lease id, each page's bytes)."""
    r = svc.reserve(pb.ReserveRequest(namespace_id=ns, keys=keys, page_bytes=SMALL), None)
    pages = [bytes([i + 1]) * SMALL for i in range(len(keys))]
    for offset, page in zip(r.offsets, pages):
        svc.store.arena.view[offset:offset + SMALL] = page
    return r.lease_id, pages


def test_the_writers_checksums_are_recorded_as_given(node):
    ns = open_ns(node)
    keys = [b"w0", b"w1", b"w2"]
    lease_id, pages = reserve_and_fill(node, ns, keys)
    sums = [xxhash.xxh3_64_intdigest(p) for p in pages]
    answer = node.commit(pb.CommitRequest(lease_id=lease_id, checksums=sums, checksums_from_writer=True), None)
    assert list(answer.states) == [pb.COMMITTED] * 3 and list(answer.checksums) == []   # the writer has them
    acquired = node.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys), None)
    assert acquired.hit_pages == 3 and list(acquired.checksums) == sums
    assert node.scrubber.run_pass() == (3, 0)


def test_without_a_checksum_per_page_nothing_is_published(node):
    ns = open_ns(node)
    lease_id, pages = reserve_and_fill(node, ns, [b"a", b"b"])
    for sums in ([], [xxhash.xxh3_64_intdigest(pages[0])]):
        with pytest.raises(errors.InvalidArgument, match="checksums_from_writer needs one per page"):
            node.commit(pb.CommitRequest(lease_id=lease_id, checksums=sums, checksums_from_writer=True), None)
    assert node.lookup(pb.LookupRequest(namespace_id=ns, keys=[b"a"]), None).hit_pages == 0
    # the lease is untouched: the node can still hash the slots itself
    assert list(node.commit(pb.CommitRequest(lease_id=lease_id), None).states) == [pb.COMMITTED] * 2


def test_a_writer_that_lied_is_caught_by_the_scrubber(node):
    ns = open_ns(node)
    keys = [b"l0", b"l1"]
    lease_id, pages = reserve_and_fill(node, ns, keys)
    sums = [xxhash.xxh3_64_intdigest(pages[0]), 12345]
    node.commit(pb.CommitRequest(lease_id=lease_id, checksums=sums, checksums_from_writer=True), None)
    assert node.lookup(pb.LookupRequest(namespace_id=ns, keys=keys), None).hit_pages == 2   # no read-back
    checked, bad = node.scrubber.run_pass()
    assert (checked, bad) == (2, 1)
    assert node.lookup(pb.LookupRequest(namespace_id=ns, keys=keys), None).hit_pages == 1


def test_promotion_from_nvme_checks_the_writers_checksum(node):
    ns = open_ns(node)
    keys = [b"p0", b"p1"]
    lease_id, pages = reserve_and_fill(node, ns, keys)
    sums = [xxhash.xxh3_64_intdigest(pages[0]), xxhash.xxh3_64_intdigest(pages[0])]   # the second is wrong
    node.commit(pb.CommitRequest(lease_id=lease_id, checksums=sums, checksums_from_writer=True), None)
    write_all_down(node)
    drop_dram_copies(node)
    acquired = node.acquire(pb.AcquireRequest(namespace_id=ns, keys=keys), None)
    assert acquired.hit_pages == 1, "the page whose bytes do not match the writer's checksum is not served"
    assert node.stats(pb.StatsRequest(), None).tiers[1].corrupt_pages == 1
