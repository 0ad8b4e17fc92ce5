/* The page index of kvstore/control/index.py in C: the same prefix-closed tree, the same leaf-first
 * LRU heaps with the same staleness rules, in about 100 bytes per page instead of about 600.
 *
 * Layout (why each piece is as it is, in native/README.md):
 * - one growable array of fixed `page_t` slots, reused through a free list; the tree is kept as
 *   parent / first-child / next- and previous-sibling slot numbers (a namespace's roots are the
 *   sibling list of its `ns_t`), so no per-page Python object exists at all;
 * - a key of up to 32 bytes lives in the slot; a 64-character lowercase hex key (SGLang's) is kept
 *   as its 32 bytes and written back as hex; any other longer key gets a malloc'd copy;
 * - an open-addressing table of slot numbers keyed by (namespace, key), linear probing;
 * - lazy-deletion binary heaps of (tick, seq, slot) per (tenant, slot size, clean) for DRAM and
 *   per tenant for NVMe, popped under the rules of PageIndex._dram_evictable/_nvme_evictable.
 *
 * Records are proxies (`IndexRecord`) made on demand: a side table maps a slot to its live proxy,
 * so the same page gives the same object while anyone holds it. A removed page keeps its slot
 * (fields readable) while a proxy or a pin refers to it; the slot is freed when the last proxy
 * goes and no pin is left. Every removal path hands the caller the removed page's proxy, so a
 * slot is freed only in the proxy's dealloc.
 *
 * A page's tick reads 0 until it is first touched, as in Python; inside it is 1 << 63 | its birth
 * number, so a stale heap entry of a slot's earlier page never matches the slot's new page.
 * Anchored roots are rare: they are kept in Python dicts held here.
 *
 * Not thread-safe: the page store's lock guards every call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "page_index.h"

#define NONE UINT32_MAX
#define UNTOUCHED (UINT64_C(1) << 63)
#define NO_SLOT (-1)
#define INLINE_KEY 32

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
} page_t;

typedef struct __attribute__((packed)) {
    uint64_t tick;   /* the page's tick as offered (internal form) */
    uint64_t seq;
    uint32_t page;
} entry_t;

typedef struct {
    entry_t *items;
    size_t count, capacity;
    uint32_t slot_bytes;
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
    uint32_t used, capacity, free_head;
    Py_ssize_t alive;
    uint32_t *table;
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
} index_t;

typedef struct {
    PyObject_HEAD
    index_t *index;
    uint32_t page;
} record_t;

static PyTypeObject IndexType;
static PyTypeObject RecordType;

/* ---------------------------------------------------------------- keys and hashing */

typedef struct {
    uint8_t bytes[64];
    const uint8_t *data;   /* bytes, or the caller's buffer for a long key */
    size_t len;
    int hex;
} pkey_t;

/* Each byte's value as a lowercase hex digit, -1 for any other byte; filled at import
 * (page_index_register). A table, not a comparison per digit: on random keys those branches
 * mispredict about once a digit, which made decoding most of a long lookup's time. */
static int8_t hex_value[256];

static void hex_value_fill(void) {
    for (int c = 0; c < 256; c++)
        hex_value[c] = (int8_t)(c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1);
}

/* The stored form of a key: a 64-character lowercase hex key as its 32 bytes. */
static void key_encode(pkey_t *k, const uint8_t *data, size_t len) {
    k->hex = 0;
    if (len == 64) {
        int bad = 0;   /* any digit's -1 makes it negative */
        for (size_t i = 0; i < 32; i++) {
            int hi = hex_value[data[2 * i]], lo = hex_value[data[2 * i + 1]];
            bad |= hi | lo;
            k->bytes[i] = (uint8_t)((unsigned)hi << 4 | (unsigned)lo);   /* unused unless every digit is one */
        }
        if (bad >= 0) {
            k->hex = 1;
            k->data = k->bytes;
            k->len = 32;
            return;
        }
    }
    k->data = data;
    k->len = len;
}

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= UINT64_C(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x *= UINT64_C(0xc4ceb9fe1a85ec53);
    x ^= x >> 33;
    return x;
}

static uint64_t key_hash(const index_t *self, uint32_t ns, const uint8_t *data, size_t len, int hex) {
    uint64_t h = self->seed ^ mix64((uint64_t)ns << 1 | (uint64_t)hex) ^ len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, data + i, 8);
        h = mix64(h ^ w) + i;
    }
    if (i < len) {
        uint64_t w = 0;
        memcpy(&w, data + i, len - i);
        h = mix64(h ^ w ^ UINT64_C(0x9e3779b97f4a7c15));
    }
    return mix64(h);
}

static inline const uint8_t *page_key(const page_t *p) {
    if (p->flags & F_LONG) {
        const uint8_t *ptr;
        memcpy(&ptr, p->key, sizeof ptr);
        return ptr;
    }
    return p->key;
}

static inline uint64_t page_hash(const index_t *self, const page_t *p) {
    return key_hash(self, p->ns, page_key(p), p->key_len, (p->flags & F_HEX) != 0);
}

static inline int page_matches(const page_t *p, uint32_t ns, const pkey_t *k) {
    return p->ns == ns && p->key_len == k->len && ((p->flags & F_HEX) != 0) == k->hex
           && memcmp(page_key(p), k->data, k->len) == 0;
}

static PyObject *page_key_object(const page_t *p) {
    const uint8_t *data = page_key(p);
    if (!(p->flags & F_HEX))
        return PyBytes_FromStringAndSize((const char *)data, p->key_len);
    static const char digits[] = "0123456789abcdef";
    PyObject *out = PyBytes_FromStringAndSize(NULL, 64);
    if (!out)
        return NULL;
    char *s = PyBytes_AS_STRING(out);
    for (int i = 0; i < 32; i++) {
        s[2 * i] = digits[data[i] >> 4];
        s[2 * i + 1] = digits[data[i] & 15];
    }
    return out;
}

/* ---------------------------------------------------------------- the key table */

static uint32_t table_find(const index_t *self, uint32_t ns, const pkey_t *k, size_t *position) {
    if (!self->table)
        return NONE;
    size_t i = key_hash(self, ns, k->data, k->len, k->hex) & self->table_mask;
    for (;; i = (i + 1) & self->table_mask) {
        uint32_t at = self->table[i];
        if (at == NONE)
            return NONE;
        if (page_matches(&self->pages[at], ns, k)) {
            if (position)
                *position = i;
            return at;
        }
    }
}

static void table_place(index_t *self, uint32_t page) {
    size_t i = page_hash(self, &self->pages[page]) & self->table_mask;
    while (self->table[i] != NONE)
        i = (i + 1) & self->table_mask;
    self->table[i] = page;
}

static int table_reserve(index_t *self, size_t count) {
    size_t capacity = self->table ? self->table_mask + 1 : 0;
    if (count * 10 <= capacity * 7)
        return 0;
    size_t grown = capacity ? capacity * 2 : 1024;
    while (count * 10 > grown * 7)
        grown *= 2;
    uint32_t *old = self->table;
    self->table = malloc(grown * sizeof *self->table);
    if (!self->table) {
        self->table = old;
        PyErr_NoMemory();
        return -1;
    }
    memset(self->table, 0xff, grown * sizeof *self->table);
    self->table_mask = grown - 1;
    if (old) {
        for (size_t i = 0; i < capacity; i++)
            if (old[i] != NONE)
                table_place(self, old[i]);
        free(old);
    }
    return 0;
}

/* Backward-shift deletion: no tombstones, probe runs stay as short as at insert. */
static void table_delete(index_t *self, size_t i) {
    size_t mask = self->table_mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t at = self->table[j];
        if (at == NONE)
            break;
        size_t home = page_hash(self, &self->pages[at]) & mask;
        /* move `at` back to i unless its home lies cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            self->table[i] = at;
            i = j;
        }
    }
    self->table[i] = NONE;
    self->table_count--;
}

/* ---------------------------------------------------------------- proxies */

static inline size_t proxy_home(const index_t *self, uint32_t page) {
    return (size_t)(mix64(page) & self->proxy_mask);
}

static PyObject *proxy_find(const index_t *self, uint32_t page) {
    if (!self->proxies)
        return NULL;
    for (size_t i = proxy_home(self, page);; i = (i + 1) & self->proxy_mask) {
        if (self->proxies[i].proxy == NULL)
            return NULL;
        if (self->proxies[i].page == page)
            return self->proxies[i].proxy;
    }
}

static int proxy_put(index_t *self, uint32_t page, PyObject *proxy) {
    size_t capacity = self->proxies ? self->proxy_mask + 1 : 0;
    if ((self->proxy_count + 1) * 2 > capacity) {
        size_t grown = capacity ? capacity * 2 : 256;
        proxy_slot_t *old = self->proxies;
        self->proxies = calloc(grown, sizeof *self->proxies);
        if (!self->proxies) {
            self->proxies = old;
            PyErr_NoMemory();
            return -1;
        }
        self->proxy_mask = grown - 1;
        for (size_t i = 0; i < capacity; i++)
            if (old[i].proxy) {
                size_t j = proxy_home(self, old[i].page);
                while (self->proxies[j].proxy)
                    j = (j + 1) & self->proxy_mask;
                self->proxies[j] = old[i];
            }
        free(old);
    }
    size_t i = proxy_home(self, page);
    while (self->proxies[i].proxy)
        i = (i + 1) & self->proxy_mask;
    self->proxies[i].page = page;
    self->proxies[i].proxy = proxy;
    self->proxy_count++;
    return 0;
}

static void proxy_drop(index_t *self, uint32_t page) {
    size_t mask = self->proxy_mask, i = proxy_home(self, page);
    while (self->proxies[i].page != page || !self->proxies[i].proxy)
        i = (i + 1) & mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!self->proxies[j].proxy)
            break;
        size_t home = proxy_home(self, self->proxies[j].page);
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            self->proxies[i] = self->proxies[j];
            i = j;
        }
    }
    self->proxies[i].proxy = NULL;
    self->proxy_count--;
}

