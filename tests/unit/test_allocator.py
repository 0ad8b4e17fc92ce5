"""The slab allocator hands out aligned slots per size and returns empty slabs to the pool."""

from kvstore.tiers.dram import SLOT_ALIGN, SlabAllocator, slot_bytes_for

SLAB = 64 * 1024


def test_slots_are_aligned_and_distinct():
    alloc = SlabAllocator(4 * SLAB, SLAB)
    size = slot_bytes_for(5000)
    assert size == 8192
    offsets = alloc.allocate_many(size, 20)
    assert len(set(offsets)) == 20
    assert all(o % SLOT_ALIGN == 0 for o in offsets)
    assert alloc.used_bytes == 20 * size


def test_full_means_fewer_slots_not_an_error():
    alloc = SlabAllocator(2 * SLAB, SLAB)
    assert len(alloc.allocate_many(SLAB // 2, 10)) == 4
    assert alloc.allocate(SLAB // 2) is None


def test_an_emptied_slab_serves_another_size():
    alloc = SlabAllocator(SLAB, SLAB)
    small = alloc.allocate_many(4096, 16)
    assert alloc.allocate(SLAB) is None
    for offset in small:
        alloc.free(offset)
    assert alloc.has_free_slab() and alloc.used_bytes == 0
    assert alloc.allocate(SLAB) == 0
