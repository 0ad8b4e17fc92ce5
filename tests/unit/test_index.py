"""The page index stays prefix-closed: eviction takes least recently used unpinned leaves only."""

import pytest

from kvstore.control import native_index
from kvstore.control.index import NO_SLOT, PageIndex

SLOT = 4096


@pytest.fixture
def freed():
    return []


IMPLEMENTATIONS = [pytest.param(PageIndex, id="python"),
                   pytest.param(getattr(native_index, "NativePageIndex", None), id="native",
                                marks=pytest.mark.skipif(not native_index.available(),
                                                         reason="kvstore_native is not built"))]


@pytest.fixture(params=IMPLEMENTATIONS)
def index(request, freed):
    return request.param(on_removed=lambda record: freed.append(record.page_id[1]),
                         on_dram_dropped=lambda record: freed.append(b"dram:" + record.page_id[1]))


def chain(index, name, length, ns=1):
    records, parent = [], None
    for i in range(length):
        parent = index.insert((ns, f"{name}{i}".encode()), parent, offset=len(records) * SLOT,
                              slot_bytes=SLOT, checksum=i)
        records.append(parent)
    return records


def test_eviction_takes_leaves_oldest_first(index, freed):
    chain(index, "a", 3)
    chain(index, "b", 2)
    evicted = [index.evict_dram(SLOT, clean_only=False).page_id[1] for _ in range(5)]
    # a2 is the oldest leaf; its parent a1 becomes a leaf older than b's, and so on
    assert evicted == [b"a2", b"a1", b"a0", b"b1", b"b0"]
    assert freed == evicted
    assert index.evict_dram(SLOT, clean_only=False) is None
    index.check_prefix_closed()


def test_touch_moves_a_chain_to_the_back(index):
    a = chain(index, "a", 2)
    chain(index, "b", 2)
    index.pin_all(a, hit=True)
    index.unpin_all(a)
    assert index.evict_dram(SLOT, clean_only=False).page_id[1] == b"b1"


def test_pinned_pages_are_never_evicted(index, freed):
    a = chain(index, "a", 2)
    index.pin_all(a, hit=True)
    assert index.evict_dram(SLOT, clean_only=False) is None
    index.unpin_all(a)
    assert index.evict_dram(SLOT, clean_only=False).page_id[1] == b"a1"


def test_an_interior_page_is_never_evicted_before_its_children(index):
    a = chain(index, "a", 4)
    for _ in range(4):
        victim = index.evict_dram(SLOT, clean_only=False)
        assert victim.is_leaf()
        index.check_prefix_closed()
    assert len(index) == 0 and not any(r.alive for r in a)


def test_remove_subtree_takes_descendants_and_defers_pinned_slots(index, freed):
    a = chain(index, "a", 3)
    branch = index.insert((1, b"x"), a[0], offset=99 * SLOT, slot_bytes=SLOT, checksum=0)
    index.pin_all([a[2]], hit=False)
    assert len(index.remove_subtree(a[1])) == 2
    assert (1, b"a1") not in index and (1, b"a2") not in index
    assert (1, b"x") in index and branch.parent is a[0]
    assert b"a2" not in freed  # still pinned by a reader: its slot is freed at unpin
    index.unpin_all([a[2]])
    assert b"a2" in freed
    index.check_prefix_closed()


def test_remove_subtree_slots_hands_back_the_free_slots_and_defers_pinned_ones(index, freed):
    """The slots of removed pages come back to the caller, with no callback a page; a pinned page's slot is
    held back (NO_SLOT in the answer) and freed through on_removed once its reader unpins it."""
    a = chain(index, "a", 4)
    index.pin_all([a[2]], hit=False)
    records, slots = index.remove_subtree_slots(a[1])
    by_key = dict(zip((r.page_id[1] for r in records), slots))
    assert by_key == {b"a1": 1 * SLOT, b"a2": NO_SLOT, b"a3": 3 * SLOT}
    assert freed == [] and len(index) == 1 and a[1].offset == NO_SLOT
    index.unpin_all([a[2]])
    assert freed == [b"a2"]
    assert index.remove_subtree_slots(a[0], limit=0) == ([], [])
    index.check_prefix_closed()


def test_leading_stops_at_the_first_miss(index):
    chain(index, "a", 3)
    keys = [b"a0", b"a1", b"zz", b"a2"]
    assert [r.page_id[1] for r in index.leading(1, keys)] == [b"a0", b"a1"]
    assert index.leading(2, keys) == []  # another namespace


