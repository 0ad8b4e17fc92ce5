/* The page index's shared definitions (page_index.c and its parts; see page_index.c for the design). */
#ifndef KVSTORE_NATIVE_PAGE_INDEX_PARTS_H
#define KVSTORE_NATIVE_PAGE_INDEX_PARTS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Shared between this module's files only: never bound to a like-named symbol of another library. */
#define PI_HIDDEN __attribute__((visibility("hidden")))

#define NONE UINT32_MAX
#define UNTOUCHED (UINT64_C(1) << 63)
#define NO_SLOT (-1)
#define INLINE_KEY 32
#define KEY_BYTES_MAX 255   /* page_t.key_len is one byte */

enum {
    F_ALIVE = 1, F_NVME = 2, F_BUSY = 4, F_QUEUED = 8, F_ANCHORED = 16, F_HEX = 32, F_LONG = 64,
    F_REFUSED = 128, F_PROXY = 256, F_USED = 512,
};

typedef struct {
    uint8_t key[INLINE_KEY];   /* the key, its 32 bytes when F_HEX, or a pointer to it when F_LONG */
    int64_t offset;
    uint64_t checksum;
    uint64_t tick;
    uint32_t ns, parent, child, next, prev;   /* next: the free list's link in a free slot */
    uint32_t slot_bytes, pins, hits;
    uint16_t tenant, flags;
    uint8_t key_len;
    uint8_t shard;             /* the NVMe shard its copy is on, while F_NVME */
} page_t;

typedef struct __attribute__((packed)) {
    uint64_t tick;   /* the page's tick as offered (internal form) */
    uint64_t seq;
    uint32_t page;
} entry_t;

/* One LRU order (page_heaps.c): the entries offered in order, oldest first, as a queue, and a binary
 * heap of the entries offered out of order. */
typedef struct {
    entry_t *items;                 /* the binary heap */
    size_t count, capacity;
    entry_t *run;                   /* the queue: run[run_head .. run_end) */
    size_t run_head, run_end, run_capacity;
    uint32_t slot_bytes;            /* a DRAM order's slot size; an NVMe order's shard */
    uint16_t tenant;
    uint8_t nvme, clean;
} heap_t;

typedef struct {
    PyObject *id;      /* the namespace id as the caller gave it */
    uint64_t pages;
    uint32_t roots;    /* first root, NONE when it has none */
} ns_t;

typedef struct {
    int64_t dram_pages, nvme_pages, nvme_bytes;
} usage_t;

typedef struct {
    uint32_t page;
    PyObject *proxy;
} proxy_slot_t;

typedef struct {
    PyObject_HEAD
    page_t *pages;
    uint32_t *live_ns;          /* each slot's namespace while its page is indexed, else NONE: a scan reads
                                 * 4 bytes a slot, not its page_t (scan: ListKeys of a small namespace) */
    uint32_t used, capacity, free_head;
    Py_ssize_t alive;
    uint32_t *table;            /* page slot numbers by key hash, open addressing */
    uint8_t *tags;              /* one byte of each position's hash; 0: the position is empty */
    uint8_t *distances;         /* how far past its home position each page sits (FAR: its hash says) */
    size_t table_mask, table_count;
    proxy_slot_t *proxies;
    size_t proxy_mask, proxy_count;
    heap_t *heaps;
    size_t heap_count;
    uint64_t clock, seq, births, seed;
    ns_t *ns;
    uint32_t ns_count, ns_capacity;
    PyObject *ns_slot;          /* namespace id -> ns slot */
    usage_t *usage;
    PyObject *tenant_names;     /* list: tenant slot -> name */
    PyObject *tenant_slot;      /* name -> tenant slot */
    PyObject *on_removed, *on_dram_dropped, *tenant_of;
    PyObject *anchor_of;        /* page slot -> anchor key */
    PyObject *anchored;         /* (namespace id, absent parent key) -> set of records */
    PyObject *refused;          /* page slot -> nvme_refused_bytes */
    int64_t dram_pages, nvme_pages;
    int busy;                   /* a method is running: a callback it makes may not call the index again */
} index_t;

typedef struct {
    PyObject_HEAD
    index_t *index;
    uint32_t page;
} record_t;


