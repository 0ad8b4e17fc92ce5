"""Rendezvous placement of pages by key: about 1/N moves on a membership change, weights and ramps hold."""

from __future__ import annotations

import random

import pytest

from kvstore_client.errors import InvalidArgument
from kvstore_client.membership import Member
from kvstore_client import native, placement
from kvstore_client.placement import RAMP_FLOOR, place, placeable, rank, weight

KEYS = [random.Random(i).randbytes(32) for i in range(4000)]


def members(count: int, **fields) -> list[Member]:
    return [Member(node_id=f"node-{i}", host_id="h", state="serving", capacity_bytes=1 << 30, **fields)
            for i in range(count)]


def owners(weights: dict[str, float]) -> list[str]:
    return [rank(k, weights, 1)[0] for k in KEYS]


def test_a_join_moves_about_one_nth_and_only_to_the_new_node():
    before = owners(placeable(members(10), 0))
    after = owners(placeable(members(11), 0))
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert all(b == "node-10" for _, b in moved)
    assert 0.6 / 11 < len(moved) / len(KEYS) < 1.4 / 11


def test_a_leave_moves_only_the_leaving_nodes_pages():
    before = owners(placeable(members(10), 0))
    after = owners(placeable(members(10)[:-1], 0))
    assert all(a == "node-9" for a, b in zip(before, after) if a != b)


def test_weight_follows_capacity():
    big = Member(node_id="big", host_id="h", state="serving", capacity_bytes=3 << 30)
    small = Member(node_id="small", host_id="h", state="serving", capacity_bytes=1 << 30)
    share = owners(placeable([big, small], 0)).count("big") / len(KEYS)
    assert 0.7 < share < 0.8


def test_ramp_grows_from_the_floor_to_full():
    node = members(1, serving_since=1000.0, ramp_s=100.0)[0]
    assert weight(node, 1000.0) == pytest.approx(RAMP_FLOOR)
    assert weight(node, 1050.0) == pytest.approx(0.5)
    assert weight(node, 5000.0) == pytest.approx(1.0)


def test_only_serving_members_take_pages():
    group = members(3)
    group[1] = Member(node_id="node-1", host_id="h", state="draining", capacity_bytes=1 << 30)
    assert set(placeable(group, 0)) == {"node-0", "node-2"}


def test_a_chains_first_put_replicates_its_leading_pages_only():
    weights = placeable(members(5), 0)
    placed = place(KEYS[:40], weights, 3, 16, chain_start=True)
    assert all(len(nodes) == 3 and len(set(nodes)) == 3 for nodes in placed[:16])
    assert all(len(nodes) == 1 for nodes in placed[16:])
    assert [nodes[0] for nodes in placed] == [rank(k, weights, 1)[0] for k in KEYS[:40]]   # the best node first
    assert all(len(nodes) == 1 for nodes in place(KEYS[:40], weights, 3, 16, chain_start=False))
    assert place(KEYS[:5], {}, 3, 16, chain_start=True) == [()] * 5


def test_a_page_is_placed_by_its_key_alone_wherever_a_call_starts():
    weights = placeable(members(7), 0)
    whole = place(KEYS[:100], weights, 1, 0, chain_start=True)
    assert place(KEYS[37:100], weights, 1, 0, chain_start=False) == whole[37:]


def test_placing_pages_spreads_them_evenly():
    counts = {}
    for nodes in place(KEYS, placeable(members(8), 0), 1, 0, chain_start=False):
        counts[nodes[0]] = counts.get(nodes[0], 0) + 1
    assert len(counts) == 8 and max(counts.values()) < 1.25 * len(KEYS) / 8


def test_cluster_url_names_endpoints_and_cluster():
    from kvstore_client.cluster import parse_cluster_url

    assert parse_cluster_url("etcd://h1:2379,h2:2379/prod") == (["h1:2379", "h2:2379"], "prod")
    for bad in ("http://h1:2379/prod", "etcd://h1:2379", "etcd://h1:2379/a/b", "etcd:///prod"):
        with pytest.raises(InvalidArgument, match="etcd://host:2379"):
            parse_cluster_url(bad)


def test_a_bad_replica_layout_is_the_sdks_invalid_argument():
    with pytest.raises(InvalidArgument, match=r"replicas \(0\)"):
        place(KEYS[:5], {"a": 1.0}, 0, 3, chain_start=True)


def test_member_record_round_trips_and_ignores_unknown_fields():
    member = members(1, serving_since=5.0, ramp_s=2.0)[0]
    assert Member.decode(member.encode()) == member
    assert Member.decode(member.encode()[:-1] + b', "added_later": 1}') == member


def test_a_read_asks_a_ramping_nodes_keys_of_the_node_they_had_before():
    from kvstore_client.placement import read_order
    now = 10_000.0
    group = members(3) + [Member(node_id="new", host_id="h", state="serving", capacity_bytes=1 << 30,
                                 serving_since=now - 50, ramp_s=100)]      # halfway up its ramp
    before = {k: rank(k, placeable(members(3), now), 1)[0] for k in KEYS}
    orders = read_order(KEYS, group, now, 1, 0)
    taken = [k for k, order in zip(KEYS, orders) if order[0] == "new"]
    assert 0.05 < len(taken) / len(KEYS) < 0.3
    assert all(order == ("new", before[k]) for k, order in zip(KEYS, orders) if order[0] == "new")
    assert all(order == (before[k],) for k, order in zip(KEYS, orders) if order[0] != "new")
    assert read_order(KEYS, group, now + 100, 1, 0) == [(o,) for o in owners(placeable(group, now + 100))]


@pytest.mark.skipif(not native.available(), reason="kvstore_native is not built")
def test_the_native_key_hashes_are_hashlibs_blake2b_of_eight_bytes():
    """Placement's key hash in one C call equals the pure path's (hashlib) for every length, across blocks."""
    rng = random.Random(9)
    keys = [rng.randbytes(n) for n in [*range(0, 300), 1000, 4096]] + [rng.randbytes(64).hex().encode()]
    assert placement.key_hashes(keys).tolist() == [placement._hash64(k) for k in keys]
    with pytest.raises(TypeError, match="not bytes"):
        native.key_hashes([b"a", "b"])
