"""The C page index and the Python reference take the same pages in the same order, step for step.

A random workload (adds of chains and anchored roots, touches, pins, DRAM and NVMe evictions of
one tenant or any, clean-only and write-back passes with NVMe refusals, moves to and from NVMe,
promotions, deletes) runs against both; after every step the two must have returned the same pages
in the same order, hold the same pages with the same fields, and both pass check_prefix_closed.
"""

import random

import pytest

from kvstore.control import native_index
from kvstore.control.index import NO_SLOT, PageIndex

needs_native = pytest.mark.skipif(not native_index.available(), reason="kvstore_native is not built")

SIZES = (4096, 8192)
TENANTS = {1: "a", 2: "a", 3: "b"}


def random_key(rng: random.Random, pool: list[bytes]) -> bytes:
    if pool and rng.random() < 0.3:
        return rng.choice(pool)   # reuse: anchors find their parent, removed keys come back
    kind = rng.randrange(4)
    if kind == 0:
        key = rng.randbytes(32)
    elif kind == 1:
        key = rng.randbytes(32).hex().encode()       # SGLang's 64 hex characters
    elif kind == 2:
        key = rng.randbytes(rng.randrange(1, 32))
    else:
        key = rng.randbytes(rng.randrange(33, 65))     # longer than the slot holds inline
    pool.append(key)
    return key


class Pair:
    """The same workload on both implementations."""

    def __init__(self):
        self.freed = ([], [])
        self.py = PageIndex(self._removed(0), self._dram_dropped(0), TENANTS.__getitem__)
        self.c = native_index.NativePageIndex(self._removed(1), self._dram_dropped(1), TENANTS.__getitem__)

    def _removed(self, side):
        def on_removed(record):   # as the store's: the slot is freed
            self.freed[side].append(("removed", record.page_id, record.offset))
            record.offset = NO_SLOT
        return on_removed

    def _dram_dropped(self, side):
        return lambda record: self.freed[side].append(("dram", record.page_id, record.offset))

    def both(self, page_id):
        return self.py.get(page_id), self.c.get(page_id)


def ids(records):
    return [r.page_id for r in records] if records is not None else None


def ids_or_none(record):
    return record.page_id if record is not None else None


def fields(record):
    return (record.page_id, record.parent.page_id if record.parent is not None else None, record.offset,
            record.slot_bytes, record.checksum, record.pins, record.hits, record.tick, record.alive,
            record.on_nvme, record.busy, record.anchor, record.tenant, record.in_dram, record.is_leaf(),
            sorted(c.page_id for c in record.children or ()), record.nvme_refused_bytes)


def same_state(pair: Pair) -> None:
    py, c = pair.py, pair.c
    py.check_prefix_closed()
    c.check_prefix_closed()
    assert len(py) == len(c) and py.dram_pages == c.dram_pages and py.nvme_pages == c.nvme_pages
    assert sorted(py.page_ids()) == sorted(c.page_ids())
    for page_id in py.page_ids():
        assert fields(py.get(page_id)) == fields(c.get(page_id))
    assert {t: vars_of(u) for t, u in py.usage.items()} == {t: vars_of(u) for t, u in c.usage.items()}
    assert {k: v for k, v in py.pages_by_namespace.items() if v} == {k: v for k, v in c.pages_by_namespace.items() if v}
    for ns in TENANTS:
        assert sorted(py.scan(0, 1 << 31, ns, keys=True)[0]) == sorted(c.scan(0, 1 << 31, ns, keys=True)[0])
        assert sorted(ids(py.roots(ns))) == sorted(ids(c.roots(ns)))
    assert pair.freed[0] == pair.freed[1]


def vars_of(usage):
    return usage.dram_pages, usage.nvme_pages, usage.nvme_bytes


