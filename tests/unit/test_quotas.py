"""Tenant quotas: a tenant at its DRAM or NVMe limit makes room from its own pages, never from another
tenant's; what its own pages cannot make room for is refused, naming the quota; Stats show each tenant
only itself."""

import pytest

from kvstore import config
from kvstore.control.identity import ADMIN, TENANT, Caller, Identity
from kvstore.control.quotas import TenantLedger
from kvstore_client import errors
from kvstore_client.proto import pb
from node_parts import close_node, make_node

pytestmark = pytest.mark.usefixtures("index_kind")
from test_node_core import BIG, chain, get, open_ns, put, write_all_down

PAGE = BIG                                   # 64 KiB pages: 64 KiB slots
NODE = ["dram.arena_bytes=2MiB", "dram.slab_bytes=256KiB", "limits.page_bytes_max=64KiB",
        "nvme.map_bytes=64MiB", "controller.write_policy=write_through"]
ALICE, BOB = Caller(Identity("alice", TENANT)), Caller(Identity("bob", TENANT))
ADMIN_CALLER = Caller(Identity("ops", ADMIN))


def quotas(alice_dram=0, alice_nvme=0, bob_dram=0):
    return [f"tenants.quotas=alice:{alice_dram}:{alice_nvme},bob:{bob_dram}:0"]


@pytest.fixture
def make(tmp_path):
    nodes = []

    def build(overrides):
        svc = make_node(tmp_path / str(len(nodes)), overrides)
        nodes.append(svc)
        return svc
    yield build
    for svc in nodes:
        close_node(svc)


def stats_of(svc, caller):
    return {t.tenant: t for t in svc.handle("Stats", pb.StatsRequest(), caller).tenants}


def held(svc, ns, keys):
    return svc.lookup(pb.LookupRequest(namespace_id=ns, keys=keys), None).hit_pages