/* A new reference to the page's record: its live proxy, or a new one. */
static PyObject *record_of(index_t *self, uint32_t page) {
    page_t *p = &self->pages[page];
    if (p->flags & F_PROXY) {
        PyObject *proxy = proxy_find(self, page);
        Py_INCREF(proxy);
        return proxy;
    }
    record_t *r = PyObject_New(record_t, &RecordType);
    if (!r)
        return NULL;
    Py_INCREF(self);
    r->index = self;
    r->page = page;
    if (proxy_put(self, page, (PyObject *)r) < 0) {
        r->page = NONE;
        Py_DECREF(r);
        return NULL;
    }
    p->flags |= F_PROXY;
    return (PyObject *)r;
}

/* The page a record argument names; -1 with an error set when it is not one of this index's. */
static int64_t page_of(index_t *self, PyObject *obj) {
    if (Py_TYPE(obj) != &RecordType || ((record_t *)obj)->index != self) {
        PyErr_Format(PyExc_TypeError, "expected a record of this index, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    return ((record_t *)obj)->page;
}

static void page_free(index_t *self, uint32_t page) {
    page_t *p = &self->pages[page];
    if (p->flags & F_LONG) {
        void *ptr;
        memcpy(&ptr, p->key, sizeof ptr);
        free(ptr);
    }
    if (p->flags & F_REFUSED) {
        PyObject *key = PyLong_FromUnsignedLong(page);
        if (key) {
            if (PyDict_DelItem(self->refused, key) < 0)
                PyErr_Clear();
            Py_DECREF(key);
        } else {
            PyErr_Clear();
        }
    }
    p->flags = 0;
    p->next = self->free_head;
    self->free_head = page;
}

/* ---------------------------------------------------------------- heaps */

static inline uint64_t order_tick(uint64_t tick) {
    return (tick & UNTOUCHED) ? 0 : tick;
}

static inline int entry_less(const entry_t *a, const entry_t *b) {
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

static int heap_push(heap_t *h, entry_t item) {
    if (h->count == h->capacity) {
        size_t grown = h->capacity ? h->capacity * 2 : 16;
        entry_t *items = realloc(h->items, grown * sizeof *items);
        if (!items) {
            PyErr_NoMemory();
            return -1;
        }
        h->items = items;
        h->capacity = grown;
    }
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

static entry_t heap_pop(heap_t *h) {
    entry_t top = h->items[0];
    h->items[0] = h->items[--h->count];
    if (h->count)
        heap_sift_down(h, 0);
    return top;
}

static void heap_heapify(heap_t *h) {
    for (size_t i = h->count / 2; i-- > 0;)
        heap_sift_down(h, i);
}

static inline int in_dram(const page_t *p) {
    return p->offset != NO_SLOT;
}

static int dram_evictable(const index_t *self, const entry_t *e, int clean) {
    const page_t *p = &self->pages[e->page];
    return (p->flags & F_ALIVE) && p->tick == e->tick && in_dram(p) && p->pins == 0 && !(p->flags & F_BUSY)
           && ((p->flags & F_NVME) != 0) == clean && (clean || p->child == NONE);
}

static int nvme_evictable(const index_t *self, const entry_t *e) {
    const page_t *p = &self->pages[e->page];
    if (!((p->flags & F_ALIVE) && p->tick == e->tick && (p->flags & F_NVME) && p->pins == 0
          && !(p->flags & F_BUSY) && (in_dram(p) || p->child == NONE)))
        return 0;
    for (uint32_t c = p->child; c != NONE; c = self->pages[c].next)
        if (self->pages[c].flags & F_NVME)
            return 0;
    return 1;
}

static int entry_evictable(const index_t *self, const heap_t *h, const entry_t *e) {
    return h->nvme ? nvme_evictable(self, e) : dram_evictable(self, e, h->clean);
}

/* The heap of this key, made when first asked for; NULL with an error set if out of memory. */
static heap_t *heap_for(index_t *self, int nvme, uint16_t tenant, uint32_t slot_bytes, int clean) {
    for (size_t i = 0; i < self->heap_count; i++) {
        heap_t *h = &self->heaps[i];
        if (h->nvme == nvme && h->tenant == tenant && (nvme || (h->slot_bytes == slot_bytes && h->clean == clean)))
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
    h->slot_bytes = nvme ? 0 : slot_bytes;
    h->clean = (uint8_t)(nvme ? 0 : clean);
    return h;
}

static int heap_offer(index_t *self, heap_t *h, entry_t entry) {
    if (heap_push(h, entry) < 0)
        return -1;
    if (h->count > 64 && h->count > 4 * (size_t)self->alive) {
        size_t kept = 0;
        for (size_t i = 0; i < h->count; i++)
            if (entry_evictable(self, h, &h->items[i]))
                h->items[kept++] = h->items[i];
        h->count = kept;
        heap_heapify(h);
    }
    return 0;
}

/* PageIndex._offer: put the page's current state up for eviction. */
static int offer(index_t *self, uint32_t page) {
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
        heap_t *h = heap_for(self, 1, p->tenant, 0, 0);
        if (!h || heap_offer(self, h, entry) < 0)
            return -1;
    }
    return 0;
}

/* The heap among `selected` whose top is the least recently used evictable entry, stale tops dropped. */
static heap_t *oldest_heap(index_t *self, heap_t **selected, size_t count) {
    heap_t *best = NULL;
    for (size_t i = 0; i < count; i++) {
        heap_t *h = selected[i];
        while (h->count && !entry_evictable(self, h, &h->items[0]))
            heap_pop(h);
        if (h->count && (!best || entry_less(&h->items[0], &best->items[0])))
            best = h;
    }
    return best;
}

/* ---------------------------------------------------------------- namespaces and tenants */

/* The slot of a namespace id; -1 when absent (no error) or, with create, on error. */
static int64_t ns_lookup(index_t *self, PyObject *ns_id, int create) {
    PyObject *found = PyDict_GetItemWithError(self->ns_slot, ns_id);
    if (found)
        return PyLong_AsLong(found);
    if (PyErr_Occurred() || !create)
        return -1;
    if (self->ns_count == self->ns_capacity) {
        uint32_t grown = self->ns_capacity ? self->ns_capacity * 2 : 16;
        ns_t *ns = realloc(self->ns, grown * sizeof *ns);
        if (!ns) {
            PyErr_NoMemory();
            return -1;
        }
        self->ns = ns;
        self->ns_capacity = grown;
    }
    PyObject *slot = PyLong_FromUnsignedLong(self->ns_count);
    if (!slot || PyDict_SetItem(self->ns_slot, ns_id, slot) < 0) {
        Py_XDECREF(slot);
        return -1;
    }
    Py_DECREF(slot);
    Py_INCREF(ns_id);
    self->ns[self->ns_count] = (ns_t){ns_id, 0, NONE};
    return self->ns_count++;
}

static int64_t tenant_lookup(index_t *self, PyObject *name, int create) {
    PyObject *found = PyDict_GetItemWithError(self->tenant_slot, name);
    if (found)
        return PyLong_AsLong(found);
    if (PyErr_Occurred() || !create)
        return -1;
    Py_ssize_t slot = PyList_GET_SIZE(self->tenant_names);
    if (slot >= UINT16_MAX) {
        PyErr_SetString(PyExc_OverflowError, "the page index holds at most 65535 tenants");
        return -1;
    }
    usage_t *usage = realloc(self->usage, (slot + 1) * sizeof *usage);
    if (!usage) {
        PyErr_NoMemory();
        return -1;
    }
    self->usage = usage;
    memset(&usage[slot], 0, sizeof *usage);
    PyObject *value = PyLong_FromSsize_t(slot);
    if (!value || PyDict_SetItem(self->tenant_slot, name, value) < 0 || PyList_Append(self->tenant_names, name) < 0) {
        Py_XDECREF(value);
        return -1;
    }
    Py_DECREF(value);
    return slot;
}

/* Link `page` at the head of a sibling list whose head is *head. */
static void siblings_push(index_t *self, uint32_t *head, uint32_t page) {
    page_t *p = &self->pages[page];
    p->prev = NONE;
    p->next = *head;
    if (*head != NONE)
        self->pages[*head].prev = page;
    *head = page;
}

static void siblings_unlink(index_t *self, uint32_t *head, uint32_t page) {
    page_t *p = &self->pages[page];
    if (p->prev != NONE)
        self->pages[p->prev].next = p->next;
    else
        *head = p->next;
    if (p->next != NONE)
        self->pages[p->next].prev = p->prev;
    p->prev = p->next = NONE;
}

/* ---------------------------------------------------------------- callbacks and anchors */

static int call_with_record(index_t *self, PyObject *callback, uint32_t page) {
    PyObject *record = record_of(self, page);
    if (!record)
        return -1;
    PyObject *result = PyObject_CallOneArg(callback, record);
    Py_DECREF(record);
    if (!result)
        return -1;
    Py_DECREF(result);
    return 0;
}

static PyObject *page_slot_key(uint32_t page) {
    return PyLong_FromUnsignedLong(page);
}

/* The anchored page leaves its anchor's waiting set (and its anchor). */
static int unanchor(index_t *self, uint32_t page, int from_waiting) {
    page_t *p = &self->pages[page];
    PyObject *slot = page_slot_key(page);
    if (!slot)
        return -1;
    PyObject *anchor = PyDict_GetItemWithError(self->anchor_of, slot);
    int rc = -1;
    if (!anchor) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AssertionError, "an anchored page has an anchor");
        goto done;
    }
    Py_INCREF(anchor);
    if (from_waiting) {
        PyObject *anchor_id = Py_BuildValue("(OO)", self->ns[p->ns].id, anchor);
        PyObject *waiting = anchor_id ? PyDict_GetItemWithError(self->anchored, anchor_id) : NULL;
        PyObject *record = waiting ? record_of(self, page) : NULL;
        int ok = record && PySet_Discard(waiting, record) >= 0
                 && (PySet_GET_SIZE(waiting) || PyDict_DelItem(self->anchored, anchor_id) >= 0);
        Py_XDECREF(record);
        Py_XDECREF(anchor_id);
        if (!ok) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_AssertionError, "an anchored page waits in its anchor's set");
            Py_DECREF(anchor);
            goto done;
        }
    }
    Py_DECREF(anchor);
    if (PyDict_DelItem(self->anchor_of, slot) < 0)
        goto done;
    p->flags &= ~F_ANCHORED;
    rc = 0;
done:
    Py_DECREF(slot);
    return rc;
}

