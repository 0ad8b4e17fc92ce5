"""Replication by popularity: a node's decayed read counts (ReadHeat) and a cluster client's memory of hot pages."""

from __future__ import annotations

import random

from kvstore.control.read_heat import ReadHeat
from kvstore_client.hot_pages import HotPages, rotated
from kvstore_client.keys import Namespace

NS = Namespace(model="m", page_bytes=64)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_page_is_hot_from_the_read_that_brings_its_count_to_the_threshold():
    clock = Clock()
    heat = ReadHeat(hot_reads=3, half_life_s=60, pages_max=100, clock=clock)
    assert heat.read(1, [b"a", b"b"]) == []
    clock.now += 1                                         # reads a second apart have decayed a little
    assert heat.read(1, [b"a", b"b"]) == []
    clock.now += 1
    assert heat.read(1, [b"b", b"a", b"c"]) == [0, 1]     # positions in this call; c read once
    assert heat.read(2, [b"a"]) == []                      # another namespace's page of the same key


def test_reads_spread_over_time_decay_and_never_reach_the_threshold():
    clock = Clock()
    heat = ReadHeat(hot_reads=3, half_life_s=10, pages_max=100, clock=clock)
    for _ in range(50):                  # one read per half-life: the count tends to 2, never 3
        assert heat.read(1, [b"a"]) == []
        clock.now += 10
    for _ in range(2):                   # then three within a moment: hot
        heat.read(1, [b"a"])
    assert heat.read(1, [b"a"]) == [0]


def test_the_table_is_bounded_and_forgets_the_page_read_longest_ago():
    heat = ReadHeat(hot_reads=2, half_life_s=60, pages_max=3, clock=Clock())
    heat.read(1, [b"old"])
    heat.read(1, [b"x", b"y", b"z"])
    assert len(heat) == 3
    assert heat.read(1, [b"old"]) == []          # its first read was forgotten
    assert heat.read(1, [b"z"]) == [0]           # z was read after old, so it was kept


def test_hot_pages_are_copied_once_then_read_from_any_replica():
    hot = HotPages()
    keys = [b"k0", b"k1", b"k2"]
    assert hot.to_copy(NS, keys) == [] and hot.spread(NS, keys) == []
    hot.flag(NS, [(b"k2", 22), (b"k0", 0)])
    assert hot.to_copy(NS, keys) == [(0, 0), (2, 22)] and hot.spread(NS, keys) == []
    hot.copied(NS, [b"k0", b"k2"])
    assert hot.to_copy(NS, keys) == [] and hot.spread(NS, keys) == [0, 2]
    hot.flag(NS, [(b"k0", 0)])                   # flagged again: still copied, no second copy round
    assert hot.to_copy(NS, keys) == []
    assert hot.spread(Namespace(model="other", page_bytes=64), keys) == []


def test_a_lost_copy_is_copied_again_when_next_flagged_and_spread_meanwhile():
    hot = HotPages()
    hot.flag(NS, [(b"a", 5)])
    hot.copied(NS, [b"a"])
    hot.lost_copy(NS, [b"a", b"never-flagged"])
    assert hot.spread(NS, [b"a", b"never-flagged"]) == [0]       # its other copies still serve it
    assert hot.to_copy(NS, [b"a"]) == []                           # no checksum yet to check the bytes by
    hot.flag(NS, [(b"a", 5)])
    assert hot.to_copy(NS, [b"a"]) == [(0, 5)]
    hot.copied(NS, [b"a"])
    assert hot.to_copy(NS, [b"a"]) == [] and hot.spread(NS, [b"a"]) == [0]


def test_hot_pages_forget_the_least_recently_flagged_beyond_their_bound():
    hot = HotPages(keys_max=2)
    hot.flag(NS, [(b"a", 1), (b"b", 2)])
    hot.copied(NS, [b"a", b"b"])
    hot.flag(NS, [(b"a", 1), (b"c", 3)])         # a flagged again, so b is the oldest and goes
    assert hot.spread(NS, [b"a", b"b", b"c"]) == [0]
    assert hot.to_copy(NS, [b"a", b"b", b"c"]) == [(2, 3)]


def test_the_per_namespace_counts_a_read_skips_by_stay_those_of_the_entries():
    """spread() and to_copy() answer [] at once for a namespace with no entry of their kind: the counts they
    read are kept through every flag, copy, lost copy and eviction."""
    rng, spaces = random.Random(4), [NS, Namespace(model="other", page_bytes=64)]
    hot = HotPages(keys_max=16)
    for _ in range(2000):
        namespace, keys = rng.choice(spaces), [b"k%d" % rng.randrange(40) for _ in range(rng.randrange(1, 5))]
        step = rng.randrange(3)
        if step == 0:
            hot.flag(namespace, [(key, rng.randrange(100)) for key in keys])
        elif step == 1:
            hot.copied(namespace, keys)
        else:
            hot.lost_copy(namespace, keys)
        for space in spaces:
            values = [value for (ns, _), value in hot._pages.items() if ns == space]
            assert hot._spread[space] == sum(v < 0 for v in values)
            assert hot._waiting[space] == sum(v >= 0 for v in values)
            every = [key for (ns, key) in hot._pages if ns == space]
            assert hot.spread(space, every) == [i for i, v in enumerate(values) if v < 0]


def test_rotated_reads_start_at_every_replica():
    rng, owners = random.Random(7), ("n1", "n2", "n3")
    firsts = {rotated(owners, rng)[0] for _ in range(60)}
    assert firsts == set(owners)
    assert all(sorted(rotated(owners, rng)) == sorted(owners) for _ in range(10))
