/* The page index's lazy-deletion LRU heaps: entries (tick, seq, slot), stale ones skipped when they
 * reach the top, under the rules of PageIndex._dram_evictable / _nvme_evictable (index.py).
 *
 * Nearly every entry is offered in order: a touch offers its pages at the newest tick. Those go to a
 * queue (`run`), appended and popped in O(1). The few that are not (a parent offered at its older tick
 * when its last child leaves; entries pushed back) go to a binary heap, which stays small. The oldest
 * entry is the older of the two fronts: every seq differs, so the order is exactly that of one heap.
 * One heap of a full cache's entries is larger than the CPU's caches, and each eviction sifted through
 * it twice (the victim out, its parent in): about 380 ns a victim at 262k pages. */
#include <string.h>

#include "page_index_parts.h"

/* ---------------------------------------------------------------- heaps */

int entry_less(const entry_t *a, const entry_t *b) {
    uint64_t ta = order_tick(a->tick), tb = order_tick(b->tick);
    return ta < tb || (ta == tb && a->seq < b->seq);
}

static void heap_sift_down(heap_t *h, size_t i) {
    entry_t item = h->items[i];
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= h->count)
            break;
        if (child + 1 < h->count && entry_less(&h->items[child + 1], &h->items[child]))
            child++;
        if (!entry_less(&h->items[child], &item))
            break;
        h->items[i] = h->items[child];
        i = child;
    }
    h->items[i] = item;
}

static void heap_heapify(heap_t *h) {
    for (size_t i = h->count / 2; i-- > 0;)
        heap_sift_down(h, i);
}

/* Double an array of entries (at least 16); -1 with MemoryError set when there is no memory. */
static int grow_entries(entry_t **items, size_t *capacity) {
    size_t grown = *capacity ? *capacity * 2 : 16;
    entry_t *larger = realloc(*items, grown * sizeof *larger);
    if (!larger) {
        PyErr_NoMemory();
        return -1;
    }
    *items = larger;
    *capacity = grown;
    return 0;
}

static int run_append(heap_t *h, entry_t item) {
    if (h->run_end == h->run_capacity) {
        size_t live = h->run_end - h->run_head;
        /* at least half of it popped: slide the rest down; else grow it */
        if (!(h->run_head && h->run_head >= live) && grow_entries(&h->run, &h->run_capacity) < 0)
            return -1;
        memmove(h->run, h->run + h->run_head, live * sizeof *h->run);
        h->run_head = 0;
        h->run_end = live;
    }
    h->run[h->run_end++] = item;
    return 0;
}

int heap_push(heap_t *h, entry_t item) {
    if (h->run_head == h->run_end || !entry_less(&item, &h->run[h->run_end - 1]))
        return run_append(h, item);
    if (h->count == h->capacity && grow_entries(&h->items, &h->capacity) < 0)
        return -1;
    size_t i = h->count++;
    while (i) {
        size_t up = (i - 1) / 2;
        if (!entry_less(&item, &h->items[up]))
            break;
        h->items[i] = h->items[up];
        i = up;
    }
    h->items[i] = item;
    return 0;
}

size_t heap_size(const heap_t *h) {
    return h->count + (h->run_end - h->run_head);
}

/* The oldest entry, or NULL when there is none. */
const entry_t *heap_top(const heap_t *h) {
    const entry_t *queued = h->run_head < h->run_end ? &h->run[h->run_head] : NULL;
    if (!h->count)
        return queued;
    return queued && entry_less(queued, &h->items[0]) ? queued : &h->items[0];
}

/* Take the oldest entry (there is one). */
entry_t heap_pop(heap_t *h) {
    if (heap_top(h) != h->items) {
        entry_t top = h->run[h->run_head++];
        if (h->run_head == h->run_end)
            h->run_head = h->run_end = 0;
        return top;
    }
    entry_t top = h->items[0];
    h->items[0] = h->items[--h->count];
    if (h->count)
        heap_sift_down(h, 0);
    return top;
}

void heap_free(heap_t *h) {
    free(h->items);
    free(h->run);
}