/* ---------------------------------------------------------------- removal */

static void usage_count(index_t *self, const page_t *p, int step) {
    int dram = in_dram(p), nvme = (p->flags & F_NVME) != 0;
    usage_t *u = &self->usage[p->tenant];
    self->dram_pages += step * dram;
    self->nvme_pages += step * nvme;
    u->dram_pages += step * dram;
    u->nvme_pages += step * nvme;
    u->nvme_bytes += step * nvme * (int64_t)p->slot_bytes;
}

/* PageIndex._remove. */
static int remove_page(index_t *self, uint32_t page) {
    page_t *p = &self->pages[page];
    if (p->child != NONE) {
        PyErr_SetString(PyExc_AssertionError, "only leaves leave the index");
        return -1;
    }
    pkey_t k = {.data = page_key(p), .len = p->key_len, .hex = (p->flags & F_HEX) != 0};
    size_t position;
    if (table_find(self, p->ns, &k, &position) != page) {
        PyErr_SetString(PyExc_AssertionError, "a page in the index is found by its key");
        return -1;
    }
    if ((p->flags & F_ANCHORED) && unanchor(self, page, 1) < 0)
        return -1;
    table_delete(self, position);
    self->alive--;
    ns_t *ns = &self->ns[p->ns];
    ns->pages--;
    uint32_t parent = p->parent;
    if (parent == NONE)
        siblings_unlink(self, &ns->roots, page);
    else
        siblings_unlink(self, &self->pages[parent].child, page);
    usage_count(self, p, -1);
    p->flags &= ~F_ALIVE;
    p->parent = NONE;   /* the parent's slot may be reused once it is gone too */
    if (parent != NONE && self->pages[parent].child == NONE && offer(self, parent) < 0)
        return -1;
    if (p->pins == 0)
        return call_with_record(self, self->on_removed, page);
    return 0;
}

static int drop_dram(index_t *self, uint32_t page) {
    page_t *p = &self->pages[page];
    self->dram_pages--;
    self->usage[p->tenant].dram_pages--;
    if (call_with_record(self, self->on_dram_dropped, page) < 0)
        return -1;
    self->pages[page].offset = NO_SLOT;
    return 0;
}

static int set_on_nvme(index_t *self, uint32_t page, int on) {
    page_t *p = &self->pages[page];
    if (((p->flags & F_NVME) != 0) == on)
        return 0;
    usage_count(self, p, -1);
    p->flags = on ? (p->flags | F_NVME) : (p->flags & ~F_NVME);
    usage_count(self, p, 1);
    if (offer(self, page) < 0)
        return -1;
    p = &self->pages[page];
    if (!on && p->parent != NONE && (self->pages[p->parent].flags & F_ALIVE))
        return offer(self, p->parent);
    return 0;
}

/* ---------------------------------------------------------------- the index type */

static int index_init(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"on_removed", "on_dram_dropped", "tenant_of", NULL};
    PyObject *on_removed, *on_dram_dropped, *tenant_of = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O", names, &on_removed, &on_dram_dropped, &tenant_of))
        return -1;
    if (self->ns_slot) {
        PyErr_SetString(PyExc_RuntimeError, "the page index is initialised once");
        return -1;
    }
    Py_INCREF(on_removed);
    Py_INCREF(on_dram_dropped);
    Py_INCREF(tenant_of);
    self->on_removed = on_removed;
    self->on_dram_dropped = on_dram_dropped;
    self->tenant_of = tenant_of;
    self->ns_slot = PyDict_New();
    self->tenant_names = PyList_New(0);
    self->tenant_slot = PyDict_New();
    self->anchor_of = PyDict_New();
    self->anchored = PyDict_New();
    self->refused = PyDict_New();
    if (!self->ns_slot || !self->tenant_names || !self->tenant_slot || !self->anchor_of || !self->anchored
        || !self->refused)
        return -1;
    self->free_head = NONE;
    self->clock = 1;
    uint64_t seed = (uint64_t)(uintptr_t)self ^ (uint64_t)(uintptr_t)&seed;
    self->seed = mix64(seed ^ UINT64_C(0x243f6a8885a308d3));
    return table_reserve(self, 1);
}

static int index_traverse(index_t *self, visitproc visit, void *arg) {
    Py_VISIT(self->on_removed);
    Py_VISIT(self->on_dram_dropped);
    Py_VISIT(self->tenant_of);
    Py_VISIT(self->anchored);
    return 0;
}

static int index_clear(index_t *self) {
    Py_CLEAR(self->on_removed);
    Py_CLEAR(self->on_dram_dropped);
    Py_CLEAR(self->tenant_of);
    Py_CLEAR(self->anchored);
    return 0;
}

static void index_dealloc(index_t *self) {
    PyObject_GC_UnTrack(self);
    index_clear(self);
    for (uint32_t i = 0; i < self->used; i++)
        if ((self->pages[i].flags & F_USED) && (self->pages[i].flags & F_LONG)) {
            void *ptr;
            memcpy(&ptr, self->pages[i].key, sizeof ptr);
            free(ptr);
        }
    for (uint32_t i = 0; i < self->ns_count; i++)
        Py_DECREF(self->ns[i].id);
    for (size_t i = 0; i < self->heap_count; i++)
        free(self->heaps[i].items);
    free(self->heaps);
    free(self->pages);
    free(self->table);
    free(self->proxies);
    free(self->ns);
    free(self->usage);
    Py_XDECREF(self->ns_slot);
    Py_XDECREF(self->tenant_names);
    Py_XDECREF(self->tenant_slot);
    Py_XDECREF(self->anchor_of);
    Py_XDECREF(self->refused);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t index_len(index_t *self) {
    return self->alive;
}

/* Parse a page id (namespace id, key bytes). */
static int parse_page_id(PyObject *page_id, PyObject **ns_id, const uint8_t **key, Py_ssize_t *len) {
    if (!PyTuple_Check(page_id) || PyTuple_GET_SIZE(page_id) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(page_id, 1))) {
        PyErr_SetString(PyExc_TypeError, "a page id is a tuple (namespace id, key bytes)");
        return -1;
    }
    *ns_id = PyTuple_GET_ITEM(page_id, 0);
    *key = (const uint8_t *)PyBytes_AS_STRING(PyTuple_GET_ITEM(page_id, 1));
    *len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(page_id, 1));
    return 0;
}

/* The page of a page id: NONE when absent; -1 on error. */
static int64_t find_page_id(index_t *self, PyObject *page_id) {
    PyObject *ns_id;
    const uint8_t *data;
    Py_ssize_t len;
    if (parse_page_id(page_id, &ns_id, &data, &len) < 0)
        return -1;
    int64_t ns = ns_lookup(self, ns_id, 0);
    if (ns < 0)
        return PyErr_Occurred() ? -1 : (int64_t)NONE;
    pkey_t k;
    key_encode(&k, data, (size_t)len);
    return table_find(self, (uint32_t)ns, &k, NULL);
}

static int index_contains(index_t *self, PyObject *page_id) {
    int64_t page = find_page_id(self, page_id);
    return page < 0 ? -1 : page != NONE;
}

static PyObject *index_get(index_t *self, PyObject *page_id) {
    int64_t page = find_page_id(self, page_id);
    if (page < 0)
        return NULL;
    if (page == NONE)
        Py_RETURN_NONE;
    return record_of(self, (uint32_t)page);
}

static int64_t page_alloc(index_t *self) {
    if (self->free_head != NONE) {
        uint32_t page = self->free_head;
        self->free_head = self->pages[page].next;
        return page;
    }
    if (self->used == self->capacity) {
        if (self->capacity >= NONE - 1) {
            PyErr_SetString(PyExc_OverflowError, "the page index is full");
            return -1;
        }
        uint64_t grown = self->capacity ? (uint64_t)self->capacity + self->capacity / 2 : 1024;
        if (grown >= NONE)
            grown = NONE - 1;
        page_t *pages = realloc(self->pages, grown * sizeof *pages);
        if (!pages) {
            PyErr_NoMemory();
            return -1;
        }
        self->pages = pages;
        self->capacity = (uint32_t)grown;
    }
    return self->used++;
}

static int is_ancestor(index_t *self, uint32_t page, uint32_t of) {
    for (uint32_t node = self->pages[of].parent; node != NONE; node = self->pages[node].parent)
        if (node == page)
            return 1;
    return 0;
}