def step(pair: Pair, rng: random.Random, pool: list[bytes], pinned: list, offsets: list[int]) -> None:
    py, c = pair.py, pair.c
    alive = py.page_ids()
    op = rng.random()
    if op < 0.3 or not alive:   # a chain: under a random page, a root, or anchored at an absent key
        ns = rng.choice(list(TENANTS))
        under = [p for p in alive if p[0] == ns]
        parent_id = rng.choice(under) if under and rng.random() < 0.6 else None
        anchor = random_key(rng, pool) if parent_id is None and rng.random() < 0.3 else b""
        if anchor and (ns, anchor) in py:
            anchor = b""
        parents = pair.both(parent_id) if parent_id else (None, None)
        added = ([], [])
        size = rng.choice(SIZES)
        if not anchor and rng.random() < 0.4:   # a commit's chain in one call, with or without its records
            keys = list(dict.fromkeys(key for key in (random_key(rng, pool) for _ in range(rng.randrange(1, 6)))
                                      if (ns, key) not in py))
            chain_offsets = [offsets.pop() for _ in keys[:len(offsets)]]
            keys = keys[:len(chain_offsets)]
            checksums = [rng.getrandbits(64) for _ in keys]
            records = rng.random() < 0.5
            got = [index.add_chain(ns, keys, parent, chain_offsets, size, checksums, records=records)
                   for index, parent in zip((py, c), parents)]
            assert ids(got[0]) == ids(got[1]) == [(ns, key) for key in keys] if records else got == [len(keys)] * 2
            return
        for _ in range(rng.randrange(1, 6)):
            key = random_key(rng, pool)
            if (ns, key) in py:
                break
            offset = offsets.pop() if offsets and rng.random() < 0.8 else NO_SLOT
            on_nvme = offset == NO_SLOT or rng.random() < 0.2
            checksum = rng.getrandbits(64)
            parents = tuple(index.add((ns, key), parent, offset, size, checksum, on_nvme=on_nvme, anchor=anchor)
                            for index, parent in zip((py, c), parents))
            anchor = b""
            added[0].append(parents[0])
            added[1].append(parents[1])
        py.touch_all(added[0])
        c.touch_all(added[1])
    elif op < 0.4:   # touched, or read (a hit each too), after asking how many lead in DRAM
        chosen = rng.sample(alive, min(len(alive), rng.randrange(1, 5)))
        group = ([py.get(p) for p in chosen], [c.get(p) for p in chosen])
        assert py.ready_prefix(group[0]) == c.ready_prefix(group[1])
        touch = "read_all" if rng.random() < 0.5 else "touch_all"
        getattr(py, touch)(group[0])
        getattr(c, touch)(group[1])
    elif op < 0.5:
        chosen = rng.sample(alive, min(len(alive), rng.randrange(1, 4)))
        hit = rng.random() < 0.5
        group = ([py.get(p) for p in chosen], [c.get(p) for p in chosen])
        py.pin_all(group[0], hit)
        c.pin_all(group[1], hit)
        pinned.append(group)
    elif op < 0.58 and pinned:
        group = pinned.pop(rng.randrange(len(pinned)))
        py.unpin_all(group[0])
        c.unpin_all(group[1])
    elif op < 0.64:   # a run of victims in one call, freed by the caller
        size = rng.choice(SIZES + (None,))
        clean_only = rng.random() < 0.3
        tenant = rng.choice(("a", "b", "nobody", None))
        until_bytes = rng.choice((0, 0, 4096, 12288, 20000))
        count = rng.randrange(0, 8)
        cold = clean_only and rng.random() < 0.5
        got = (py.evict_dram_many(size, clean_only, count, tenant, until_bytes, older_than_unsaved=cold),
               c.evict_dram_many(size, clean_only, count, tenant, until_bytes, older_than_unsaved=cold))
        assert got[0] == got[1]
        assert len(got[0][0]) <= count and NO_SLOT not in got[0][0]
        if tenant is not None:
            assert set(got[0][1]) <= {tenant}
        offsets.extend(got[0][0])   # the slots are free again
    elif op < 0.7:
        size = rng.choice(SIZES + (None,))
        clean_only = rng.random() < 0.3
        tenant = rng.choice(("a", "b", "nobody", None))
        cold = clean_only and rng.random() < 0.5
        got = (py.evict_dram(size, clean_only, tenant, older_than_unsaved=cold),
               c.evict_dram(size, clean_only, tenant, older_than_unsaved=cold))
        assert ids_or_none(got[0]) == ids_or_none(got[1])
    elif op < 0.77:
        shard = rng.choice((0, 1, None))
        tenant = rng.choice(("a", "b", None))
        count = rng.randrange(1, 4)
        taken = (py.evict_nvme(shard, count, tenant), c.evict_nvme(shard, count, tenant))
        assert ids(taken[0]) == ids(taken[1])
    elif op < 0.84:
        page_id = rng.choice(alive)
        on = rng.random() < 0.7 or not py.get(page_id).in_dram   # a page is held somewhere
        for index in (py, c):
            index.set_on_nvme(index.get(page_id), on, page_id[1][0] % 2)
    elif op < 0.88:
        page_id = rng.choice(alive)
        records = pair.both(page_id)
        if not records[0].in_dram and offsets:
            offset = offsets.pop()
            py.set_dram(records[0], offset)
            c.set_dram(records[1], offset)
        elif not records[0].busy:   # a move: busy and pinned, then released
            for record in records:
                record.busy = True
                record.pins += 1
            py.release_busy(records[0])
            c.release_busy(records[1])
            py.unpin_all([records[0]])
            c.unpin_all([records[1]])
    elif op < 0.93:
        tenant = rng.choice(("a", "b", None))
        for page_id in rng.sample(alive, min(len(alive), 2)):
            value = rng.choice((-1, 0, rng.randrange(1 << 20)))
            for record in pair.both(page_id):
                record.nvme_refused_bytes = value
        count = rng.randrange(1, 6)
        assert ids(py.dram_only_lru(count, tenant)) == ids(c.dram_only_lru(count, tenant))
    elif op < 0.97:
        page_id = rng.choice(alive)
        if rng.random() < 0.5:
            removed = (py.remove_subtree(py.get(page_id)), c.remove_subtree(c.get(page_id)))
        else:   # the slots come back to the caller: the same ones, page by page
            (py_records, py_slots), (c_records, c_slots) = (py.remove_subtree_slots(py.get(page_id)),
                                                            c.remove_subtree_slots(c.get(page_id)))
            removed = (py_records, c_records)
            assert sorted(zip(ids(py_records), py_slots)) == sorted(zip(ids(c_records), c_slots))
        assert sorted(ids(removed[0])) == sorted(ids(removed[1]))
        # set iteration order decides the Python index's removal order: compare what was freed as sets
        pair.freed[0].sort()
        pair.freed[1].sort()
    else:
        ns = rng.choice(list(TENANTS))
        keys = [p[1] for p in alive if p[0] == ns][:3] + [random_key(rng, pool)]
        rng.shuffle(keys)
        assert ids(py.leading(ns, keys)) == ids(c.leading(ns, keys))
        assert py.leading_places(ns, keys) == c.leading_places(ns, keys)
        assert py.positions_held(ns, keys) == c.positions_held(ns, keys)


