"""A tenant cannot take a neighbour's room: quotas count the whole slabs a tenant holds, a quota's
slabs are kept for its tenant whatever the others do (spread pages over every page size, hold read
leases on all of theirs), and namespaces run out for nobody but the tenant that opens them."""

from __future__ import annotations

import numpy as np
import pytest

from identities import Tokens, token_line
from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.proto import pb

SLAB = 256 << 10
BIG = 64 << 10                       # four pages a slab
QUOTA_SLABS = 16


def pages(n, page_bytes, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def spaces(count: int) -> list[Namespace]:
    """One namespace per page size, 4 KiB to 64 KiB: each takes a slab of its own."""
    return [Namespace(model="spread", page_bytes=4096 * (i + 1), page_tokens=16) for i in range(count)]


@pytest.fixture
def tokens(tmp_path):
    return Tokens(tmp_path)


@pytest.fixture
def node(start_server, tokens):
    # 24 slabs: bob's quota is 16 of them (4 MiB); alice has none and is bounded by the node.
    return start_server({"auth.tokens_file": str(tokens.path), "dram.arena_bytes": str(24 * SLAB),
                         "dram.slab_bytes": str(SLAB), "limits.page_bytes_max": str(BIG),
                         "tenants.quotas": f"bob:{QUOTA_SLABS * SLAB}:0"})


def stats_of(client, tenant):
    return {t.tenant: t for t in client.stats().tenants}[tenant]


def test_pages_spread_over_every_page_size_evict_nothing_of_a_neighbour_within_its_quota(node, tokens):
    ns = Namespace(model="bob", page_bytes=BIG, page_tokens=16)
    keys, data = [f"b{i}" for i in range(4 * QUOTA_SLABS)], pages(4 * QUOTA_SLABS, BIG, seed=1)
    with KVStoreClient(node.address, token=tokens.bob) as bob, \
            KVStoreClient(node.address, token=tokens.alice) as alice:
        assert bob.put(ns, keys, data) == len(keys)               # all 16 slabs of its quota
        for round_ in range(3):                                   # and again, each page size a slab
            for i, space in enumerate(spaces(16)):
                alice.put(space, [f"a{round_}-{i}-{j}" for j in range(4)], pages(4, space.page_bytes, i))
        out = np.zeros_like(data)
        assert bob.get(ns, keys, out, verify=True) == len(keys)
        assert np.array_equal(out, data), "a neighbour's spread pages took bob's"
        assert stats_of(bob, "bob").evictions == 0
        assert stats_of(alice, "alice").evictions > 0, "alice's pages made room among themselves"


def test_a_quota_counts_whole_slabs_and_its_refusal_says_so(start_server, tokens):
    node = start_server({"auth.tokens_file": str(tokens.path), "dram.arena_bytes": str(24 * SLAB),
                         "dram.slab_bytes": str(SLAB), "limits.page_bytes_max": str(BIG),
                         "tenants.quotas": f"alice:{4 * SLAB}:0"})
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        held = []
        for i, space in enumerate(spaces(4)):                     # four pages, four slabs: the quota
            assert alice.put(space, [f"k{i}"], pages(1, space.page_bytes, i)) == 1
            held.append(space)
        ns_id = alice._namespace_id(spaces(5)[4])
        leases = [alice._grpc.call("Acquire", pb.AcquireRequest(namespace_id=alice._namespace_id(space),
                                                                 keys=[f"k{i}".encode()], lease_ttl_ms=60_000))
                  for i, space in enumerate(held)]
        assert all(lease.hit_pages == 1 for lease in leases)      # nothing of its own can make room
        with pytest.raises(errors.CapacityExhausted, match=r"holds 4 slabs of 262144 bytes.*page size"):
            alice._grpc.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"k4"], page_bytes=5 * 4096))
        assert stats_of(alice, "alice").dram_bytes <= 4 * SLAB