/* PageIndex._adopt: the roots waiting for `page` become its children (not one of its ancestors). */
static int adopt(index_t *self, uint32_t page, PyObject *waiting) {
    PyObject *iterator = PyObject_GetIter(waiting), *item;
    if (!iterator)
        return -1;
    while ((item = PyIter_Next(iterator))) {
        int64_t child = page_of(self, item);
        Py_DECREF(item);
        if (child < 0 || unanchor(self, (uint32_t)child, 0) < 0) {
            Py_DECREF(iterator);
            return -1;
        }
        if (is_ancestor(self, (uint32_t)child, page))
            continue;
        page_t *c = &self->pages[child];
        siblings_unlink(self, &self->ns[c->ns].roots, (uint32_t)child);
        c->parent = page;
        siblings_push(self, &self->pages[page].child, (uint32_t)child);
    }
    Py_DECREF(iterator);
    return PyErr_Occurred() ? -1 : 0;
}

static int set_anchor(index_t *self, uint32_t page, PyObject *ns_id, PyObject *anchor) {
    PyObject *slot = page_slot_key(page);
    PyObject *anchor_id = Py_BuildValue("(OO)", ns_id, anchor);
    PyObject *record = record_of(self, page);
    int rc = -1;
    if (!slot || !anchor_id || !record || PyDict_SetItem(self->anchor_of, slot, anchor) < 0)
        goto done;
    PyObject *waiting = PyDict_GetItemWithError(self->anchored, anchor_id);
    if (!waiting) {
        if (PyErr_Occurred() || !(waiting = PySet_New(NULL)))
            goto done;
        int failed = PyDict_SetItem(self->anchored, anchor_id, waiting) < 0;
        Py_DECREF(waiting);
        if (failed)
            goto done;
    }
    if (PySet_Add(waiting, record) < 0)
        goto done;
    self->pages[page].flags |= F_ANCHORED;
    rc = 0;
done:
    Py_XDECREF(slot);
    Py_XDECREF(anchor_id);
    Py_XDECREF(record);
    return rc;
}

/* Insert one page; returns its slot, or -1 with an error set. `parent` is NONE for a root. */
static int64_t add_page(index_t *self, PyObject *ns_id, const uint8_t *data, size_t len, uint32_t parent,
                        int64_t offset, uint32_t slot_bytes, uint64_t checksum, int on_nvme, PyObject *anchor) {
    int64_t ns = ns_lookup(self, ns_id, 1);
    if (ns < 0)
        return -1;
    pkey_t k;
    key_encode(&k, data, len);
    if (table_find(self, (uint32_t)ns, &k, NULL) != NONE) {
        PyErr_SetString(PyExc_AssertionError, "a committed page is immutable");
        return -1;
    }
    if (parent != NONE && !(self->pages[parent].flags & F_ALIVE)) {
        PyErr_SetString(PyExc_AssertionError, "the index stays prefix-closed");
        return -1;
    }
    Py_ssize_t anchor_len = anchor ? PyBytes_GET_SIZE(anchor) : 0;
    if (parent != NONE && anchor_len) {
        PyErr_SetString(PyExc_AssertionError, "a page is anchored only when its parent is absent");
        return -1;
    }
    int64_t tenant;
    if (self->tenant_of == Py_None) {
        PyObject *empty = PyUnicode_FromStringAndSize("", 0);
        tenant = empty ? tenant_lookup(self, empty, 1) : -1;
        Py_XDECREF(empty);
    } else {
        PyObject *name = PyObject_CallOneArg(self->tenant_of, ns_id);
        tenant = name ? tenant_lookup(self, name, 1) : -1;
        Py_XDECREF(name);
    }
    if (tenant < 0 || table_reserve(self, self->table_count + 1) < 0)
        return -1;
    uint8_t *long_key = NULL;
    if (k.len > INLINE_KEY && !(long_key = malloc(k.len))) {
        PyErr_NoMemory();
        return -1;
    }
    int64_t slot = page_alloc(self);
    if (slot < 0) {
        free(long_key);
        return -1;
    }
    uint32_t page = (uint32_t)slot;
    page_t *p = &self->pages[page];
    memset(p, 0, sizeof *p);
    if (long_key) {
        memcpy(long_key, k.data, k.len);
        memcpy(p->key, &long_key, sizeof long_key);
    } else {
        memcpy(p->key, k.data, k.len);
    }
    p->key_len = (uint8_t)k.len;
    p->flags = F_USED | F_ALIVE | (k.hex ? F_HEX : 0) | (long_key ? F_LONG : 0) | (on_nvme ? F_NVME : 0);
    p->offset = offset;
    p->checksum = checksum;
    p->tick = UNTOUCHED | self->births++;
    p->ns = (uint32_t)ns;
    p->parent = parent;
    p->child = p->next = p->prev = NONE;
    p->slot_bytes = slot_bytes;
    p->tenant = (uint16_t)tenant;
    if (parent != NONE)
        siblings_push(self, &self->pages[parent].child, page);
    else
        siblings_push(self, &self->ns[ns].roots, page);
    table_place(self, page);
    self->table_count++;
    self->alive++;
    self->ns[ns].pages++;
    usage_count(self, p, 1);
    if (parent == NONE && anchor_len) {
        pkey_t a;
        key_encode(&a, (const uint8_t *)PyBytes_AS_STRING(anchor), (size_t)anchor_len);
        if (!(a.len == k.len && a.hex == k.hex && memcmp(a.data, k.data, k.len) == 0)
            && set_anchor(self, page, ns_id, anchor) < 0)
            return -1;
    }
    if (PyDict_GET_SIZE(self->anchored)) {
        PyObject *key = page_key_object(&self->pages[page]);
        PyObject *page_id = key ? Py_BuildValue("(ON)", ns_id, key) : NULL;
        if (!page_id)
            return -1;
        PyObject *waiting = PyDict_GetItemWithError(self->anchored, page_id);
        Py_XINCREF(waiting);
        int failed = waiting ? PyDict_DelItem(self->anchored, page_id) < 0 || adopt(self, page, waiting) < 0
                             : PyErr_Occurred() != NULL;
        Py_XDECREF(waiting);
        Py_DECREF(page_id);
        if (failed)
            return -1;
    }
    return page;
}

static int64_t parent_arg(index_t *self, PyObject *parent) {
    if (parent == Py_None)
        return NONE;
    return page_of(self, parent);
}

static PyObject *index_add(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"page_id", "parent", "offset", "slot_bytes", "checksum", "on_nvme", "anchor", NULL};
    PyObject *page_id, *parent, *anchor = NULL;
    long long offset;
    unsigned long slot_bytes;
    unsigned long long checksum;
    int on_nvme = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOLkK|pS", names, &page_id, &parent, &offset, &slot_bytes,
                                     &checksum, &on_nvme, &anchor))
        return NULL;
    PyObject *ns_id;
    const uint8_t *data;
    Py_ssize_t len;
    int64_t parent_page = parent_arg(self, parent);
    if (parent_page < 0 || parse_page_id(page_id, &ns_id, &data, &len) < 0)
        return NULL;
    int64_t page = add_page(self, ns_id, data, (size_t)len, (uint32_t)parent_page, offset, (uint32_t)slot_bytes,
                            checksum, on_nvme, anchor);
    return page < 0 ? NULL : record_of(self, (uint32_t)page);
}

/* add_chain(ns_id, keys, parent, offsets, slot_bytes, checksums) -> list[record]: a commit's pages, each
 * the parent of the next (the first's parent is `parent`, a record or None), one call. */
static PyObject *index_add_chain(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"namespace_id", "keys", "parent", "offsets", "slot_bytes", "checksums", NULL};
    PyObject *ns_id, *keys, *parent, *offsets, *checksums;
    unsigned long slot_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!kO!", names, &ns_id, &PyList_Type, &keys, &parent,
                                     &PyList_Type, &offsets, &slot_bytes, &PyList_Type, &checksums))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(offsets) != n || PyList_GET_SIZE(checksums) != n) {
        PyErr_SetString(PyExc_ValueError, "keys, offsets and checksums have one entry per page");
        return NULL;
    }
    int64_t previous = parent_arg(self, parent);
    if (previous < 0)
        return NULL;
    PyObject *records = PyList_New(n);
    if (!records)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "keys are bytes");
            goto fail;
        }
        long long offset = PyLong_AsLongLong(PyList_GET_ITEM(offsets, i));
        unsigned long long checksum = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(checksums, i));
        if (PyErr_Occurred())
            goto fail;
        int64_t page = add_page(self, ns_id, (const uint8_t *)PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key),
                                (uint32_t)previous, offset, (uint32_t)slot_bytes, checksum, 0, NULL);
        PyObject *record = page < 0 ? NULL : record_of(self, (uint32_t)page);
        if (!record)
            goto fail;
        PyList_SET_ITEM(records, i, record);
        previous = page;
    }
    return records;
fail:
    Py_DECREF(records);
    return NULL;
}

/* The keys argument of leading: a list of bytes, or one bytes-like of keys `key_bytes` long each. */
typedef struct {
    PyObject *list;
    Py_buffer packed;
    Py_ssize_t count, key_bytes;
} keys_arg_t;

static int keys_open(keys_arg_t *keys, PyObject *obj, Py_ssize_t key_bytes) {
    keys->list = NULL;
    keys->key_bytes = key_bytes;
    if (key_bytes <= 0) {
        if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
            PyErr_SetString(PyExc_TypeError, "keys is a list of bytes, or packed bytes with key_bytes given");
            return -1;
        }
        keys->list = obj;
        keys->count = PySequence_Fast_GET_SIZE(obj);
        return 0;
    }
    if (PyObject_GetBuffer(obj, &keys->packed, PyBUF_SIMPLE) < 0)
        return -1;
    if (keys->packed.len % key_bytes) {
        PyErr_Format(PyExc_ValueError, "packed keys are %zd bytes, not a multiple of key_bytes=%zd",
                     keys->packed.len, key_bytes);
        PyBuffer_Release(&keys->packed);
        return -1;
    }
    keys->count = keys->packed.len / key_bytes;
    return 0;
}