typedef struct {
    uint8_t bytes[64];
    const uint8_t *data;   /* bytes, or the caller's buffer for a long key */
    size_t len;
    int hex;
} pkey_t;

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= UINT64_C(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x *= UINT64_C(0xc4ceb9fe1a85ec53);
    x ^= x >> 33;
    return x;
}

static inline const uint8_t *page_key(const page_t *p) {
    if (p->flags & F_LONG) {
        const uint8_t *ptr;
        memcpy(&ptr, p->key, sizeof ptr);
        return ptr;
    }
    return p->key;
}

static inline int in_dram(const page_t *p) {
    return p->offset != NO_SLOT;
}

static inline uint64_t order_tick(uint64_t tick) {
    return (tick & UNTOUCHED) ? 0 : tick;
}

/* The key of a slot in the index's Python side tables (anchors, NVMe refusals). */
static inline PyObject *page_slot_key(uint32_t page) {
    return PyLong_FromUnsignedLong(page);
}

extern PI_HIDDEN PyTypeObject RecordType;

/* page_table.c: keys, the key table, the slot -> live record table */
PI_HIDDEN void hex_value_fill(void);
PI_HIDDEN void key_encode(pkey_t *k, const uint8_t *data, size_t len);
PI_HIDDEN uint64_t key_hash(const index_t *self, uint32_t ns, const uint8_t *data, size_t len, int hex);
/* key_hash in two steps: the part of a namespace and kind of key (key_seed), taken once for many keys
 * (a long lookup's probes: it was a third of each key's hash, on the critical path), then the key's own. */
PI_HIDDEN uint64_t key_seed(const index_t *self, uint32_t ns, int hex);
PI_HIDDEN uint64_t key_hash_seeded(uint64_t seed, const uint8_t *data, size_t len);
PI_HIDDEN uint64_t page_hash(const index_t *self, const page_t *p);
PI_HIDDEN int page_matches(const page_t *p, uint32_t ns, const pkey_t *k);
PI_HIDDEN PyObject *page_key_object(const page_t *p);
PI_HIDDEN uint32_t table_find(const index_t *self, uint32_t ns, const pkey_t *k, size_t *position);
PI_HIDDEN uint32_t table_find_hashed(const index_t *self, uint32_t ns, const pkey_t *k, uint64_t h, size_t *position);
PI_HIDDEN void table_put(index_t *self, size_t position, uint32_t page, uint64_t h);
PI_HIDDEN int table_reserve(index_t *self, size_t count);
PI_HIDDEN int table_distance_agrees(const index_t *self, size_t position);
PI_HIDDEN void table_delete(index_t *self, size_t i);
PI_HIDDEN PyObject *proxy_find(const index_t *self, uint32_t page);
PI_HIDDEN int proxy_put(index_t *self, uint32_t page, PyObject *proxy);
PI_HIDDEN void proxy_drop(index_t *self, uint32_t page);

/* index_record.c: records */
PI_HIDDEN PyObject *record_of(index_t *self, uint32_t page);
PI_HIDDEN int64_t page_of(index_t *self, PyObject *obj);
PI_HIDDEN void page_free(index_t *self, uint32_t page);
PI_HIDDEN PyObject *page_id_of(index_t *self, uint32_t page);

/* page_heaps.c: the LRU heaps */
PI_HIDDEN int entry_less(const entry_t *a, const entry_t *b);
PI_HIDDEN int heap_push(heap_t *h, entry_t item);
PI_HIDDEN entry_t heap_pop(heap_t *h);
PI_HIDDEN size_t heap_size(const heap_t *h);
PI_HIDDEN const entry_t *heap_top(const heap_t *h);
PI_HIDDEN void heap_free(heap_t *h);
PI_HIDDEN int dram_evictable(const index_t *self, const entry_t *e, int clean);
PI_HIDDEN int nvme_evictable(const index_t *self, const entry_t *e);
PI_HIDDEN int entry_evictable(const index_t *self, const heap_t *h, const entry_t *e);
PI_HIDDEN heap_t *heap_for(index_t *self, int nvme, uint16_t tenant, uint32_t slot_bytes, int clean);
PI_HIDDEN int heap_offer(index_t *self, heap_t *h, entry_t entry);
PI_HIDDEN int offer(index_t *self, uint32_t page);
PI_HIDDEN heap_t *oldest_heap(index_t *self, heap_t **selected, size_t count);
#endif