def test_read_leases_held_on_every_page_of_a_neighbour_starve_no_tenant_of_its_quota(node, tokens):
    ns = Namespace(model="bob", page_bytes=BIG, page_tokens=16)
    with KVStoreClient(node.address, token=tokens.bob) as bob, \
            KVStoreClient(node.address, token=tokens.alice) as alice:
        mine = Namespace(model="alice", page_bytes=BIG, page_tokens=16)
        for c in range(24):                                       # as much of the node as alice is given
            alice.put(mine, [f"a{c}-{j}" for j in range(4)], pages(4, BIG, c))
        ns_id = alice._namespace_id(mine)
        leases = [alice._grpc.call("Acquire", pb.AcquireRequest(
            namespace_id=ns_id, keys=[f"a{c}-{j}".encode() for j in range(4)], lease_ttl_ms=60_000))
            for c in range(24)]
        assert sum(lease.hit_pages for lease in leases) >= 4 * 8   # every page alice holds, pinned
        bob_keys, data = [f"b{i}" for i in range(4 * QUOTA_SLABS)], pages(4 * QUOTA_SLABS, BIG, seed=2)
        assert bob.put(ns, bob_keys, data) == len(bob_keys), "alice's leases kept bob from his quota"
        out = np.zeros_like(data)
        assert bob.get(ns, bob_keys, out, verify=True) == len(bob_keys) and np.array_equal(out, data)


def test_tenants_filling_the_node_with_namespaces_lock_no_other_tenant_out(start_server, tmp_path):
    tokens = Tokens(tmp_path)
    hogs = [f"hog{i}" for i in range(4)]
    for name in hogs + ["carol"]:
        tokens.lines.append(token_line(f"token-of-{name}", name))
    tokens.write()
    node = start_server({"auth.tokens_file": str(tokens.path)})
    page = np.zeros((1, 4096), np.uint8)
    for name in hogs:                                             # 4 x 1024: the node's 4096, each busy
        with KVStoreClient(node.address, token=f"token-of-{name}") as hog:
            for i in range(1024):
                assert hog.put(Namespace(model=f"m{i}", page_bytes=4096), ["k"], page) == 1
            with pytest.raises(errors.CapacityExhausted, match="namespaces_per_tenant_max"):
                hog.put(Namespace(model="one-more", page_bytes=4096), ["k"], page)
    with KVStoreClient(node.address, token="token-of-carol") as carol:
        for i in range(16):                                       # every tenant's floor
            assert carol.put(Namespace(model=f"c{i}", page_bytes=4096), ["k"], page) == 1
        with pytest.raises(errors.CapacityExhausted,
                           match=r"its most \(4096\), and tenant 'carol' 16 of them.*namespaces_per_tenant_floor"):
            carol.put(Namespace(model="c16", page_bytes=4096), ["k"], page)


def test_leases_a_tenant_never_releases_stop_at_its_cap_and_leave_others_theirs(start_server, tokens):
    node = start_server({"auth.tokens_file": str(tokens.path), "leases.per_tenant_max": "64"})
    ns = Namespace(model="leases", page_bytes=4096, page_tokens=16)
    page = np.zeros((1, 4096), np.uint8)
    with KVStoreClient(node.address, token=tokens.alice) as alice, \
            KVStoreClient(node.address, token=tokens.bob) as bob:
        for client in (alice, bob):
            assert client.put(ns, ["k"], page) == 1

        def acquire(client):
            return client._grpc.call("Acquire", pb.AcquireRequest(namespace_id=client._namespace_id(ns), keys=[b"k"],
                                                                   lease_ttl_ms=60_000))
        assert all(acquire(alice).hit_pages == 1 for _ in range(64))    # never released
        with pytest.raises(errors.CapacityExhausted, match=r"tenant 'alice' holds 64 open leases.*per_tenant_max"):
            acquire(alice)
        assert acquire(bob).hit_pages == 1
        out = np.ones_like(page)
        assert bob.get(ns, ["k"], out) == 1 and not out.any()
