"""The slab allocator hands out cache-line-aligned slots of each page's own size and returns empty slabs to the pool."""

import pytest

from kvstore.tiers.dram import SLOT_ALIGN, SlabAllocator, slot_bytes_for

SLAB = 64 * 1024


def test_slots_are_aligned_and_distinct():
    alloc = SlabAllocator(4 * SLAB, SLAB)
    size = slot_bytes_for(5000)
    assert size == 5056 and SLOT_ALIGN == 64
    offsets = alloc.allocate_many(size, 20)
    assert len(set(offsets)) == 20
    assert all(o % SLOT_ALIGN == 0 for o in offsets)
    assert alloc.used_bytes == 20 * size


@pytest.mark.parametrize("page_bytes", [448, 1024, 1000, 4096 + 64])
def test_a_page_takes_its_own_size_rounded_to_a_cache_line(page_bytes):
    """A 448-byte Mamba state or a 1 KiB indexer page fits an arena at its own size: a slab of 64 KiB holds
    64 KiB // slot of them, not 16 as it did with slots of 4 KiB."""
    size = slot_bytes_for(page_bytes)
    assert page_bytes <= size < page_bytes + 64 and size % 64 == 0
    alloc = SlabAllocator(4 * SLAB, SLAB)
    offsets = alloc.allocate_many(size, 10**6)
    assert len(offsets) == 4 * (SLAB // size) and len(set(offsets)) == len(offsets)
    assert all(o % 64 == 0 and o % SLAB + size <= SLAB for o in offsets)   # no slot crosses its slab
    assert alloc.used_bytes == len(offsets) * size >= alloc.capacity_bytes - 4 * size
    for offset in offsets:
        assert alloc.free(offset) == size
    assert alloc.used_bytes == 0 and alloc.free_slabs() == 4


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
    assert alloc.free_slabs() > 0 and alloc.used_bytes == 0
    assert alloc.allocate(SLAB) == 0


def allocator_state(alloc):
    return (alloc.used_bytes, {holder: list(bases) for holder, bases in alloc._free_slabs.items()},
            {base: list(slab.free) for base, slab in alloc._slabs.items()},
            {key: list(slabs) for key, slabs in alloc._partial.items()})


@pytest.mark.parametrize("pick", ["up", "down", "down across slabs", "scattered"])
def test_slots_freed_together_leave_the_allocator_as_freed_one_by_one(pick):
    """free_many takes a run back a slab at a time; every list and the next allocations end as with free() each."""
    one_by_one, together = SlabAllocator(4 * SLAB, SLAB), SlabAllocator(4 * SLAB, SLAB)
    offsets = one_by_one.allocate_many(4096, 40)
    assert together.allocate_many(4096, 40) == offsets
    freed = {"up": offsets[3:16], "down": offsets[16:3:-1], "down across slabs": offsets[::-1],
             "scattered": offsets[5:30:3]}[pick]
    for offset in freed:
        one_by_one.free(offset)
    together.free_many(freed, 4096)
    assert allocator_state(together) == allocator_state(one_by_one)
    assert together.allocate_many(8192, 20) == one_by_one.allocate_many(8192, 20)
    assert together.allocate_many(4096, 30) == one_by_one.allocate_many(4096, 30)
    assert allocator_state(together) == allocator_state(one_by_one)