def test_quotas_are_read_from_a_toml_table_and_bad_entries_are_refused(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[tenants.quotas]\nalice = {dram_bytes = "1m", nvme_bytes = "4m"}\nbob = {dram_bytes = 65536}\n')
    cfg = config.load(str(path), environ={})
    assert cfg.tenants.quota_table() == {"alice": (1 << 20, 4 << 20), "bob": (65536, 0)}
    path.write_text('[tenants.quotas]\nalice = {dram = "1m"}\n')
    with pytest.raises(config.ConfigError, match="tenants.quotas.alice"):
        config.load(str(path), environ={})
    for bad, why in (("a:1g", "tenant:dram_bytes:nvme_bytes"), ("a:1:1,a:2:2", "listed twice"), ("a:x:0", "'x'")):
        with pytest.raises(config.ConfigError, match=why):
            config.load(environ={}, overrides=[f"tenants.quotas={bad}"])


def test_a_tenant_at_its_dram_quota_evicts_its_own_pages_least_recently_used_first(make):
    svc = make(NODE + quotas(alice_dram=8 * PAGE))
    bob = open_ns(svc, PAGE, tenant="bob")
    alice = open_ns(svc, PAGE, tenant="alice")
    put(svc, bob, chain("b", 8), PAGE)
    chains = [chain(f"a{i}", 4) for i in range(5)]      # 20 pages into a quota of 8
    for keys in chains:
        put(svc, alice, keys, PAGE)
    assert held(svc, bob, chain("b", 8)) == 8, "bob lost pages to alice's quota"
    assert get(svc, bob, chain("b", 8), PAGE) == 8
    assert [held(svc, alice, keys) for keys in chains] == [0, 0, 0, 4, 4], "not the least recently used first"
    mine = stats_of(svc, ALICE)["alice"]
    assert mine.dram_bytes == 8 * PAGE and mine.dram_pages == 8 and mine.dram_quota_bytes == 8 * PAGE
    assert mine.evictions == 12
    assert stats_of(svc, BOB)["bob"].evictions == 0
    svc.store.check_invariants()


def test_eviction_within_a_tenant_is_leaf_first(make):
    svc = make(NODE + quotas(alice_dram=8 * PAGE))
    alice = open_ns(svc, PAGE, tenant="alice")
    keys = chain("long", 8)
    put(svc, alice, keys, PAGE)
    put(svc, alice, chain("other", 2), PAGE)            # needs two slots: the chain loses its tail
    assert held(svc, alice, keys) == 6
    svc.store.check_invariants()


def test_a_put_past_the_quota_is_refused_for_the_pages_past_it_naming_the_quota(make):
    svc = make(NODE + quotas(alice_dram=4 * PAGE))
    alice = open_ns(svc, PAGE, tenant="alice")
    keys = chain("p", 6)
    r = svc.reserve(pb.ReserveRequest(namespace_id=alice, keys=keys, page_bytes=PAGE), ALICE)
    assert list(r.states) == [pb.RESERVED] * 4 + [pb.NO_SPACE] * 2
    assert "tenants.quotas" in r.no_space_reason and "'alice'" in r.no_space_reason
    svc.abort(pb.AbortRequest(lease_id=r.lease_id), None)
    put(svc, alice, keys[:4], PAGE)
    lease = svc.acquire(pb.AcquireRequest(namespace_id=alice, keys=keys[:4]), None)   # all four pinned
    with pytest.raises(errors.CapacityExhausted, match=r"tenant 'alice' holds 262144 bytes .*tenants.quotas"):
        svc.reserve(pb.ReserveRequest(namespace_id=alice, keys=chain("q", 1), page_bytes=PAGE), ALICE)
    assert stats_of(svc, ALICE)["alice"].dram_refused_pages == 3
    svc.release(pb.ReleaseRequest(lease_ids=[lease.lease_id]), None)
    put(svc, alice, chain("q", 1), PAGE)                # unpinned again: its own LRU page makes room
    assert held(svc, alice, keys) == 3
    svc.store.check_invariants()


def test_write_back_never_evicts_an_unsaved_page_for_a_quota(make):
    svc = make(NODE[:-1] + ["controller.write_policy=write_back"] + quotas(alice_dram=8 * PAGE))
    bob = open_ns(svc, PAGE, tenant="bob")
    alice = open_ns(svc, PAGE, tenant="alice")
    put(svc, bob, chain("b", 8), PAGE)
    chains = [chain(f"a{i}", 4) for i in range(5)]
    for keys in chains:
        put(svc, alice, keys, PAGE)
    assert [held(svc, alice, keys) for keys in chains] == [4] * 5, "write_back lost a page to the quota"
    index = svc.store.index
    assert all(index.get((bob, k)).in_dram and not index.get((bob, k)).on_nvme for k in chain("b", 8)), \
        "bob's pages were written down or evicted for alice"
    assert stats_of(svc, ADMIN_CALLER)["alice"].dram_bytes <= 8 * PAGE
    assert [get(svc, alice, keys, PAGE) for keys in chains] == [4] * 5
    svc.store.check_invariants()


def test_a_tenant_over_its_nvme_quota_drops_its_own_lru_nvme_pages_and_nvme_stays_prefix_closed(make):
    svc = make(NODE + quotas(alice_nvme=6 * PAGE))
    bob = open_ns(svc, PAGE, tenant="bob")
    alice = open_ns(svc, PAGE, tenant="alice")
    put(svc, bob, chain("b", 4), PAGE)
    index = svc.store.index
    write_all_down(svc)
    for i in range(3):                                   # as write_through writes each commit down
        put(svc, alice, chain(f"a{i}", 4), PAGE)
        svc.controller.make_durable([index.get((alice, k)) for k in chain(f"a{i}", 4)], deadline=float("inf"))
    on_nvme = [r for r in index.records() if r.on_nvme]
    assert all(r.parent is None or r.parent.on_nvme for r in on_nvme), "NVMe is no longer prefix-closed"
    assert sum(r.page_id[0] == bob for r in on_nvme) == 4, "bob's NVMe pages were dropped for alice"
    mine = stats_of(svc, ALICE)["alice"]
    assert mine.nvme_bytes <= 6 * PAGE and mine.nvme_pages == mine.nvme_bytes // PAGE
    assert mine.nvme_evictions > 0
    assert index.get((alice, b"a2-3")).on_nvme, "the newest chain should be the one kept"
    views = [memoryview(bytearray(PAGE)) for _ in range(4)]
    assert not any(svc.nvme.read_into([(alice, k, v) for k, v in zip(chain("a0", 4), views)])), \
        "an evicted page is still in LMDB"
    svc.store.check_invariants()


def test_a_durable_commit_past_the_nvme_quota_reports_only_the_pages_within_it(make):
    svc = make(NODE + quotas(alice_nvme=2 * PAGE))
    alice = open_ns(svc, PAGE, tenant="alice")
    answer = put(svc, alice, chain("d", 4), PAGE, durable=True)
    assert answer.durable_pages == 2
    assert stats_of(svc, ALICE)["alice"].nvme_refused_pages >= 2
    assert held(svc, alice, chain("d", 4)) == 4, "a page refused by the NVMe quota stays in DRAM"
    svc.store.check_invariants()


def test_a_tenant_sees_only_its_own_tenant_stats_and_an_admin_sees_all(make):
    svc = make(NODE + quotas(alice_dram=8 * PAGE, bob_dram=4 * PAGE))
    put(svc, open_ns(svc, PAGE, tenant="alice"), chain("a", 3), PAGE)
    put(svc, open_ns(svc, PAGE, tenant="bob"), chain("b", 2), PAGE)
    assert set(stats_of(svc, ALICE)) == {"alice"} and set(stats_of(svc, BOB)) == {"bob"}
    everyone = stats_of(svc, ADMIN_CALLER)
    assert {"alice", "bob"} <= set(everyone)
    assert (everyone["alice"].dram_pages, everyone["bob"].dram_pages) == (3, 2)
    assert (everyone["alice"].dram_quota_bytes, everyone["bob"].dram_quota_bytes) == (8 * PAGE, 4 * PAGE)


def test_under_write_back_a_quota_refuses_rather_than_drop_an_unsaved_page(make):
    svc = make(NODE[:-1] + ["controller.write_policy=write_back"] + quotas(alice_dram=4 * PAGE, alice_nvme=PAGE))
    alice = open_ns(svc, PAGE, tenant="alice")
    keys = chain("c", 4)
    put(svc, alice, keys, PAGE)
    put(svc, alice, chain("d", 1), PAGE)        # c-0 written down (all the NVMe quota holds), its DRAM copy dropped
    assert svc.store.index.get((alice, b"c-0")).on_nvme
    with pytest.raises(errors.CapacityExhausted, match="tenants.quotas"):
        put(svc, alice, chain("e", 1), PAGE)    # nothing more can be written down, nothing unsaved may go
    assert held(svc, alice, keys) == 4 and held(svc, alice, chain("d", 1)) == 1, "an unsaved page was dropped"
    svc.store.check_invariants()


def test_under_write_back_a_tenant_at_its_nvme_quota_does_not_stall_other_tenants_write_down(make):
    svc = make(NODE[:-1] + ["controller.write_policy=write_back", "controller.write_batch_pages=2"]
               + quotas(alice_nvme=2 * PAGE))
    alice, bob = open_ns(svc, PAGE, tenant="alice"), open_ns(svc, PAGE, tenant="bob")
    put(svc, alice, chain("a", 4), PAGE, durable=True)   # a-0, a-1 fill the quota; a-2, a-3 cannot evict them
    put(svc, bob, chain("b", 4), PAGE)                    # newer: behind alice's pages in LRU order
    index = svc.store.index
    assert [index.get((alice, k)).on_nvme for k in chain("a", 4)] == [True, True, False, False]
    for _ in range(3):
        svc.controller.clean(1)
    assert all(index.get((bob, k)).on_nvme for k in chain("b", 4)), "alice's refused pages stalled bob's write-down"
    assert held(svc, alice, chain("a", 4)) == 4, "an unsaved page was dropped"
    assert stats_of(svc, ALICE)["alice"].nvme_refused_pages >= 2
    svc.store.check_invariants()


def test_after_a_restart_each_tenant_owns_its_recovered_nvme_pages_and_its_quota_holds(tmp_path):
    from kvstore.control import recovery

    overrides = NODE + quotas(alice_nvme=4 * PAGE)
    first = make_node(tmp_path, overrides)
    alice, bob = open_ns(first, PAGE, tenant="alice"), open_ns(first, PAGE, tenant="bob")
    put(first, alice, chain("a", 4), PAGE)
    put(first, bob, chain("b", 3), PAGE)
    write_all_down(first)
    close_node(first)

    svc = make_node(tmp_path, overrides)                 # the same LMDB files
    try:
        recovered = recovery.rebuild(svc.nvme)
        svc.store.adopt_recovered(recovered.namespaces, recovered.records)
        seen = stats_of(svc, ADMIN_CALLER)
        assert (seen["alice"].nvme_pages, seen["alice"].nvme_bytes, seen["bob"].nvme_pages) == (4, 4 * PAGE, 3)
        put(svc, alice, chain("n", 2), PAGE)             # the newer pages push alice's oldest off NVMe
        index = svc.store.index
        svc.controller.make_durable([index.get((alice, k)) for k in chain("n", 2)], deadline=float("inf"))
        mine = stats_of(svc, ALICE)["alice"]
        assert mine.nvme_bytes == 4 * PAGE and mine.nvme_evictions == 2
        assert held(svc, alice, chain("a", 4)) == 2 and held(svc, bob, chain("b", 3)) == 3
        svc.store.check_invariants()
    finally:
        close_node(svc)


@pytest.mark.parametrize("offsets", [[4096 * i for i in range(8)], [8192 * i for i in range(4)], [24576, 0, 12288],
                                     [448 * i for i in range(8)], [1024 * i for i in range(1020, 1028)]])
def test_the_ledger_records_each_slot_taken_and_refuses_a_slot_taken_twice(offsets):
    """Slots one after another are recorded with one slice, others one by one: the same ledger either way."""
    slot_bytes = offsets[1] - offsets[0] if offsets[1] > offsets[0] else 12288
    ledger = TenantLedger({}, 1 << 20)
    ledger.took("alice", slot_bytes, offsets)
    assert ledger.dram_bytes["alice"] == slot_bytes * len(offsets)
    with pytest.raises(AssertionError, match="taken twice"):
        ledger.took("bob", slot_bytes, [offsets[-1]])
    with pytest.raises(AssertionError, match="taken twice"):
        ledger.took("bob", slot_bytes, offsets)
    for offset in offsets:
        ledger.freed(offset, slot_bytes)
    assert ledger.dram_bytes["alice"] == 0
    ledger.took("bob", slot_bytes, offsets)   # every slot free again
    assert ledger.dram_bytes["bob"] == slot_bytes * len(offsets)


@pytest.mark.parametrize("order", ["up", "down", "scattered", "two owners"])
def test_slots_freed_together_leave_the_ledger_as_freed_one_by_one(order):
    """freed_many takes a run of slots with one slice when it can; the ledger ends as after freed() each."""
    offsets = [4096 * i for i in range(8)]
    one_by_one, together = TenantLedger({}, 1 << 20), TenantLedger({}, 1 << 20)
    for ledger in (one_by_one, together):
        ledger.took("alice", 4096, offsets[:6])
        ledger.took("bob" if order == "two owners" else "alice", 4096, offsets[6:])
    freed = {"up": offsets, "down": offsets[::-1], "scattered": [0, 16384, 4096, 8192],
             "two owners": offsets[4:]}[order]
    for offset in freed:
        one_by_one.freed(offset, 4096)
    together.freed_many(freed, 4096)
    assert together.dram_bytes == one_by_one.dram_bytes and together._owners == one_by_one._owners
    with pytest.raises(AssertionError, match="was not taken"):
        together.freed_many(freed[:2], 4096)