@needs_native
@pytest.mark.parametrize("seed", range(12))
def test_a_random_workload_takes_the_same_pages_in_the_same_order(seed):
    rng = random.Random(seed)
    pair, pool, pinned = Pair(), [], []
    offsets = [i * 4096 for i in range(4000)]
    rng.shuffle(offsets)
    for _ in range(600):
        step(pair, rng, pool, pinned, offsets)
        same_state(pair)
    while pinned:
        group = pinned.pop()
        pair.py.unpin_all(group[0])
        pair.c.unpin_all(group[1])
    same_state(pair)


@needs_native
def test_touches_far_outnumbering_the_pages_keep_the_eviction_order():
    """Most offers come in order (a touch), some do not (a parent whose last child left, at its older
    tick). Touches of a hot half pile stale entries up to several times the pages, and each compaction
    must keep the cold half's live ones. Both indexes evict the same pages in the same order throughout."""
    rng = random.Random(3)
    pair = Pair()
    pages = []
    for chain in range(40):
        keys = [f"c{chain}-{i}".encode() for i in range(rng.randrange(1, 4))]
        offsets = [4096 * (len(pages) + i) for i in range(len(keys))]
        for index in (pair.py, pair.c):
            index.add_chain(1, keys, None, offsets, 4096, list(range(len(keys))), records=False)
        pages += [(1, key) for key in keys]
    hot = pages[len(pages) // 2:]
    for round_ in range(600):
        touched = [page_id for page_id in rng.sample(hot, 12) if pair.py.get(page_id) is not None]
        for index in (pair.py, pair.c):
            index.touch_all([index.get(page_id) for page_id in touched])
        if round_ % 50 == 49:
            count = rng.randrange(1, 4)
            assert pair.c.evict_dram_many(4096, False, count) == pair.py.evict_dram_many(4096, False, count)
    same_state(pair)
    while len(pair.py):
        assert pair.c.evict_dram_many(4096, False, 5) == pair.py.evict_dram_many(4096, False, 5)
    assert len(pair.c) == 0


@needs_native
def test_packed_keys_give_the_same_leading_pages():
    index = native_index.NativePageIndex(lambda r: None, lambda r: None)
    keys = [bytes([i]) * 32 for i in range(1, 9)]
    parent = None
    for i, key in enumerate(keys):
        parent = index.add((7, key), parent, i * 4096, 4096, i)
    packed = b"".join(keys[:5]) + b"\0" * 32 + keys[5]
    assert index.leading(7, packed, key_bytes=32) == index.leading(7, keys[:5])
    assert index.leading_places(7, packed, key_bytes=32) == bytes([1] * 5)
    with pytest.raises(ValueError, match="multiple of key_bytes"):
        index.leading(7, packed[:-1], key_bytes=32)
    reference = PageIndex(lambda r: None, lambda r: None)
    reference.add_chain(7, keys, None, [i * 4096 for i in range(8)], 4096, list(range(8)))
    assert reference.leading_places(7, packed, key_bytes=32) == index.leading_places(7, packed, key_bytes=32)
    with pytest.raises(ValueError, match="multiple of key_bytes"):
        reference.leading_places(7, packed[:-1], key_bytes=32)


@pytest.mark.parametrize("implementation", [PageIndex, pytest.param(getattr(native_index, "NativePageIndex", None),
                                                                    marks=needs_native)])
def test_digests_find_the_pages_of_their_hex_keys_and_no_others(implementation):
    """A hex key's 32 bytes (digests=True) name the page of its 64 lowercase digits; the same 32 bytes as a
    key of their own, and the digits in uppercase, are other keys."""
    index = implementation(lambda r: None, lambda r: None)
    rng = random.Random(3)
    keys = [rng.randbytes(32).hex().encode() for _ in range(6)]
    parent = None
    for i, key in enumerate(keys):
        parent = index.add((7, key), parent, i * 4096, 4096, i)
    raw = index.add((7, bytes.fromhex(keys[0].decode())[::-1]), None, 6 * 4096, 4096, 6)   # a 32-byte key
    index.set_on_nvme(index.get((7, keys[3])), True)
    assert index.evict_dram(4096, True) is not None
    digests = b"".join(bytes.fromhex(k.decode()) for k in keys)
    assert index.leading_places(7, digests, key_bytes=32, digests=True) == \
        index.leading_places(7, b"".join(keys), key_bytes=64) == bytes([1, 1, 1, 2, 1, 1])
    assert index.places_each(7, digests[32:] + digests[:32], key_bytes=32, digests=True) == bytes([1, 1, 2, 1, 1, 1])
    assert index.places_each(7, raw.page_id[1], key_bytes=32, digests=True) == b"\0"   # not the 32-byte key
    assert index.places_each(7, raw.page_id[1], key_bytes=32) == b"\1"
    assert index.places_each(7, keys[0].upper(), key_bytes=64) == b"\0"
    with pytest.raises(ValueError, match="key_bytes=64"):
        index.leading_places(7, b"".join(keys), key_bytes=64, digests=True)


@pytest.mark.parametrize("implementation", [PageIndex, pytest.param(getattr(native_index, "NativePageIndex", None),
                                                                    marks=needs_native)])
def test_add_chain_links_each_page_under_the_one_before(implementation):
    index = implementation(lambda r: None, lambda r: None)
    root = index.add((1, b"r"), None, 0, 4096, 0)
    records = index.add_chain(1, [b"x", b"y", b"z"], root, [4096, 8192, 12288], 4096, [1, 2, 3])
    assert [r.parent for r in records] == [root, records[0], records[1]]
    assert [r.checksum for r in records] == [1, 2, 3] and records[2].is_leaf()
    assert len({r.tick for r in records}) == 1 and records[0].tick > 0   # touched together
    assert index.add_chain(1, [b"v", b"w"], records[2], [16384, 20480], 4096, [4, 5], records=False) == 2
    assert [r.page_id for r in index.leading(1, [b"r", b"x", b"y", b"z", b"v", b"w"])][-1] == (1, b"w")
    assert index.positions_held(1, [b"nope", b"w", b"q", b"r"]) == [1, 3]
    assert index.positions_held(99, [b"w"]) == []
    leaf = index.get((1, b"w"))
    assert index.evict_dram(4096, False) is leaf and not leaf.alive   # the new leaf was offered for eviction
    index.check_prefix_closed()


@pytest.mark.parametrize("implementation", [PageIndex, pytest.param(getattr(native_index, "NativePageIndex", None),
                                                                    marks=needs_native)])
def test_a_read_lease_keeps_the_pages_before_the_first_gone_or_not_in_dram(implementation):
    index = implementation(lambda r: None, lambda r: None)
    chain = index.add_chain(1, [b"a", b"b", b"c", b"d"], None, [0, 4096, 8192, 12288], 4096, [1, 2, 3, 4])
    nvme_only = index.add((1, b"e"), chain[-1], NO_SLOT, 4096, 5, on_nvme=True)
    assert index.ready_prefix(chain) == 4 and index.ready_prefix(chain + [nvme_only]) == 4
    assert index.ready_prefix([]) == 0
    index.read_all(chain[:2])
    assert [r.hits for r in chain] == [1, 1, 0, 0] and chain[0].tick == chain[1].tick > chain[2].tick
    index.remove_subtree(chain[2])   # c and everything under it
    assert not chain[2].alive and index.ready_prefix(chain) == 2


@pytest.mark.parametrize("implementation", [PageIndex, pytest.param(getattr(native_index, "NativePageIndex", None),
                                                                    marks=needs_native)])
def test_a_clean_page_is_taken_older_than_unsaved_only_while_it_is_the_oldest(implementation):
    index = implementation(lambda r: None, lambda r: None)
    old_clean = index.insert((1, b"old"), None, 0, 4096, 1)
    index.set_on_nvme(old_clean, True)
    index.touch_all([old_clean])
    unsaved = index.add_chain(1, [b"u"], None, [4096], 4096, [2])
    index.touch_all(unsaved)
    hot = index.insert((1, b"hot"), None, 8192, 4096, 3)
    index.set_on_nvme(hot, True)
    index.touch_all([hot])                       # read last: the most recently used page
    assert index.evict_dram(4096, True, older_than_unsaved=True) is old_clean
    assert index.evict_dram_many(4096, True, 5, older_than_unsaved=True) == ([], [])   # the unsaved page is older
    assert hot.in_dram and unsaved[0].in_dram
    assert index.evict_dram_many(4096, True, 5) == ([8192], [""])   # without the flag: any clean page
    index.check_prefix_closed()


@pytest.mark.parametrize("implementation", [PageIndex, pytest.param(getattr(native_index, "NativePageIndex", None),
                                                                    marks=needs_native)])
def test_a_run_of_victims_is_taken_leaf_first_and_handed_back_without_callbacks(implementation):
    called = []
    index = implementation(called.append, called.append, lambda ns: {1: "a", 2: "b"}[ns])
    index.add_chain(1, [b"x", b"y", b"z"], None, [0, 4096, 8192], 4096, [1, 2, 3])
    index.add_chain(2, [b"u", b"v"], None, [12288, 16384], 4096, [4, 5])
    clean = index.insert((1, b"w"), None, 20480, 4096, 6)
    index.set_on_nvme(clean, True)
    held = index.get((1, b"z"))
    assert index.evict_dram_many(4096, False, 2) == ([8192, 4096], ["a", "a"])   # leaf first, its parent next
    assert not held.alive and held.offset == NO_SLOT and index.dram_pages == 4
    # a run for one tenant takes only its pages; a clean page keeps its record on NVMe
    assert index.evict_dram_many(4096, False, 5, "b") == ([16384, 12288], ["b", "b"])
    assert index.evict_dram_many(4096, True, 5) == ([20480], ["a"])
    assert clean.alive and clean.on_nvme and not clean.in_dram and index.get((1, b"w")) is clean
    assert index.evict_dram_many(4096, False, 5) == ([0], ["a"]) and index.evict_dram_many(4096, False, 5) == ([], [])
    assert called == [] and len(index) == 1 and index.dram_pages == 0
    index.check_prefix_closed()


@pytest.mark.parametrize("implementation", [PageIndex, pytest.param(getattr(native_index, "NativePageIndex", None),
                                                                    marks=needs_native)])
def test_a_run_for_one_tenant_stops_once_its_slots_add_up_to_the_bytes_asked(implementation):
    index = implementation(lambda r: None, lambda r: None, lambda ns: {1: "a", 2: "b"}[ns])
    index.insert((2, b"other"), None, 0, 4096, 0)                       # the oldest, but another tenant's
    index.add_chain(1, [b"big"], None, [8192], 8192, [1])
    index.add_chain(1, [b"x", b"y"], None, [16384, 20480], 4096, [2, 3])
    assert index.evict_dram_many(None, False, 10, tenant="a", until_bytes=10000) == ([8192, 20480], ["a", "a"])
    assert index.evict_dram_many(None, False, 10, tenant="nobody") == ([], [])
    assert index.evict_dram_many(None, False, 10, until_bytes=1) == ([0], ["b"])
    assert len(index) == 1 and index.dram_pages == 1


@needs_native
def test_a_record_is_the_same_object_while_held_and_a_removed_one_stays_readable():
    freed = []
    index = native_index.NativePageIndex(lambda r: freed.append(r.offset), lambda r: None)
    record = index.add((1, b"k" * 64), None, 4096, 4096, 99)
    assert index.get((1, b"k" * 64)) is record and {record} == {index.leading(1, [b"k" * 64])[0]}
    index.pin_all([record], hit=True)
    assert index.remove_subtree(record) == [record] and not record.alive and freed == []
    assert record.offset == 4096 and record.checksum == 99 and record.page_id == (1, b"k" * 64)
    index.unpin_all([record])
    assert freed == [4096]
    # the key may come back as a new page while the old record is still held
    again = index.add((1, b"k" * 64), None, 8192, 4096, 7)
    assert again is not record and again.alive and not record.alive and record.offset == 4096


@needs_native
def test_keys_that_are_almost_lowercase_hex_stay_distinct_keys():
    """A 64-byte key is stored decoded only when every byte is a lowercase hex digit; one that is
    not, at any position, is a key of its own, as in the Python index."""
    rng = random.Random(5)
    hex_key = rng.randbytes(32).hex().encode()
    every_digit = b"0123456789abcdef" * 4
    near = [hex_key[:i] + bytes([c]) + hex_key[i + 1:] for i in (0, 1, 15, 16, 31, 32, 47, 62, 63)
            for c in b"AFg/:`\x80\xff"]
    keys = [hex_key, every_digit, every_digit[::-1], hex_key.upper(), *near]
    pair = Pair()
    for offset, key in enumerate(keys):
        for index in (pair.py, pair.c):
            index.add((1, key), None, offset * 4096, 4096, offset)
    for key in keys:
        py, c = pair.both((1, key))
        assert c.page_id == py.page_id == (1, key) and c.offset == py.offset
    packed = b"".join(keys)
    assert [r.offset for r in pair.c.leading(1, packed, key_bytes=64)] == [i * 4096 for i in range(len(keys))]
    assert pair.c.leading_places(1, packed, key_bytes=64) == bytes([1] * len(keys))


@needs_native
def test_leading_pages_probed_in_blocks_stop_where_a_key_by_key_probe_stops():
    """The C index hashes and fetches a block of keys before probing them: a miss, a page on NVMe and a key
    that is not bytes must count where each is, whatever block they fall in, as in the Python index."""
    pair = Pair()
    keys = [f"chain-{i}".encode() for i in range(70)]
    for index in (pair.py, pair.c):
        index.add_chain(3, keys, None, [i * 4096 for i in range(70)], 4096, list(range(70)))
        index.get((3, keys[33])).offset = NO_SLOT   # on NVMe only
    for cut in (0, 1, 15, 16, 17, 40, 69):
        asked = keys[:cut] + [b"absent"] + keys[cut + 1:]
        for index in (pair.py, pair.c):
            assert len(index.leading(3, asked)) == cut
            assert index.leading_places(3, asked) == bytes(2 if i == 33 else 1 for i in range(cut))
            assert len(index.leading(3, asked[:cut + 2] + [None])) == cut   # raises only once reached
    places = pair.c.leading_places(3, keys)
    assert places == pair.py.leading_places(3, keys) and places[33] == 2 and places.count(1) == 69
    for at in (0, 5, 16, 31):
        with pytest.raises(TypeError, match="keys are bytes"):
            pair.c.leading(3, keys[:at] + [None])


def test_the_node_takes_the_python_index_when_told_or_when_the_c_one_is_not_built():
    assert type(native_index.make_page_index(False, print, print, str)) is PageIndex
    expected = "NativePageIndex" if native_index.available() else "PageIndex"
    assert type(native_index.make_page_index(True, print, print, str)).__name__ == expected


@needs_native
def test_keys_stay_found_as_the_key_table_grows_and_pages_leave():
    """Thousands of pages of every key form: the key table grows (rehashed from the page slots) and
    shrinks its probe runs as pages leave; each key is found, or found absent, as the Python index says."""
    rng = random.Random(7)
    pair, pool = Pair(), []
    keys = list(dict.fromkeys(random_key(rng, pool) for _ in range(6000)))
    for start in range(0, len(keys), 500):
        chain = keys[start:start + 500]
        for index in (pair.py, pair.c):
            index.add_chain(1, chain, None, [4096 * (start + i) for i in range(len(chain))], 4096,
                            list(range(len(chain))), records=False)
    for key in rng.sample(keys, 40):   # each takes the rest of its chain with it
        for index in (pair.py, pair.c):
            record = index.get((1, key))
            if record is not None:
                index.remove_subtree(record)
    pair.freed[0].sort()
    pair.freed[1].sort()
    probe = keys + [random_key(rng, []) for _ in range(500)]
    assert pair.c.positions_held(1, probe) == pair.py.positions_held(1, probe)
    assert len(pair.c) == len(pair.py) < len(keys) * 3 // 4
    same_state(pair)


@needs_native
def test_a_page_read_past_two_to_the_32_times_stays_readable():
    """hits saturates: after 2**32 gets (50 days at 1,000 a second) a hot page is still served."""
    index = native_index.NativePageIndex(lambda r: None, lambda r: None)
    record = index.add((1, b"hot"), None, 0, 4096, 0)
    record.hits = 2**32 - 1
    record.hits += 1                       # the store's count of a hit
    index.pin_all([record], hit=True)      # and the index's own
    assert record.hits == 2**32 - 1 and record.pins == 1
    record.hits = 2**70
    assert record.hits == 2**32 - 1


@pytest.mark.parametrize("implementation", [PageIndex, pytest.param(getattr(native_index, "NativePageIndex", None),
                                                                    marks=needs_native)])
def test_places_each_says_where_each_key_is_on_its_own(implementation):
    index = implementation(lambda r: None, lambda r: None)
    root = index.add((1, b"r"), None, 0, 4096, 0)
    on_nvme = index.add((1, b"n"), root, 4096, 4096, 1)
    index.set_on_nvme(on_nvme, True)
    assert index.evict_dram(4096, True) is on_nvme                      # now on NVMe only
    assert index.places_each(1, [b"r", b"x", b"n"]) == b"\x01\x00\x02"   # DRAM, not held, NVMe only
    assert index.places_each(1, b"rxn", key_bytes=1) == b"\x01\x00\x02"
    assert index.places_each(9, [b"r"]) == b"\x00" and index.places_each(1, []) == b""
    with pytest.raises(ValueError, match="multiple of key_bytes"):
        index.places_each(1, b"rxn", key_bytes=2)


@needs_native
@pytest.mark.parametrize("limit", [-1, 0, 1, 3, 5, 8, 20])
def test_remove_subtree_slots_takes_the_pages_remove_subtree_takes_in_its_order(limit):
    """A branching tree, cut short by each limit: the slots variant removes the same pages, leaves first,
    each page's slot beside it (it walks the subtree before it removes anything)."""
    def tree():
        index = native_index.NativePageIndex(lambda r: None, lambda r: None)
        offsets = iter(range(0, 1 << 30, 4096))
        top = index.add((1, b"top"), None, next(offsets), 4096, 0)
        for branch in range(3):   # three children of the top, each with a chain, one of them branching again
            node = index.add((1, b"b%d" % branch), top, next(offsets), 4096, 0)
            for depth in range(2):
                node = index.add((1, b"b%d-%d" % (branch, depth)), node, next(offsets), 4096, 0)
                if branch == 1:
                    index.add((1, b"b1-side%d" % depth), node, next(offsets), 4096, 0)
        index.add((1, b"outside"), None, next(offsets), 4096, 0)
        return index, top
    plain, top = tree()
    expected = [(r.page_id, r.offset) for r in plain.remove_subtree(top, limit)] if limit else []
    index, top = tree()
    records, slots = index.remove_subtree_slots(top, limit)
    assert [(r.page_id, offset) for r, offset in zip(records, slots)] == expected
    assert len(records) == (12 if limit == -1 else min(limit, 12))
    assert len(index) == 13 - len(records) and index.get((1, b"outside")) is not None
    index.check_prefix_closed()