int dram_evictable(const index_t *self, const entry_t *e, int clean) {
    const page_t *p = &self->pages[e->page];
    return (p->flags & F_ALIVE) && p->tick == e->tick && in_dram(p) && p->pins == 0 && !(p->flags & F_BUSY)
           && ((p->flags & F_NVME) != 0) == clean && (clean || p->child == NONE);
}

int nvme_evictable(const index_t *self, const entry_t *e) {
    const page_t *p = &self->pages[e->page];
    if (!((p->flags & F_ALIVE) && p->tick == e->tick && (p->flags & F_NVME) && p->pins == 0
          && !(p->flags & F_BUSY) && (in_dram(p) || p->child == NONE)))
        return 0;
    for (uint32_t c = p->child; c != NONE; c = self->pages[c].next)
        if (self->pages[c].flags & F_NVME)
            return 0;
    return 1;
}

int entry_evictable(const index_t *self, const heap_t *h, const entry_t *e) {
    return h->nvme ? nvme_evictable(self, e) : dram_evictable(self, e, h->clean);
}

/* The heap of this key, made when first asked for; NULL with an error set if out of memory. */
heap_t *heap_for(index_t *self, int nvme, uint16_t tenant, uint32_t slot_bytes, int clean) {
    for (size_t i = 0; i < self->heap_count; i++) {
        heap_t *h = &self->heaps[i];
        if (h->nvme == nvme && h->tenant == tenant && h->slot_bytes == slot_bytes && (nvme || h->clean == clean))
            return h;
    }
    heap_t *heaps = realloc(self->heaps, (self->heap_count + 1) * sizeof *heaps);
    if (!heaps) {
        PyErr_NoMemory();
        return NULL;
    }
    self->heaps = heaps;
    heap_t *h = &heaps[self->heap_count++];
    memset(h, 0, sizeof *h);
    h->nvme = (uint8_t)nvme;
    h->tenant = tenant;
    h->slot_bytes = slot_bytes;
    h->clean = (uint8_t)(nvme ? 0 : clean);
    return h;
}

int heap_offer(index_t *self, heap_t *h, entry_t entry) {
    if (heap_push(h, entry) < 0)
        return -1;
    if (heap_size(h) > 64 && heap_size(h) > 4 * (size_t)self->alive) {   /* drop the stale entries */
        size_t kept = 0;
        for (size_t i = 0; i < h->count; i++)
            if (entry_evictable(self, h, &h->items[i]))
                h->items[kept++] = h->items[i];
        h->count = kept;
        heap_heapify(h);
        kept = 0;
        for (size_t i = h->run_head; i < h->run_end; i++)
            if (entry_evictable(self, h, &h->run[i]))
                h->run[kept++] = h->run[i];
        h->run_head = 0;
        h->run_end = kept;
    }
    return 0;
}

/* PageIndex._offer: put the page's current state up for eviction. */
int offer(index_t *self, uint32_t page) {
    page_t *p = &self->pages[page];
    if (p->pins)
        return 0;
    int nvme = (p->flags & F_NVME) != 0;
    int dram = in_dram(p) && (nvme || p->child == NONE);
    if (!(dram || nvme))
        return 0;
    entry_t entry = {p->tick, self->seq++, page};
    if (dram) {
        heap_t *h = heap_for(self, 0, p->tenant, p->slot_bytes, nvme);
        if (!h || heap_offer(self, h, entry) < 0)
            return -1;
    }
    if (nvme) {
        heap_t *h = heap_for(self, 1, p->tenant, p->shard, 0);
        if (!h || heap_offer(self, h, entry) < 0)
            return -1;
    }
    return 0;
}

/* The heap among `selected` whose top is the least recently used evictable entry, stale tops dropped. */
heap_t *oldest_heap(index_t *self, heap_t **selected, size_t count) {
    heap_t *best = NULL;
    for (size_t i = 0; i < count; i++) {
        heap_t *h = selected[i];
        while (heap_size(h) && !entry_evictable(self, h, heap_top(h)))
            heap_pop(h);
        if (heap_size(h) && (!best || entry_less(heap_top(h), heap_top(best))))
            best = h;
    }
    return best;
}