static int keys_get(keys_arg_t *keys, Py_ssize_t i, const uint8_t **data, size_t *len) {
    if (!keys->list) {
        *data = (const uint8_t *)keys->packed.buf + i * keys->key_bytes;
        *len = (size_t)keys->key_bytes;
        return 0;
    }
    PyObject *key = PySequence_Fast_GET_ITEM(keys->list, i);
    if (!PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "keys are bytes");
        return -1;
    }
    *data = (const uint8_t *)PyBytes_AS_STRING(key);
    *len = (size_t)PyBytes_GET_SIZE(key);
    return 0;
}

static void keys_close(keys_arg_t *keys) {
    if (!keys->list)
        PyBuffer_Release(&keys->packed);
}

/* How many leading keys are present; their pages into `found` (room for keys->count). */
static Py_ssize_t leading_pages(index_t *self, PyObject *ns_id, keys_arg_t *keys, uint32_t *found) {
    int64_t ns = ns_lookup(self, ns_id, 0);
    if (ns < 0)
        return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t n = 0;
    for (; n < keys->count; n++) {
        const uint8_t *data;
        size_t len;
        if (keys_get(keys, n, &data, &len) < 0)
            return -1;
        pkey_t k;
        key_encode(&k, data, len);
        uint32_t page = table_find(self, (uint32_t)ns, &k, NULL);
        if (page == NONE)
            break;
        found[n] = page;
    }
    return n;
}

/* leading(ns_id, keys, key_bytes=0) -> list[record]; offsets=True: their DRAM offsets instead. */
static PyObject *leading_common(index_t *self, PyObject *args, PyObject *kwargs, int offsets) {
    static char *names[] = {"namespace_id", "keys", "key_bytes", NULL};
    PyObject *ns_id, *obj;
    Py_ssize_t key_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|n", names, &ns_id, &obj, &key_bytes))
        return NULL;
    keys_arg_t keys;
    if (keys_open(&keys, obj, key_bytes) < 0)
        return NULL;
    PyObject *out = NULL;
    uint32_t *found = PyMem_Malloc((keys.count ? keys.count : 1) * sizeof *found);
    if (!found) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = leading_pages(self, ns_id, &keys, found);
    if (n < 0 || !(out = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = offsets ? PyLong_FromLongLong(self->pages[found[i]].offset) : record_of(self, found[i]);
        if (!item) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    PyMem_Free(found);
    keys_close(&keys);
    return out;
}

static PyObject *index_leading(index_t *self, PyObject *args, PyObject *kwargs) {
    return leading_common(self, args, kwargs, 0);
}

static PyObject *index_leading_offsets(index_t *self, PyObject *args, PyObject *kwargs) {
    return leading_common(self, args, kwargs, 1);
}

/* Apply fn to the page of every record in a sequence. */
#define FOR_RECORDS(seq_obj, page_var, ...)                                                        \
    do {                                                                                            \
        PyObject *fast_ = PySequence_Fast((seq_obj), "expected a sequence of records");            \
        if (!fast_)                                                                                 \
            return NULL;                                                                            \
        Py_ssize_t n_ = PySequence_Fast_GET_SIZE(fast_);                                            \
        for (Py_ssize_t i_ = 0; i_ < n_; i_++) {                                                    \
            int64_t page_var = page_of(self, PySequence_Fast_GET_ITEM(fast_, i_));                  \
            if (page_var < 0) {                                                                     \
                Py_DECREF(fast_);                                                                   \
                return NULL;                                                                        \
            }                                                                                       \
            __VA_ARGS__                                                                             \
        }                                                                                           \
        Py_DECREF(fast_);                                                                           \
    } while (0)

#define FAIL_IN_LOOP     \
    {                    \
        Py_DECREF(fast_); \
        return NULL;     \
    }

static PyObject *index_touch_all(index_t *self, PyObject *records) {
    uint64_t tick = self->clock++;
    FOR_RECORDS(records, page, {
        self->pages[page].tick = tick;
        if (offer(self, (uint32_t)page) < 0)
            FAIL_IN_LOOP
    });
    Py_RETURN_NONE;
}

static PyObject *index_pin(index_t *self, PyObject *record) {
    int64_t page = page_of(self, record);
    if (page < 0)
        return NULL;
    self->pages[page].pins++;
    Py_RETURN_NONE;
}

static PyObject *index_pin_all(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"records", "hit", NULL};
    PyObject *records;
    int hit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Op", names, &records, &hit))
        return NULL;
    uint64_t tick = self->clock++;
    FOR_RECORDS(records, page, {
        page_t *p = &self->pages[page];
        p->pins++;
        p->hits += (uint32_t)hit;
        p->tick = tick;
    });
    Py_RETURN_NONE;
}

static PyObject *index_unpin_all(index_t *self, PyObject *records) {
    FOR_RECORDS(records, page, {
        page_t *p = &self->pages[page];
        if (p->pins == 0) {
            PyErr_SetString(PyExc_AssertionError, "unpin of a page that is not pinned");
            FAIL_IN_LOOP
        }
        if (--p->pins == 0) {
            if (!(p->flags & F_ALIVE)) {
                if (call_with_record(self, self->on_removed, (uint32_t)page) < 0)
                    FAIL_IN_LOOP
            } else if (((p->flags & F_NVME) || p->child == NONE) && offer(self, (uint32_t)page) < 0) {
                FAIL_IN_LOOP
            }
        }
    });
    Py_RETURN_NONE;
}

static PyObject *index_set_dram(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"record", "offset", NULL};
    PyObject *record;
    long long offset;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OL", names, &record, &offset))
        return NULL;
    int64_t page = page_of(self, record);
    if (page < 0)
        return NULL;
    page_t *p = &self->pages[page];
    if (in_dram(p) || offset == NO_SLOT) {
        PyErr_SetString(PyExc_AssertionError, "set_dram of a page in DRAM, or to no slot");
        return NULL;
    }
    p->offset = offset;
    self->dram_pages++;
    self->usage[p->tenant].dram_pages++;
    if (offer(self, (uint32_t)page) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *index_set_on_nvme(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"record", "on_nvme", NULL};
    PyObject *record;
    int on;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Op", names, &record, &on))
        return NULL;
    int64_t page = page_of(self, record);
    if (page < 0 || set_on_nvme(self, (uint32_t)page, on) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *index_release_busy(index_t *self, PyObject *record) {
    int64_t page = page_of(self, record);
    if (page < 0)
        return NULL;
    self->pages[page].flags &= ~F_BUSY;
    if ((self->pages[page].flags & F_ALIVE) && offer(self, (uint32_t)page) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A tenant argument: -1 for None (any), -2 for a tenant the index has never seen (none of its pages). */
static int tenant_arg(index_t *self, PyObject *tenant, int64_t *slot) {
    if (tenant == Py_None) {
        *slot = -1;
        return 0;
    }
    *slot = tenant_lookup(self, tenant, 0);
    if (*slot < 0) {
        if (PyErr_Occurred())
            return -1;
        *slot = -2;
    }
    return 0;
}

/* PageIndex._oldest: the DRAM heap whose top is the oldest evictable entry of this size and tenant. */
static heap_t *oldest_dram(index_t *self, int64_t slot_bytes, int clean_only, int64_t tenant) {
    heap_t *best = NULL;
    for (size_t i = 0; i < self->heap_count; i++) {
        heap_t *h = &self->heaps[i];
        if (h->nvme || (clean_only && !h->clean) || (slot_bytes >= 0 && h->slot_bytes != slot_bytes)
            || (tenant != -1 && h->tenant != tenant))
            continue;
        heap_t *one = h;
        if (oldest_heap(self, &one, 1) && (!best || entry_less(&h->items[0], &best->items[0])))
            best = h;
    }
    return best;
}

static int slot_bytes_arg(PyObject *obj, int64_t *slot_bytes) {
    if (obj == Py_None) {
        *slot_bytes = -1;
        return 0;
    }
    *slot_bytes = PyLong_AsLongLong(obj);
    return *slot_bytes == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *index_evict_dram(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"slot_bytes", "clean_only", "tenant", NULL};
    PyObject *size_obj, *tenant_obj = Py_None;
    int clean_only;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Op|O", names, &size_obj, &clean_only, &tenant_obj))
        return NULL;
    int64_t slot_bytes, tenant;
    if (slot_bytes_arg(size_obj, &slot_bytes) < 0 || tenant_arg(self, tenant_obj, &tenant) < 0)
        return NULL;
    heap_t *best = oldest_dram(self, slot_bytes, clean_only, tenant);
    if (!best)
        Py_RETURN_NONE;
    uint32_t page = heap_pop(best).page;
    PyObject *record = record_of(self, page);
    if (!record)
        return NULL;
    int failed = (self->pages[page].flags & F_NVME) ? drop_dram(self, page) : remove_page(self, page);
    if (failed) {
        Py_DECREF(record);
        return NULL;
    }
    return record;
}

static PyObject *index_oldest_evictable_slot_bytes(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"clean_only", NULL};
    int clean_only;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "p", names, &clean_only))
        return NULL;
    heap_t *best = oldest_dram(self, -1, clean_only, -1);
    if (!best)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(self->pages[best->items[0].page].slot_bytes);
}

typedef struct {
    entry_t entry;
    heap_t *heap;
} held_t;

static int push_back(held_t *held, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (heap_push(held[i].heap, held[i].entry) < 0)
            return -1;
    return 0;
}

static PyObject *index_evict_nvme(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"shard_of", "shard", "count", "tenant", NULL};
    PyObject *shard_of, *shard_obj, *tenant_obj = Py_None;
    Py_ssize_t count;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn|O", names, &shard_of, &shard_obj, &count, &tenant_obj))
        return NULL;
    int64_t tenant;
    if (tenant_arg(self, tenant_obj, &tenant) < 0)
        return NULL;
    heap_t **selected = PyMem_Malloc((self->heap_count + 1) * sizeof *selected);
    size_t n_selected = 0, n_passed = 0, passed_capacity = 16;
    held_t *passed = PyMem_Malloc(passed_capacity * sizeof *passed);
    PyObject *taken = PyList_New(0);
    if (!selected || !passed || !taken) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    for (size_t i = 0; i < self->heap_count; i++)
        if (self->heaps[i].nvme && (tenant == -1 || self->heaps[i].tenant == tenant))
            selected[n_selected++] = &self->heaps[i];
    /* heaps may move (realloc) only when a new one is made: offer() below makes none for NVMe pages
     * already offered before, but a DRAM heap may be new; keep indices, not pointers */
    size_t *which = PyMem_Malloc((n_selected + 1) * sizeof *which);
    if (!which) {
        PyErr_NoMemory();
        goto fail;
    }
    for (size_t i = 0; i < n_selected; i++)
        which[i] = (size_t)(selected[i] - self->heaps);
    while (PyList_GET_SIZE(taken) < count) {
        for (size_t i = 0; i < n_selected; i++)
            selected[i] = &self->heaps[which[i]];
        heap_t *best = oldest_heap(self, selected, n_selected);
        if (!best)
            break;
        size_t best_index = (size_t)(best - self->heaps);
        entry_t entry = heap_pop(best);
        PyObject *record = record_of(self, entry.page);
        if (!record)
            goto fail_which;
        if (shard_obj != Py_None) {
            PyObject *shard = PyObject_CallOneArg(shard_of, record);
            int same = shard ? PyObject_RichCompareBool(shard, shard_obj, Py_EQ) : -1;
            Py_XDECREF(shard);
            if (same < 0) {
                Py_DECREF(record);
                goto fail_which;
            }
            if (!same) {
                Py_DECREF(record);
                if (n_passed == passed_capacity) {
                    passed_capacity *= 2;
                    held_t *grown = PyMem_Realloc(passed, passed_capacity * sizeof *passed);
                    if (!grown) {
                        PyErr_NoMemory();
                        goto fail_which;
                    }
                    passed = grown;
                }
                passed[n_passed].entry = entry;
                passed[n_passed].heap = (heap_t *)(uintptr_t)best_index;
                n_passed++;
                continue;
            }
        }
        int failed = set_on_nvme(self, entry.page, 0) < 0
                     || (!in_dram(&self->pages[entry.page]) && remove_page(self, entry.page) < 0)
                     || PyList_Append(taken, record) < 0;
        Py_DECREF(record);
        if (failed)
            goto fail_which;
    }
    for (size_t i = 0; i < n_passed; i++)
        passed[i].heap = &self->heaps[(size_t)(uintptr_t)passed[i].heap];
    if (push_back(passed, n_passed) < 0)
        goto fail_which;
    PyMem_Free(which);
    PyMem_Free(selected);
    PyMem_Free(passed);
    return taken;
fail_which:
    PyMem_Free(which);
fail:
    PyMem_Free(selected);
    PyMem_Free(passed);
    Py_XDECREF(taken);
    return NULL;
}

static int nvme_refused(index_t *self, uint32_t page) {
    page_t *p = &self->pages[page];
    if (!(p->flags & F_REFUSED))
        return 0;
    PyObject *slot = page_slot_key(page);
    PyObject *value = slot ? PyDict_GetItemWithError(self->refused, slot) : NULL;
    Py_XDECREF(slot);
    if (!value)
        return -1;
    long long refused_bytes = PyLong_AsLongLong(value);
    return refused_bytes >= 0 && self->usage[p->tenant].nvme_bytes >= refused_bytes;
}

static PyObject *index_dram_only_lru(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"count", "tenant", NULL};
    PyObject *tenant_obj = Py_None;
    Py_ssize_t count;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|O", names, &count, &tenant_obj))
        return NULL;
    int64_t tenant;
    if (tenant_arg(self, tenant_obj, &tenant) < 0)
        return NULL;
    heap_t **selected = PyMem_Malloc((self->heap_count + 1) * sizeof *selected);
    size_t n_selected = 0, n_held = 0, n_taken = 0, capacity = 16;
    held_t *held = PyMem_Malloc(capacity * sizeof *held);
    uint32_t *taken = PyMem_Malloc(capacity * sizeof *taken);
    PyObject *out = NULL;
    if (!selected || !held || !taken) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < self->heap_count; i++) {
        heap_t *h = &self->heaps[i];
        if (!h->nvme && !h->clean && (tenant == -1 || h->tenant == tenant))
            selected[n_selected++] = h;
    }
    while ((Py_ssize_t)n_taken < count) {
        heap_t *best = oldest_heap(self, selected, n_selected);
        if (!best)
            break;
        if (n_held == capacity) {
            capacity *= 2;
            held_t *grown = PyMem_Realloc(held, capacity * sizeof *held);
            if (grown)
                held = grown;
            uint32_t *grown_taken = PyMem_Realloc(taken, capacity * sizeof *taken);
            if (grown_taken)
                taken = grown_taken;
            if (!grown || !grown_taken) {
                PyErr_NoMemory();
                goto done;
            }
        }
        entry_t entry = heap_pop(best);
        held[n_held].entry = entry;
        held[n_held].heap = best;
        n_held++;
        int refused = nvme_refused(self, entry.page);
        if (refused < 0)
            goto done;
        if (!refused)
            taken[n_taken++] = entry.page;
    }
    if (!(out = PyList_New((Py_ssize_t)n_taken)))
        goto done;
    for (size_t i = 0; i < n_taken; i++) {
        PyObject *record = record_of(self, taken[i]);
        if (!record) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, record);
    }