def test_pages_on_nvme_lose_only_their_dram_copy(index, freed):
    a = chain(index, "a", 3)
    for record in a[:2]:
        index.set_on_nvme(record, True)
    victim = index.evict_dram(SLOT, clean_only=False)  # a0 is interior but on NVMe: only its DRAM copy goes
    assert victim is a[0] and a[0].alive and not a[0].in_dram
    assert freed == [b"dram:a0"]
    assert index.evict_dram(SLOT, clean_only=False) is a[1] and a[1].alive
    assert index.evict_dram(SLOT, clean_only=False) is a[2] and not a[2].alive  # a DRAM-only leaf leaves the index
    index.check_prefix_closed()


def test_nvme_eviction_keeps_what_is_on_disk_prefix_closed(index):
    a = chain(index, "a", 3)
    for record in a:
        index.set_on_nvme(record, True)
    taken = index.evict_nvme(0, 1)
    assert taken == [a[2]]  # the deepest page on NVMe goes first, though a0 is older
    assert a[2].alive and not a[2].on_nvme  # still in DRAM
    assert index.evict_nvme(1, 5) == []  # other shards' pages are not taken


def test_roots_are_kept_per_namespace_not_found_by_a_scan(index, freed):
    chain(index, "a", 3)
    chain(index, "b", 2)
    assert sorted(r.page_id[1] for r in index.roots(1)) == [b"a0", b"b0"]
    index.remove_subtree(index.roots(1)[0])
    assert len(index.roots(1)) == 1 and index.roots(2) == []
    index.check_prefix_closed()


def test_a_page_of_an_absent_parent_is_an_anchored_root_adopted_when_the_parent_returns(index, freed):
    # c0, c1 extend a1, which the index no longer holds (an engine backs up after its own cache hit).
    a = chain(index, "a", 1)
    anchored = index.add((1, b"c0"), None, offset=3 * SLOT, slot_bytes=SLOT, checksum=0, anchor=b"a1")
    index.touch_all([anchored])
    index.insert((1, b"c1"), anchored, offset=4 * SLOT, slot_bytes=SLOT, checksum=0)
    assert index.anchored((1, b"a1")) == {anchored} and anchored.anchor == b"a1"
    assert [r.page_id[1] for r in index.leading(1, [b"a0", b"a1", b"c0", b"c1"])] == [b"a0"]
    assert len(index.leading(1, [b"c0", b"c1"])) == 2
    index.check_prefix_closed()

    a1 = index.insert((1, b"a1"), a[0], offset=5 * SLOT, slot_bytes=SLOT, checksum=0)
    assert anchored.parent is a1 and anchored in a1.children and not anchored.anchor
    assert not index.anchored((1, b"a1"))
    assert len(index.leading(1, [b"a0", b"a1", b"c0", b"c1"])) == 4
    index.check_prefix_closed()
    # Leaf-first again across the joined chain: a1 (touched last) outlives c0 and c1.
    evicted = []
    while (victim := index.evict_dram(SLOT, clean_only=False)) is not None:
        evicted.append(victim.page_id[1])
        index.check_prefix_closed()
    assert evicted.index(b"c1") < evicted.index(b"c0") < evicted.index(b"a1") < evicted.index(b"a0")


def test_an_anchored_page_that_leaves_the_index_leaves_its_anchor(index):
    anchored = index.add((1, b"c0"), None, offset=0, slot_bytes=SLOT, checksum=0, anchor=b"gone")
    index.touch_all([anchored])
    assert index.evict_dram(SLOT, clean_only=False) is anchored
    assert not index.anchored((1, b"gone"))
    index.check_prefix_closed()
    # A parent committed later adopts nothing, and no stale anchor is left behind.
    parent = index.insert((1, b"gone"), None, offset=SLOT, slot_bytes=SLOT, checksum=0)
    assert parent.is_leaf()
    index.check_prefix_closed()


def test_keys_that_name_each_other_never_make_a_cycle(index):
    x = index.add((1, b"x"), None, offset=0, slot_bytes=SLOT, checksum=0, anchor=b"y")
    y = index.add((1, b"y"), x, offset=SLOT, slot_bytes=SLOT, checksum=0)   # y's parent is x; x waits for y
    assert y.parent is x and x.parent is None and not x.anchor and not x.is_leaf()
    assert index.add((1, b"s"), None, offset=2 * SLOT, slot_bytes=SLOT, checksum=0, anchor=b"s").anchor == b""
    index.check_prefix_closed()