done:
    if (held && push_back(held, n_held) < 0)
        Py_CLEAR(out);
    PyMem_Free(selected);
    PyMem_Free(held);
    PyMem_Free(taken);
    return out;
}

/* Descendants before ancestors, without recursion; the records, in that order. */
static PyObject *index_remove_subtree(index_t *self, PyObject *record) {
    int64_t top = page_of(self, record);
    if (top < 0)
        return NULL;
    PyObject *removed = PyList_New(0);
    if (!removed)
        return NULL;
    /* Walk down to a leaf, remove it, continue from its parent; stop after the top. */
    uint32_t node = (uint32_t)top;
    for (;;) {
        while (self->pages[node].child != NONE)
            node = self->pages[node].child;
        uint32_t parent = self->pages[node].parent;
        PyObject *item = record_of(self, node);
        if (!item || PyList_Append(removed, item) < 0 || remove_page(self, node) < 0) {
            Py_XDECREF(item);
            Py_DECREF(removed);
            return NULL;
        }
        Py_DECREF(item);
        if (node == (uint32_t)top)
            break;
        node = parent;
    }
    return removed;
}

static PyObject *list_subtrees(index_t *self, PyObject *ns_id, int keys) {
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    int64_t ns = ns_lookup(self, ns_id, 0);
    if (ns < 0)
        return PyErr_Occurred() ? (Py_DECREF(out), NULL) : out;
    for (uint32_t root = self->ns[ns].roots; root != NONE; root = self->pages[root].next) {
        if (!keys) {
            PyObject *record = record_of(self, root);
            if (!record || PyList_Append(out, record) < 0) {
                Py_XDECREF(record);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(record);
            continue;
        }
        /* pre-order over the subtree by links: down to the first child, else across, else up */
        uint32_t node = root;
        for (;;) {
            PyObject *key = page_key_object(&self->pages[node]);
            if (!key || PyList_Append(out, key) < 0) {
                Py_XDECREF(key);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(key);
            if (self->pages[node].child != NONE) {
                node = self->pages[node].child;
                continue;
            }
            while (node != root && self->pages[node].next == NONE)
                node = self->pages[node].parent;
            if (node == root)
                break;
            node = self->pages[node].next;
        }
    }
    return out;
}

static PyObject *index_roots(index_t *self, PyObject *ns_id) {
    return list_subtrees(self, ns_id, 0);
}

static PyObject *index_keys(index_t *self, PyObject *ns_id) {
    return list_subtrees(self, ns_id, 1);
}

static PyObject *page_id_of(index_t *self, uint32_t page) {
    PyObject *key = page_key_object(&self->pages[page]);
    return key ? Py_BuildValue("(ON)", self->ns[self->pages[page].ns].id, key) : NULL;
}

/* _records(ids) -> list of every page's record (ids=False) or page id (ids=True). */
static PyObject *index_all(index_t *self, PyObject *arg) {
    int ids = PyObject_IsTrue(arg);
    if (ids < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    for (uint32_t i = 0; i < self->used; i++) {
        if (!(self->pages[i].flags & F_ALIVE))
            continue;
        PyObject *item = ids ? page_id_of(self, i) : record_of(self, i);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

/* _recovered(records): offer pages adopted from NVMe at start-up, all at tick 0, in this order. */
static PyObject *index_offer_recovered(index_t *self, PyObject *records) {
    for (size_t i = 0; i < self->heap_count; i++)
        if (self->heaps[i].nvme && self->heaps[i].count) {
            PyErr_SetString(PyExc_AssertionError, "recovery runs before anything else reaches the index");
            return NULL;
        }
    FOR_RECORDS(records, page, {
        page_t *p = &self->pages[page];
        heap_t *h = heap_for(self, 1, p->tenant, 0, 0);
        entry_t entry = {p->tick, self->seq++, (uint32_t)page};
        if (!h || heap_push(h, entry) < 0)
            FAIL_IN_LOOP
    });
    self->seq++;   /* as itertools.count(next(seq) + n) in PageIndex.add_recovered */
    Py_RETURN_NONE;
}

static int check(int ok, const char *what) {
    if (!ok)
        PyErr_Format(PyExc_AssertionError, "page index: %s", what);
    return ok;
}

static PyObject *index_check_prefix_closed(index_t *self, PyObject *unused) {
    Py_ssize_t alive = 0, roots = 0, listed_roots = 0, anchored = 0;
    for (uint32_t i = 0; i < self->used; i++) {
        page_t *p = &self->pages[i];
        if (!(p->flags & F_ALIVE))
            continue;
        alive++;
        if (!check(in_dram(p) || (p->flags & (F_NVME | F_BUSY)), "an indexed page is held somewhere"))
            return NULL;
        pkey_t k = {.data = page_key(p), .len = p->key_len, .hex = (p->flags & F_HEX) != 0};
        if (!check(table_find(self, p->ns, &k, NULL) == i, "a page is found by its key"))
            return NULL;
        if (p->parent != NONE) {
            page_t *parent = &self->pages[p->parent];
            if (!check((parent->flags & F_ALIVE) && parent->ns == p->ns, "a page's parent is indexed"))
                return NULL;
            uint32_t c = parent->child;
            while (c != NONE && c != i)
                c = self->pages[c].next;
            if (!check(c == i, "a page is among its parent's children"))
                return NULL;
        } else {
            roots++;
        }
        for (uint32_t c = p->child; c != NONE; c = self->pages[c].next)
            if (!check(self->pages[c].parent == i && (self->pages[c].flags & F_ALIVE), "a child names its parent"))
                return NULL;
        if (p->flags & F_ANCHORED) {
            anchored++;
            PyObject *slot = page_slot_key(i);
            PyObject *anchor = slot ? PyDict_GetItemWithError(self->anchor_of, slot) : NULL;
            Py_XDECREF(slot);
            if (!check(anchor != NULL && p->parent == NONE, "an anchored page is a root with an anchor"))
                return NULL;
            pkey_t a;
            key_encode(&a, (const uint8_t *)PyBytes_AS_STRING(anchor), (size_t)PyBytes_GET_SIZE(anchor));
            if (!check(table_find(self, p->ns, &a, NULL) == NONE, "an anchored page's parent is absent"))
                return NULL;
        }
    }
    for (uint32_t n = 0; n < self->ns_count; n++) {
        for (uint32_t r = self->ns[n].roots; r != NONE; r = self->pages[r].next) {
            listed_roots++;
            if (!check(self->pages[r].parent == NONE && (self->pages[r].flags & F_ALIVE) && self->pages[r].ns == n,
                       "a listed root is an indexed page without a parent"))
                return NULL;
        }
    }
    Py_ssize_t waiting = 0;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(self->anchored, &pos, &key, &value))
        waiting += PySet_GET_SIZE(value);
    if (!check(alive == self->alive && alive == (Py_ssize_t)self->table_count, "every page is counted once")
        || !check(roots == listed_roots, "the roots are listed per namespace")
        || !check(anchored == waiting && anchored == PyDict_GET_SIZE(self->anchor_of), "anchors are listed once"))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *index_anchored(index_t *self, PyObject *parent_id) {
    PyObject *waiting = PyDict_GetItemWithError(self->anchored, parent_id);
    if (!waiting && PyErr_Occurred())
        return NULL;
    return PySet_New(waiting);
}

/* _usage_rows() -> [(tenant, dram_pages, nvme_pages, nvme_bytes)], _namespace_rows() -> [(ns id, pages)] */
static PyObject *index_usage_rows(index_t *self, PyObject *unused) {
    Py_ssize_t n = PyList_GET_SIZE(self->tenant_names);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        usage_t *u = &self->usage[i];
        PyObject *row = Py_BuildValue("(OLLL)", PyList_GET_ITEM(self->tenant_names, i), (long long)u->dram_pages,
                                      (long long)u->nvme_pages, (long long)u->nvme_bytes);
        if (!row) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, row);
    }
    return out;
}

static PyObject *index_namespace_rows(index_t *self, PyObject *unused) {
    PyObject *out = PyList_New(self->ns_count);
    for (uint32_t i = 0; out && i < self->ns_count; i++) {
        PyObject *row = Py_BuildValue("(OK)", self->ns[i].id, (unsigned long long)self->ns[i].pages);
        if (!row) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, row);
    }
    return out;
}

/* memory_bytes() -> bytes this index holds in C (slots in use, key table, heaps; tests and the bench). */
static PyObject *index_memory_bytes(index_t *self, PyObject *unused) {
    size_t total = (size_t)self->used * sizeof(page_t) + (self->table ? (self->table_mask + 1) * 4 : 0)
                   + (self->proxies ? (self->proxy_mask + 1) * sizeof(proxy_slot_t) : 0);
    for (size_t i = 0; i < self->heap_count; i++)
        total += self->heaps[i].capacity * sizeof(entry_t);
    return PyLong_FromSize_t(total);
}

static PyObject *index_get_dram_pages(index_t *self, void *unused) {
    return PyLong_FromLongLong(self->dram_pages);
}

static PyObject *index_get_nvme_pages(index_t *self, void *unused) {
    return PyLong_FromLongLong(self->nvme_pages);
}

static PyMethodDef index_methods[] = {
    {"get", (PyCFunction)index_get, METH_O, "get(page_id) -> record | None"},
    {"add", (PyCFunction)(void (*)(void))index_add, METH_VARARGS | METH_KEYWORDS,
     "add(page_id, parent, offset, slot_bytes, checksum, on_nvme=False, anchor=b'') -> record"},
    {"add_chain", (PyCFunction)(void (*)(void))index_add_chain, METH_VARARGS | METH_KEYWORDS,
     "add_chain(namespace_id, keys, parent, offsets, slot_bytes, checksums) -> records, each the next's parent"},
    {"leading", (PyCFunction)(void (*)(void))index_leading, METH_VARARGS | METH_KEYWORDS,
     "leading(namespace_id, keys, key_bytes=0) -> records of the leading keys present; keys may be one "
     "bytes-like of key_bytes-long keys"},
    {"leading_offsets", (PyCFunction)(void (*)(void))index_leading_offsets, METH_VARARGS | METH_KEYWORDS,
     "leading_offsets(namespace_id, keys, key_bytes=0) -> the DRAM offsets of leading(...)"},
    {"touch_all", (PyCFunction)index_touch_all, METH_O, "touch_all(records): one access tick"},
    {"pin", (PyCFunction)index_pin, METH_O, "pin(record)"},
    {"pin_all", (PyCFunction)(void (*)(void))index_pin_all, METH_VARARGS | METH_KEYWORDS, "pin_all(records, hit)"},
    {"unpin_all", (PyCFunction)index_unpin_all, METH_O, "unpin_all(records)"},
    {"set_dram", (PyCFunction)(void (*)(void))index_set_dram, METH_VARARGS | METH_KEYWORDS, "set_dram(record, offset)"},
    {"set_on_nvme", (PyCFunction)(void (*)(void))index_set_on_nvme, METH_VARARGS | METH_KEYWORDS,
     "set_on_nvme(record, on_nvme)"},
    {"release_busy", (PyCFunction)index_release_busy, METH_O, "release_busy(record)"},
    {"evict_dram", (PyCFunction)(void (*)(void))index_evict_dram, METH_VARARGS | METH_KEYWORDS,
     "evict_dram(slot_bytes, clean_only, tenant=None) -> record | None"},
    {"oldest_evictable_slot_bytes", (PyCFunction)(void (*)(void))index_oldest_evictable_slot_bytes,
     METH_VARARGS | METH_KEYWORDS, "oldest_evictable_slot_bytes(clean_only) -> int | None"},
    {"evict_nvme", (PyCFunction)(void (*)(void))index_evict_nvme, METH_VARARGS | METH_KEYWORDS,
     "evict_nvme(shard_of, shard, count, tenant=None) -> records"},
    {"dram_only_lru", (PyCFunction)(void (*)(void))index_dram_only_lru, METH_VARARGS | METH_KEYWORDS,
     "dram_only_lru(count, tenant=None) -> records"},
    {"remove_subtree", (PyCFunction)index_remove_subtree, METH_O, "remove_subtree(record) -> records removed"},
    {"roots", (PyCFunction)index_roots, METH_O, "roots(namespace_id) -> records"},
    {"keys", (PyCFunction)index_keys, METH_O, "keys(namespace_id) -> keys"},
    {"_all", (PyCFunction)index_all, METH_O, "_all(ids) -> every page's record, or page id"},
    {"_offer_recovered", (PyCFunction)index_offer_recovered, METH_O, "_offer_recovered(records)"},
    {"check_prefix_closed", (PyCFunction)index_check_prefix_closed, METH_NOARGS, "assert the invariants"},
    {"anchored", (PyCFunction)index_anchored, METH_O, "anchored(parent_id) -> set of records"},
    {"_usage_rows", (PyCFunction)index_usage_rows, METH_NOARGS, "[(tenant, dram, nvme, nvme_bytes)]"},
    {"_namespace_rows", (PyCFunction)index_namespace_rows, METH_NOARGS, "[(namespace id, pages)]"},
    {"memory_bytes", (PyCFunction)index_memory_bytes, METH_NOARGS, "bytes held in C"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef index_getset[] = {
    {"dram_pages", (getter)index_get_dram_pages, NULL, "pages with a DRAM copy", NULL},
    {"nvme_pages", (getter)index_get_nvme_pages, NULL, "pages on NVMe", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods index_sequence = {
    .sq_length = (lenfunc)index_len,
    .sq_contains = (objobjproc)index_contains,
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore_native.PageIndex",
    .tp_basicsize = sizeof(index_t),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The prefix-closed page index in C (kvstore/control/native_index.py wraps it).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)index_init,
    .tp_dealloc = (destructor)index_dealloc,
    .tp_traverse = (traverseproc)index_traverse,
    .tp_clear = (inquiry)index_clear,
    .tp_methods = index_methods,
    .tp_getset = index_getset,
    .tp_as_sequence = &index_sequence,
};

/* ---------------------------------------------------------------- the record proxy */

static void record_dealloc(record_t *self) {
    index_t *index = self->index;
    if (self->page != NONE) {
        proxy_drop(index, self->page);
        page_t *p = &index->pages[self->page];
        p->flags &= ~F_PROXY;
        if (!(p->flags & F_ALIVE) && p->pins == 0)
            page_free(index, self->page);
    }
    Py_DECREF(index);
    PyObject_Free(self);
}

#define PAGE(self) (&(self)->index->pages[(self)->page])

static PyObject *record_get_page_id(record_t *self, void *unused) {
    return page_id_of(self->index, self->page);
}

static PyObject *record_get_parent(record_t *self, void *unused) {
    uint32_t parent = PAGE(self)->parent;
    if (parent == NONE)
        Py_RETURN_NONE;
    return record_of(self->index, parent);
}

static PyObject *record_get_children(record_t *self, void *unused) {
    uint32_t child = PAGE(self)->child;
    if (child == NONE)
        Py_RETURN_NONE;
    PyObject *set = PySet_New(NULL);
    for (; set && child != NONE; child = self->index->pages[child].next) {
        PyObject *record = record_of(self->index, child);
        if (!record || PySet_Add(set, record) < 0)
            Py_CLEAR(set);
        Py_XDECREF(record);
    }
    return set;
}

static PyObject *record_is_leaf(record_t *self, PyObject *unused) {
    return PyBool_FromLong(PAGE(self)->child == NONE);
}

static PyObject *record_get_offset(record_t *self, void *unused) {
    return PyLong_FromLongLong(PAGE(self)->offset);
}

static int record_set_offset(record_t *self, PyObject *value, void *unused) {
    long long offset = value ? PyLong_AsLongLong(value) : -1;
    if (offset == -1 && PyErr_Occurred())
        return -1;
    PAGE(self)->offset = offset;
    return 0;
}

static PyObject *record_get_in_dram(record_t *self, void *unused) {
    return PyBool_FromLong(in_dram(PAGE(self)));
}

static PyObject *record_get_slot_bytes(record_t *self, void *unused) {
    return PyLong_FromUnsignedLong(PAGE(self)->slot_bytes);
}

static PyObject *record_get_checksum(record_t *self, void *unused) {
    return PyLong_FromUnsignedLongLong(PAGE(self)->checksum);
}

static PyObject *record_get_tick(record_t *self, void *unused) {
    return PyLong_FromUnsignedLongLong(order_tick(PAGE(self)->tick));
}

static int set_u32(uint32_t *field, PyObject *value, const char *name) {
    if (!value) {
        PyErr_Format(PyExc_AttributeError, "%s cannot be deleted", name);
        return -1;
    }
    unsigned long v = PyLong_AsUnsignedLong(value);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s out of range: %lu", name, v);
        return -1;
    }
    *field = (uint32_t)v;
    return 0;
}

static PyObject *record_get_pins(record_t *self, void *unused) {
    return PyLong_FromUnsignedLong(PAGE(self)->pins);
}

static int record_set_pins(record_t *self, PyObject *value, void *unused) {
    return set_u32(&PAGE(self)->pins, value, "pins");
}

static PyObject *record_get_hits(record_t *self, void *unused) {
    return PyLong_FromUnsignedLong(PAGE(self)->hits);
}

static int record_set_hits(record_t *self, PyObject *value, void *unused) {
    return set_u32(&PAGE(self)->hits, value, "hits");
}

static PyObject *record_get_flag(record_t *self, void *flag) {
    return PyBool_FromLong((PAGE(self)->flags & (uintptr_t)flag) != 0);
}

static int record_set_flag(record_t *self, PyObject *value, void *flag) {
    int on = value ? PyObject_IsTrue(value) : -1;
    if (on < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "a flag cannot be deleted");
        return -1;
    }
    page_t *p = PAGE(self);
    p->flags = on ? (p->flags | (uint16_t)(uintptr_t)flag) : (p->flags & ~(uint16_t)(uintptr_t)flag);
    return 0;
}

static PyObject *record_get_anchor(record_t *self, void *unused) {
    if (!(PAGE(self)->flags & F_ANCHORED))
        return PyBytes_FromStringAndSize("", 0);
    PyObject *slot = page_slot_key(self->page);
    PyObject *anchor = slot ? PyDict_GetItemWithError(self->index->anchor_of, slot) : NULL;
    Py_XDECREF(slot);
    Py_XINCREF(anchor);
    return anchor;
}

static PyObject *record_get_tenant(record_t *self, void *unused) {
    PyObject *name = PyList_GetItem(self->index->tenant_names, PAGE(self)->tenant);
    Py_XINCREF(name);
    return name;
}

static PyObject *record_get_nvme_refused_bytes(record_t *self, void *unused) {
    if (!(PAGE(self)->flags & F_REFUSED))
        return PyLong_FromLong(-1);
    PyObject *slot = page_slot_key(self->page);
    PyObject *value = slot ? PyDict_GetItemWithError(self->index->refused, slot) : NULL;
    Py_XDECREF(slot);
    Py_XINCREF(value);
    return value;
}

static int record_set_nvme_refused_bytes(record_t *self, PyObject *value, void *unused) {
    long long refused_bytes = value ? PyLong_AsLongLong(value) : -1;
    if (refused_bytes == -1 && PyErr_Occurred())
        return -1;
    PyObject *slot = page_slot_key(self->page);
    if (!slot)
        return -1;
    page_t *p = PAGE(self);
    int rc = 0;
    if (refused_bytes < 0) {
        if (p->flags & F_REFUSED)
            rc = PyDict_DelItem(self->index->refused, slot);
        p->flags &= ~F_REFUSED;
    } else {
        rc = PyDict_SetItem(self->index->refused, slot, value);
        if (rc == 0)
            p->flags |= F_REFUSED;
    }
    Py_DECREF(slot);
    return rc;
}

static PyObject *record_repr(record_t *self) {
    page_t *p = PAGE(self);
    PyObject *page_id = page_id_of(self->index, self->page);
    if (!page_id)
        return NULL;
    PyObject *out = PyUnicode_FromFormat("<IndexRecord %R offset=%lld%s%s>", page_id, (long long)p->offset,
                                         (p->flags & F_NVME) ? " nvme" : "", (p->flags & F_ALIVE) ? "" : " removed");
    Py_DECREF(page_id);
    return out;
}

static PyGetSetDef record_getset[] = {
    {"page_id", (getter)record_get_page_id, NULL, "(namespace id, key)", NULL},
    {"parent", (getter)record_get_parent, NULL, "the parent page's record, or None", NULL},
    {"children", (getter)record_get_children, NULL, "the children's records (a new set), or None", NULL},
    {"offset", (getter)record_get_offset, (setter)record_set_offset, "DRAM slot, or NO_SLOT", NULL},
    {"in_dram", (getter)record_get_in_dram, NULL, "it has a DRAM slot", NULL},
    {"slot_bytes", (getter)record_get_slot_bytes, NULL, NULL, NULL},
    {"checksum", (getter)record_get_checksum, NULL, NULL, NULL},
    {"tick", (getter)record_get_tick, NULL, "logical time of the last access", NULL},
    {"pins", (getter)record_get_pins, (setter)record_set_pins, NULL, NULL},
    {"hits", (getter)record_get_hits, (setter)record_set_hits, NULL, NULL},
    {"alive", (getter)record_get_flag, NULL, "still in the index", (void *)(uintptr_t)F_ALIVE},
    {"on_nvme", (getter)record_get_flag, NULL, NULL, (void *)(uintptr_t)F_NVME},
    {"busy", (getter)record_get_flag, (setter)record_set_flag, NULL, (void *)(uintptr_t)F_BUSY},
    {"queued", (getter)record_get_flag, (setter)record_set_flag, NULL, (void *)(uintptr_t)F_QUEUED},
    {"anchor", (getter)record_get_anchor, NULL, "the absent parent's key this root waits for", NULL},
    {"tenant", (getter)record_get_tenant, NULL, "its namespace's tenant", NULL},
    {"nvme_refused_bytes", (getter)record_get_nvme_refused_bytes, (setter)record_set_nvme_refused_bytes, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef record_methods[] = {
    {"is_leaf", (PyCFunction)record_is_leaf, METH_NOARGS, "no child"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore_native.IndexRecord",
    .tp_basicsize = sizeof(record_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A page of a native PageIndex: a view of its slot (the same object while anyone holds it).",
    .tp_dealloc = (destructor)record_dealloc,
    .tp_repr = (reprfunc)record_repr,
    .tp_getset = record_getset,
    .tp_methods = record_methods,
};

int page_index_register(PyObject *module) {
    hex_value_fill();
    if (PyType_Ready(&IndexType) < 0 || PyType_Ready(&RecordType) < 0)
        return -1;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(module, "PageIndex", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        return -1;
    }
    Py_INCREF(&RecordType);
    if (PyModule_AddObject(module, "IndexRecord", (PyObject *)&RecordType) < 0) {
        Py_DECREF(&RecordType);
        return -1;
    }
    return 0;
}
