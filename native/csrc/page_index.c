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
 * - lazy-deletion LRU orders of (tick, seq, slot) per (tenant, slot size, clean) for DRAM and
 *   per tenant for NVMe (a queue of entries offered in order beside a heap of the rest), popped
 *   under the rules of PageIndex._dram_evictable/_nvme_evictable.
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
 * Files: page_index.c (the index type: adds, pins, evictions, removal, anchors), page_table.c (keys
 * and the key table), page_heaps.c (the LRU heaps), index_record.c (the record proxy),
 * page_index_parts.h (the layouts they share).
 *
 * Not thread-safe: the page store's lock guards every call.
 */
#include "page_index.h"
#include "page_index_parts.h"

static PyTypeObject IndexType;

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

/* PageIndex._remove: the leaf leaves the index; with notify, an unpinned one goes to on_removed. Without,
 * the caller frees its DRAM slot: its offset reads NO_SLOT, and its slot is freed now unless a record
 * still views it (then as that record goes). */
static int remove_page_notify(index_t *self, uint32_t page, int notify) {
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
    self->live_ns[page] = NONE;
    p->parent = NONE;   /* the parent's slot may be reused once it is gone too */
    if (parent != NONE && self->pages[parent].child == NONE && offer(self, parent) < 0)
        return -1;
    if (p->pins == 0 && notify)
        return call_with_record(self, self->on_removed, page);
    p = &self->pages[page];
    if (p->pins == 0) {
        p->offset = NO_SLOT;
        if (!(p->flags & F_PROXY))
            page_free(self, page);
    }
    return 0;
}

static int remove_page(index_t *self, uint32_t page) {
    return remove_page_notify(self, page, 1);
}

static int drop_dram(index_t *self, uint32_t page, int notify) {
    page_t *p = &self->pages[page];
    self->dram_pages--;
    self->usage[p->tenant].dram_pages--;
    if (notify && call_with_record(self, self->on_dram_dropped, page) < 0)
        return -1;
    self->pages[page].offset = NO_SLOT;
    return 0;
}

static int set_on_nvme(index_t *self, uint32_t page, int on, int shard) {
    page_t *p = &self->pages[page];
    if (((p->flags & F_NVME) != 0) == on)
        return 0;
    usage_count(self, p, -1);
    p->flags = on ? (p->flags | F_NVME) : (p->flags & ~F_NVME);
    p->shard = (uint8_t)shard;
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
        heap_free(&self->heaps[i]);
    free(self->heaps);
    free(self->pages);
    free(self->live_ns);
    free(self->table);
    free(self->tags);
    free(self->distances);
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
        if (pages)
            self->pages = pages;
        uint32_t *live_ns = pages ? realloc(self->live_ns, grown * sizeof *live_ns) : NULL;
        if (!live_ns) {   /* both keep at least the old capacity: the index stays as it was */
            PyErr_NoMemory();
            return -1;
        }
        self->live_ns = live_ns;
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

/* The tenant slot of a namespace's pages (tenant_of asked, once per call that adds pages); -1 on error. */
static int64_t tenant_of_namespace(index_t *self, PyObject *ns_id) {
    PyObject *name = self->tenant_of == Py_None ? PyUnicode_FromStringAndSize("", 0)
                                                : PyObject_CallOneArg(self->tenant_of, ns_id);
    int64_t tenant = name ? tenant_lookup(self, name, 1) : -1;
    Py_XDECREF(name);
    return tenant;
}

/* Insert one page; returns its slot, or -1 with an error set. `parent` is NONE for a root; `ns` is
 * ns_lookup(ns_id, create) and `tenant` tenant_of_namespace(ns_id), both asked once per call of the caller. */
static int64_t add_page(index_t *self, PyObject *ns_id, int64_t ns, const uint8_t *data, size_t len, uint32_t parent,
                        int64_t offset, uint32_t slot_bytes, uint64_t checksum, int on_nvme, PyObject *anchor,
                        int64_t tenant) {
    if (len > KEY_BYTES_MAX) {
        PyErr_Format(PyExc_ValueError, "a key of the native page index is at most %d bytes, got %zu", KEY_BYTES_MAX,
                     len);
        return -1;
    }
    pkey_t k;
    key_encode(&k, data, len);
    size_t position;   /* where the page goes in the key table: found before anything changes the table */
    if (table_reserve(self, self->table_count + 1) < 0)
        return -1;
    uint64_t hash = key_hash(self, (uint32_t)ns, k.data, k.len, k.hex);
    if (table_find_hashed(self, (uint32_t)ns, &k, hash, &position) != NONE) {
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
    self->live_ns[page] = (uint32_t)ns;
    p->parent = parent;
    p->child = p->next = p->prev = NONE;
    p->slot_bytes = slot_bytes;
    p->tenant = (uint16_t)tenant;
    if (parent != NONE)
        siblings_push(self, &self->pages[parent].child, page);
    else
        siblings_push(self, &self->ns[ns].roots, page);
    table_put(self, position, page, hash);
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

/* An int argument in 0..max: *out, or -1 with an error naming it (nothing is truncated). */
static int uint_arg(PyObject *obj, const char *name, unsigned long long max, unsigned long long *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
    } else if (v <= max) {
        *out = v;
        return 0;
    }
    PyErr_Format(PyExc_OverflowError, "%s must be in 0..%llu, got %R", name, max, obj);
    return -1;
}

/* NVMe shards are numbered 0..255 (config: at most 256 nvme.paths). */
static int shard_arg(int shard) {
    if (shard < 0 || shard > UINT8_MAX) {
        PyErr_Format(PyExc_ValueError, "NVMe shard %d is not in 0..255", shard);
        return -1;
    }
    return 0;
}

static int64_t parent_arg(index_t *self, PyObject *parent) {
    if (parent == Py_None)
        return NONE;
    return page_of(self, parent);
}

static PyObject *index_add(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"page_id", "parent", "offset", "slot_bytes", "checksum", "on_nvme", "anchor", "shard",
                            NULL};
    PyObject *page_id, *parent, *anchor = NULL, *slot_bytes_obj, *checksum_obj;
    long long offset;
    unsigned long long slot_bytes, checksum;
    int on_nvme = 0, shard = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOLOO|pSi", names, &page_id, &parent, &offset, &slot_bytes_obj,
                                     &checksum_obj, &on_nvme, &anchor, &shard))
        return NULL;
    if (uint_arg(slot_bytes_obj, "slot_bytes", UINT32_MAX, &slot_bytes) < 0
        || uint_arg(checksum_obj, "checksum", UINT64_MAX, &checksum) < 0 || shard_arg(shard) < 0)
        return NULL;
    PyObject *ns_id;
    const uint8_t *data;
    Py_ssize_t len;
    int64_t parent_page = parent_arg(self, parent);
    if (parent_page < 0 || parse_page_id(page_id, &ns_id, &data, &len) < 0)
        return NULL;
    int64_t ns = ns_lookup(self, ns_id, 1);
    int64_t tenant = ns < 0 ? -1 : tenant_of_namespace(self, ns_id);
    if (tenant < 0)
        return NULL;
    int64_t page = add_page(self, ns_id, ns, data, (size_t)len, (uint32_t)parent_page, offset, (uint32_t)slot_bytes,
                            checksum, on_nvme, anchor, tenant);
    if (page < 0)
        return NULL;
    self->pages[page].shard = (uint8_t)shard;
    return record_of(self, (uint32_t)page);
}

/* add_chain(ns_id, keys, parent, offsets, slot_bytes, checksums, records=True): a commit's pages, each the
 * parent of the next (the first's parent is `parent`, a record or None), added and touched (one access
 * tick) in one call. Returns their records, or with records=False their number: no object per page. */
static PyObject *index_add_chain(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"namespace_id", "keys", "parent", "offsets", "slot_bytes", "checksums", "records", NULL};
    PyObject *ns_id, *key_list, *parent, *offsets, *checksums, *slot_bytes_obj;
    unsigned long long slot_bytes;
    int want_records = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OO!OO!|p", names, &ns_id, &PyList_Type, &key_list, &parent,
                                     &PyList_Type, &offsets, &slot_bytes_obj, &PyList_Type, &checksums,
                                     &want_records))
        return NULL;
    if (uint_arg(slot_bytes_obj, "slot_bytes", UINT32_MAX, &slot_bytes) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(key_list);
    if (PyList_GET_SIZE(offsets) != n || PyList_GET_SIZE(checksums) != n) {
        PyErr_SetString(PyExc_ValueError, "keys, offsets and checksums have one entry per page");
        return NULL;
    }
    int64_t previous = parent_arg(self, parent);
    if (previous < 0)
        return NULL;
    /* Every argument is read before the first page is added: an offset's __index__ or the namespace id's
     * __hash__ may run Python code that changes the caller's lists, so the keys are held in a tuple of
     * our own and the numbers copied out, each list's length checked again after each conversion. */
    PyObject *keys = PySequence_Tuple(key_list);
    int64_t *page_offsets = PyMem_Malloc((n ? n : 1) * sizeof *page_offsets);
    uint64_t *page_checksums = PyMem_Malloc((n ? n : 1) * sizeof *page_checksums);
    uint32_t *pages = PyMem_Malloc((n ? n : 1) * sizeof *pages);
    PyObject *records = NULL, *out = NULL;
    if (!keys || !page_offsets || !page_checksums || !pages) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_SIZE(offsets) != n || PyList_GET_SIZE(checksums) != n) {
            PyErr_SetString(PyExc_RuntimeError, "add_chain's lists changed while it read them");
            goto done;
        }
        if (!PyBytes_Check(PyTuple_GET_ITEM(keys, i))) {
            PyErr_SetString(PyExc_TypeError, "keys are bytes");
            goto done;
        }
        PyObject *offset = PyList_GET_ITEM(offsets, i);
        Py_INCREF(offset);
        page_offsets[i] = PyLong_AsLongLong(offset);
        Py_DECREF(offset);
        if (page_offsets[i] == -1 && PyErr_Occurred())
            goto done;
        if (PyList_GET_SIZE(checksums) != n) {
            PyErr_SetString(PyExc_RuntimeError, "add_chain's lists changed while it read them");
            goto done;
        }
        unsigned long long checksum;
        if (uint_arg(PyList_GET_ITEM(checksums, i), "checksum", UINT64_MAX, &checksum) < 0)
            goto done;
        page_checksums[i] = checksum;
    }
    int64_t ns = n ? ns_lookup(self, ns_id, 1) : 0;
    int64_t tenant = n && ns >= 0 ? tenant_of_namespace(self, ns_id) : 0;
    if (ns < 0 || tenant < 0)
        goto done;
    records = want_records ? PyList_New(n) : NULL;
    if (want_records && !records)
        goto done;
    Py_ssize_t added = 0;
    for (; added < n; added++) {
        PyObject *key = PyTuple_GET_ITEM(keys, added);
        int64_t page = add_page(self, ns_id, ns, (const uint8_t *)PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key),
                                (uint32_t)previous, page_offsets[added], (uint32_t)slot_bytes, page_checksums[added],
                                0, NULL, tenant);
        if (page < 0)
            break;
        pages[added] = (uint32_t)page;
        previous = page;
    }
    /* Pages added before a failure stay added (as add() one at a time leaves them), touched like the rest. */
    int failed = added < n;
    uint64_t tick = self->clock++;
    for (Py_ssize_t i = 0; i < added; i++) {
        self->pages[pages[i]].tick = tick;
        if (offer(self, pages[i]) < 0) {
            failed = 1;
            break;
        }
        if (records && !failed) {
            PyObject *record = record_of(self, pages[i]);
            if (!record) {
                failed = 1;
                break;
            }
            PyList_SET_ITEM(records, i, record);
        }
    }
    if (!failed) {
        out = records ? records : PyLong_FromSsize_t(n);
        records = NULL;
    }
done:
    Py_XDECREF(records);
    Py_XDECREF(keys);
    PyMem_Free(page_offsets);
    PyMem_Free(page_checksums);
    PyMem_Free(pages);
    return out;
}

/* The keys argument of leading: a list of bytes, or one bytes-like of keys `key_bytes` long each; with
 * `digests`, each packed key is a hex key's 32 bytes (the key is its 64 lowercase digits). */
typedef struct {
    PyObject *list;
    Py_buffer packed;
    Py_ssize_t count, key_bytes;
    int digests;
} keys_arg_t;

static int keys_open(keys_arg_t *keys, PyObject *obj, Py_ssize_t key_bytes, int digests) {
    keys->list = NULL;
    keys->key_bytes = key_bytes;
    keys->digests = digests;
    if (digests && key_bytes != 32) {
        PyErr_Format(PyExc_ValueError, "digests are 32 bytes each, not key_bytes=%zd", key_bytes);
        return -1;
    }
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
    if (i >= PySequence_Fast_GET_SIZE(keys->list)) {
        PyErr_SetString(PyExc_RuntimeError, "the keys list changed during the call");
        return -1;
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

/* Key i in its stored form (key_encode's, or a digest as it is). */
static int keys_key(keys_arg_t *keys, Py_ssize_t i, pkey_t *k) {
    const uint8_t *data;
    size_t len;
    if (keys_get(keys, i, &data, &len) < 0)
        return -1;
    if (keys->digests)
        *k = (pkey_t){.data = data, .len = len, .hex = 1};
    else
        key_encode(k, data, len);
    return 0;
}

static void keys_close(keys_arg_t *keys) {
    if (!keys->list)
        PyBuffer_Release(&keys->packed);
}

/* Keys probed together. A long lookup's probes miss the cache (the tag, the table entry, the page, each
 * waiting on the one before): a block's keys are hashed and their tags and table entries asked for
 * first, then their pages, then probed, so the block waits on its misses side by side, not in a row. */
enum { PROBE_BLOCK = 16 };

static inline void prefetch_page(const index_t *self, uint64_t h) {
    size_t home = h & self->table_mask;
    if (self->tags[home]) {
        const char *page = (const char *)&self->pages[self->table[home]];
        __builtin_prefetch(page);
        __builtin_prefetch(page + sizeof(page_t) - 1);
    }
}

/* How many leading keys are present; their pages into `found` (room for keys->count). `ns`: the
 * namespace's slot, -1 when it has none. No Python code runs here, so a list's items stay valid. A key
 * that is not bytes raises only where every key before it is present, as a probe key by key would. */
static Py_ssize_t leading_pages(index_t *self, int64_t ns, keys_arg_t *keys, uint32_t *found) {
    if (ns < 0 || !self->table)
        return 0;
    Py_ssize_t n = 0;
    const uint64_t seeds[2] = {key_seed(self, (uint32_t)ns, 0), key_seed(self, (uint32_t)ns, 1)};   /* by k.hex */
    while (n < keys->count) {
        pkey_t k[PROBE_BLOCK];
        uint64_t h[PROBE_BLOCK];
        Py_ssize_t block = keys->count - n < PROBE_BLOCK ? keys->count - n : PROBE_BLOCK, ready = 0;
        for (; ready < block; ready++) {
            if (keys_key(keys, n + ready, &k[ready]) < 0)
                break;
            h[ready] = key_hash_seeded(seeds[k[ready].hex != 0], k[ready].data, k[ready].len);
            __builtin_prefetch(&self->tags[h[ready] & self->table_mask]);
            __builtin_prefetch(&self->table[h[ready] & self->table_mask]);
        }
        for (Py_ssize_t j = 0; j < ready; j++)
            prefetch_page(self, h[j]);
        for (Py_ssize_t j = 0; j < ready; j++, n++) {
            uint32_t page = table_find_hashed(self, (uint32_t)ns, &k[j], h[j], NULL);
            if (page == NONE) {
                if (ready < block)
                    PyErr_Clear();   /* the key that raised comes after this miss */
                return n;
            }
            found[n] = page;
        }
        if (ready < block)
            return -1;
    }
    return n;
}

/* leading(ns_id, keys, key_bytes=0) -> list[record]; places=True: where each is instead, as bytes. */
static PyObject *leading_common(index_t *self, PyObject *args, PyObject *kwargs, int places) {
    static char *names[] = {"namespace_id", "keys", "key_bytes", "digests", NULL};
    PyObject *ns_id, *obj;
    Py_ssize_t key_bytes = 0;
    int digests = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|np", names, &ns_id, &obj, &key_bytes, &digests))
        return NULL;
    /* the namespace first: its id's __hash__ and __eq__ may run Python code, which must not run while
     * the keys' list is read */
    int64_t ns = ns_lookup(self, ns_id, 0);
    if (ns < 0 && PyErr_Occurred())
        return NULL;
    keys_arg_t keys;
    if (keys_open(&keys, obj, key_bytes, digests) < 0)
        return NULL;
    PyObject *out = NULL;
    uint32_t *found = PyMem_Malloc((keys.count ? keys.count : 1) * sizeof *found);
    if (!found) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = leading_pages(self, ns, &keys, found);
    if (n < 0)
        goto done;
    if (places) {
        if ((out = PyBytes_FromStringAndSize(NULL, n)))
            for (Py_ssize_t i = 0; i < n; i++)
                PyBytes_AS_STRING(out)[i] = self->pages[found[i]].offset != NO_SLOT ? 1 : 2;
        goto done;
    }
    if (!(out = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = record_of(self, found[i]);
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

static PyObject *index_leading_places(index_t *self, PyObject *args, PyObject *kwargs) {
    return leading_common(self, args, kwargs, 1);
}

/* positions_held(ns_id, keys) -> list[int]: the positions of the keys whose pages are held (any of them). */
static PyObject *index_positions_held(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"namespace_id", "keys", NULL};
    PyObject *ns_id, *obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", names, &ns_id, &obj))
        return NULL;
    int64_t ns = ns_lookup(self, ns_id, 0);   /* before the keys are read, as in leading_common */
    if (ns < 0 && PyErr_Occurred())
        return NULL;
    keys_arg_t keys;
    if (keys_open(&keys, obj, 0, 0) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out || ns < 0) {
        keys_close(&keys);
        return out;
    }
    for (Py_ssize_t i = 0; i < keys.count; i++) {
        const uint8_t *data;
        size_t len;
        if (keys_get(&keys, i, &data, &len) < 0) {
            Py_CLEAR(out);
            break;
        }
        pkey_t k;
        key_encode(&k, data, len);
        if (table_find(self, (uint32_t)ns, &k, NULL) == NONE)
            continue;
        PyObject *position = PyLong_FromSsize_t(i);
        int failed = !position || PyList_Append(out, position) < 0;
        Py_XDECREF(position);
        if (failed) {
            Py_CLEAR(out);
            break;
        }
    }
    keys_close(&keys);
    return out;
}

/* places_each(ns_id, keys, key_bytes=0) -> bytes: where each key's page is, each key on its own: 0 not held,
 * 1 in DRAM, 2 on NVMe only (a residency query's answer, one byte a key, no object per key). */
static PyObject *index_places_each(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"namespace_id", "keys", "key_bytes", "digests", NULL};
    PyObject *ns_id, *obj;
    Py_ssize_t key_bytes = 0;
    int digests = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|np", names, &ns_id, &obj, &key_bytes, &digests))
        return NULL;
    int64_t ns = ns_lookup(self, ns_id, 0);   /* before the keys are read, as in leading_common */
    if (ns < 0 && PyErr_Occurred())
        return NULL;
    keys_arg_t keys;
    if (keys_open(&keys, obj, key_bytes, digests) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, keys.count);
    if (!out) {
        keys_close(&keys);
        return NULL;
    }
    uint8_t *places = (uint8_t *)PyBytes_AS_STRING(out);
    memset(places, 0, (size_t)keys.count);
    for (Py_ssize_t i = 0; i < keys.count && ns >= 0; i++) {
        pkey_t k;
        if (keys_key(&keys, i, &k) < 0) {
            Py_CLEAR(out);
            break;
        }
        uint32_t page = table_find(self, (uint32_t)ns, &k, NULL);
        if (page != NONE)
            places[i] = self->pages[page].offset != NO_SLOT ? 1 : 2;
    }
    keys_close(&keys);
    return out;
}

/* Apply fn to the page of every record in a sequence. */
#define FOR_RECORDS(seq_obj, page_var, ...)                                                        \
    do {                                                                                            \
        PyObject *fast_ = PySequence_Fast((seq_obj), "expected a sequence of records");            \
        if (!fast_)                                                                                 \
            return NULL;                                                                            \
        /* the size is read each step: a callback (unpin_all's on_removed) may change the list */     \
        for (Py_ssize_t i_ = 0; i_ < PySequence_Fast_GET_SIZE(fast_); i_++) {                       \
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

/* read_all(records): the pages were read together: one hit each (saturating) and one access tick. */
static PyObject *index_read_all(index_t *self, PyObject *records) {
    uint64_t tick = self->clock++;
    FOR_RECORDS(records, page, {
        page_t *p = &self->pages[page];
        p->hits += p->hits < UINT32_MAX;
        p->tick = tick;
        if (offer(self, (uint32_t)page) < 0)
            FAIL_IN_LOOP
    });
    Py_RETURN_NONE;
}

/* ready_prefix(records) -> int: how many leading records are alive and in DRAM (what a read lease keeps). */
static PyObject *index_ready_prefix(index_t *self, PyObject *records) {
    Py_ssize_t ready = 0;
    FOR_RECORDS(records, page, {
        const page_t *p = &self->pages[page];
        if (!(p->flags & F_ALIVE) || !in_dram(p))
            break;
        ready++;
    });
    return PyLong_FromSsize_t(ready);
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
        p->hits += hit && p->hits < UINT32_MAX;   /* saturates: hits tell hot pages from cold, no more */
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
    static char *names[] = {"record", "on_nvme", "shard", NULL};
    PyObject *record;
    int on, shard = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Op|i", names, &record, &on, &shard) || shard_arg(shard) < 0)
        return NULL;
    int64_t page = page_of(self, record);
    if (page < 0 || set_on_nvme(self, (uint32_t)page, on, shard) < 0)
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

/* PageIndex._oldest: the DRAM heap whose top is the oldest evictable entry of this size and tenant.
 * older_than_unsaved (with clean_only): the unsaved heaps compete too, and NULL when one of them holds
 * the oldest entry (PageIndex.evict_dram). */
static heap_t *oldest_dram(index_t *self, int64_t slot_bytes, int clean_only, int64_t tenant, int older_than_unsaved) {
    heap_t *best = NULL;
    for (size_t i = 0; i < self->heap_count; i++) {
        heap_t *h = &self->heaps[i];
        if (h->nvme || (clean_only && !older_than_unsaved && !h->clean)
            || (slot_bytes >= 0 && h->slot_bytes != slot_bytes) || (tenant != -1 && h->tenant != tenant))
            continue;
        heap_t *one = h;
        if (oldest_heap(self, &one, 1) && (!best || entry_less(heap_top(h), heap_top(best))))
            best = h;
    }
    return best && clean_only && !best->clean ? NULL : best;
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
    static char *names[] = {"slot_bytes", "clean_only", "tenant", "older_than_unsaved", NULL};
    PyObject *size_obj, *tenant_obj = Py_None;
    int clean_only, older_than_unsaved = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Op|Op", names, &size_obj, &clean_only, &tenant_obj,
                                     &older_than_unsaved))
        return NULL;
    int64_t slot_bytes, tenant;
    if (slot_bytes_arg(size_obj, &slot_bytes) < 0 || tenant_arg(self, tenant_obj, &tenant) < 0)
        return NULL;
    heap_t *best = oldest_dram(self, slot_bytes, clean_only, tenant, older_than_unsaved);
    if (!best)
        Py_RETURN_NONE;
    uint32_t page = heap_pop(best).page;
    PyObject *record = record_of(self, page);
    if (!record)
        return NULL;
    int failed = (self->pages[page].flags & F_NVME) ? drop_dram(self, page, 1) : remove_page(self, page);
    if (failed) {
        Py_DECREF(record);
        return NULL;
    }
    return record;
}

/* PageIndex.evict_dram_many: victims taken as evict_dram takes them, with no record or callback each. */
static PyObject *index_evict_dram_many(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"slot_bytes", "clean_only", "count", "tenant", "until_bytes", "older_than_unsaved", NULL};
    PyObject *size_obj, *tenant_obj = Py_None;
    int clean_only, older_than_unsaved = 0;
    Py_ssize_t count;
    long long until_bytes = 0, freed_bytes = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Opn|OLp", names, &size_obj, &clean_only, &count, &tenant_obj,
                                     &until_bytes, &older_than_unsaved))
        return NULL;
    int64_t slot_bytes, only;
    if (slot_bytes_arg(size_obj, &slot_bytes) < 0 || tenant_arg(self, tenant_obj, &only) < 0)
        return NULL;
    PyObject *offsets = PyList_New(0), *tenants = PyList_New(0);
    if (!offsets || !tenants)
        goto fail;
    while (PyList_GET_SIZE(offsets) < count) {
        heap_t *best = oldest_dram(self, slot_bytes, clean_only, only, older_than_unsaved);
        if (!best)
            break;
        uint32_t page = heap_pop(best).page;
        page_t *p = &self->pages[page];
        uint16_t tenant = p->tenant;
        PyObject *offset = PyLong_FromLongLong(p->offset);
        if (!offset || PyList_Append(offsets, offset) < 0) {
            Py_XDECREF(offset);
            goto fail;
        }
        Py_DECREF(offset);
        if (PyList_Append(tenants, PyList_GET_ITEM(self->tenant_names, tenant)) < 0)
            goto fail;
        freed_bytes += p->slot_bytes;
        if ((p->flags & F_NVME) ? drop_dram(self, page, 0) : remove_page_notify(self, page, 0))
            goto fail;
        if (until_bytes > 0 && freed_bytes >= until_bytes)
            break;
    }
    return Py_BuildValue("(NN)", offsets, tenants);
fail:
    Py_XDECREF(offsets);
    Py_XDECREF(tenants);
    return NULL;
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

/* evict_nvme(shard, count, tenant=None): take up to `count` pages off NVMe shard `shard` (None: any), of
 * this tenant (None: any), least recently used first. Each (tenant, shard) has its own order, so no
 * other shard's page is looked at. */
static PyObject *index_evict_nvme(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"shard", "count", "tenant", NULL};
    PyObject *shard_obj, *tenant_obj = Py_None;
    Py_ssize_t count;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|O", names, &shard_obj, &count, &tenant_obj))
        return NULL;
    int64_t tenant;
    if (tenant_arg(self, tenant_obj, &tenant) < 0)
        return NULL;
    int shard = -1;
    if (shard_obj != Py_None) {
        int overflow;
        long asked = PyLong_AsLongAndOverflow(shard_obj, &overflow);
        if ((asked == -1 && PyErr_Occurred()) || shard_arg(overflow || asked < 0 || asked > UINT8_MAX ? -1 : (int)asked) < 0)
            return NULL;
        shard = (int)asked;
    }
    heap_t **selected = PyMem_Malloc((self->heap_count + 1) * sizeof *selected);
    PyObject *taken = PyList_New(0);
    if (!selected || !taken) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    size_t *which = PyMem_Malloc((self->heap_count + 1) * sizeof *which);
    if (!which) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t n_selected = 0;
    for (size_t i = 0; i < self->heap_count; i++)
        if (self->heaps[i].nvme && (tenant == -1 || self->heaps[i].tenant == tenant)
            && (shard == -1 || self->heaps[i].slot_bytes == (uint32_t)shard))
            which[n_selected++] = i;
    while (PyList_GET_SIZE(taken) < count) {
        /* heaps may move (realloc) when set_on_nvme offers a page to a DRAM heap not made yet */
        for (size_t i = 0; i < n_selected; i++)
            selected[i] = &self->heaps[which[i]];
        heap_t *best = oldest_heap(self, selected, n_selected);
        if (!best)
            break;
        entry_t entry = heap_pop(best);
        PyObject *record = record_of(self, entry.page);
        if (!record)
            goto fail_which;
        int failed = set_on_nvme(self, entry.page, 0, 0) < 0
                     || (!in_dram(&self->pages[entry.page]) && remove_page(self, entry.page) < 0)
                     || PyList_Append(taken, record) < 0;
        Py_DECREF(record);
        if (failed)
            goto fail_which;
    }
    PyMem_Free(which);
    PyMem_Free(selected);
    return taken;
fail_which:
    PyMem_Free(which);
fail:
    PyMem_Free(selected);
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

/* Remove the page and every page that extends it, descendants first, without recursion, or only the first
 * `limit` of them in that order (a prefix of a post-order leaves the rest a tree); appends their records to
 * `removed`, and calls on_removed for each. */
static int remove_subtree_into(index_t *self, uint32_t top, Py_ssize_t limit, PyObject *removed) {
    /* Walk down to a leaf, remove it, continue from its parent; stop after the top. */
    uint32_t node = top;
    for (;;) {
        while (self->pages[node].child != NONE)
            node = self->pages[node].child;
        uint32_t parent = self->pages[node].parent;
        PyObject *item = record_of(self, node);
        if (!item || PyList_Append(removed, item) < 0) {
            Py_XDECREF(item);
            return -1;
        }
        Py_DECREF(item);
        if (remove_page_notify(self, node, 1) < 0)
            return -1;
        if (node == top || PyList_GET_SIZE(removed) == limit)
            return 0;
        node = parent;
    }
}

/* The arguments (record, limit=-1) of remove_subtree and remove_subtree_slots: the record's page, -1 with an error
 * set if it is none of this index's. */
static int64_t subtree_arguments(index_t *self, PyObject *args, PyObject *kwargs, Py_ssize_t *limit) {
    static char *names[] = {"record", "limit", NULL};
    PyObject *record;
    *limit = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n", names, &record, limit))
        return -1;
    return page_of(self, record);
}

/* remove_subtree(record, limit=-1) -> records removed, descendants first. */
static PyObject *index_remove_subtree(index_t *self, PyObject *args, PyObject *kwargs) {
    Py_ssize_t limit;
    int64_t top = subtree_arguments(self, args, kwargs, &limit);
    if (top < 0)
        return NULL;
    PyObject *removed = PyList_New(0);
    if (!removed || limit == 0)
        return removed;
    if (remove_subtree_into(self, (uint32_t)top, limit, removed) < 0)
        Py_CLEAR(removed);
    return removed;
}

/* The pages of the subtree under `top` in an order they can leave the index in, each after its children (the
 * order remove_subtree_into takes), at most `limit` of them (-1: all), into `order`, which has room for `room`:
 * how many, or -1 if more than room. */
static Py_ssize_t subtree_order(const index_t *self, uint32_t top, Py_ssize_t limit, uint32_t *order, Py_ssize_t room) {
    Py_ssize_t n = 0;
    uint32_t node = top;
    for (;;) {
        while (self->pages[node].child != NONE)
            node = self->pages[node].child;
        for (;;) {   /* a leaf of what is left: it goes next; then its next sibling's subtree, or its parent */
            if (n == limit)
                return n;
            if (n == room)
                return -1;
            order[n++] = node;
            if (node == top)
                return n;
            if (self->pages[node].next != NONE) {
                node = self->pages[node].next;
                break;
            }
            node = self->pages[node].parent;
        }
    }
}

/* remove_subtree_slots(record, limit=-1) -> (records, DRAM offsets): remove_subtree without on_removed; each
 * page's DRAM offset is the caller's to free (NO_SLOT where the page held none, or a lease still reads it: freed
 * as that lease ends). Every object it answers with is made before the first page leaves the index, so running
 * out of memory removes nothing: a failure part-way would lose the slots of the pages already removed. */
static PyObject *index_remove_subtree_slots(index_t *self, PyObject *args, PyObject *kwargs) {
    Py_ssize_t limit;
    int64_t top = subtree_arguments(self, args, kwargs, &limit);
    if (top < 0)
        return NULL;
    Py_ssize_t room = limit >= 0 ? limit : self->alive;
    uint32_t *order = PyMem_Malloc((room ? room : 1) * sizeof *order);
    if (!order)
        return PyErr_NoMemory();
    PyObject *removed = NULL, *slots = NULL, *out = NULL;
    Py_ssize_t n = subtree_order(self, (uint32_t)top, limit, order, room);
    if (n < 0) {
        PyErr_SetString(PyExc_AssertionError, "a subtree holds more pages than the index");
        goto done;
    }
    if (!(removed = PyList_New(n)) || !(slots = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        const page_t *p = &self->pages[order[i]];
        PyObject *record = record_of(self, order[i]);
        PyObject *slot = PyLong_FromLongLong(p->pins == 0 ? (long long)p->offset : (long long)NO_SLOT);
        if (!record || !slot) {
            Py_XDECREF(record);
            Py_XDECREF(slot);
            goto done;
        }
        PyList_SET_ITEM(removed, i, record);
        PyList_SET_ITEM(slots, i, slot);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (remove_page_notify(self, order[i], 0) < 0)
            goto done;
    out = PyTuple_Pack(2, removed, slots);
done:
    PyMem_Free(order);
    Py_XDECREF(removed);
    Py_XDECREF(slots);
    return out;
}

static PyObject *index_roots(index_t *self, PyObject *ns_id) {
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    int64_t ns = ns_lookup(self, ns_id, 0);
    if (ns < 0)
        return PyErr_Occurred() ? (Py_DECREF(out), NULL) : out;
    for (uint32_t root = self->ns[ns].roots; root != NONE; root = self->pages[root].next) {
        PyObject *record = record_of(self, root);
        if (!record || PyList_Append(out, record) < 0) {
            Py_XDECREF(record);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(record);
    }
    return out;
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

/* scan(start, positions_max, namespace_id=None, keys=False, found_max=-1) -> (list, next): the pages
 * in slots [start, start + positions_max) (of one namespace, or all), as records or (keys=True) their
 * keys, at most found_max of them (-1: no limit), and the slot to go on from (None: the end). A page keeps its slot while it is in the index, so a
 * scan meets it exactly once; one added or removed meanwhile may be met or not. */
static PyObject *index_scan(index_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"start", "positions_max", "namespace_id", "keys", "found_max", NULL};
    Py_ssize_t start, most, found_max = -1;
    PyObject *ns_id = Py_None;
    int keys = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn|Opn", names, &start, &most, &ns_id, &keys, &found_max))
        return NULL;
    if (start < 0 || most < 0) {
        PyErr_SetString(PyExc_ValueError, "scan: start and positions_max must not be negative");
        return NULL;
    }
    int64_t ns = -1;
    if (ns_id != Py_None) {
        ns = ns_lookup(self, ns_id, 0);
        if (ns < 0 && PyErr_Occurred())
            return NULL;
    }
    size_t stop = (size_t)start + (size_t)most;
    if (stop > self->used)
        stop = self->used;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    if (ns_id == Py_None || ns >= 0)
        for (size_t i = (size_t)start; i < stop; i++) {
            if (found_max >= 0 && PyList_GET_SIZE(out) >= found_max) {
                stop = i;
                break;
            }
            uint32_t live = self->live_ns[i];
            if (live == NONE || (ns >= 0 && live != (uint32_t)ns))
                continue;
            PyObject *item = keys ? page_key_object(&self->pages[i]) : record_of(self, (uint32_t)i);
            if (!item || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(item);
        }
    if (stop >= self->used)
        return Py_BuildValue("(NO)", out, Py_None);
    return Py_BuildValue("(Nn)", out, (Py_ssize_t)stop);
}

/* _recovered(records): offer pages adopted from NVMe at start-up, all at tick 0, in this order. */
static PyObject *index_offer_recovered(index_t *self, PyObject *records) {
    for (size_t i = 0; i < self->heap_count; i++)
        if (self->heaps[i].nvme && heap_size(&self->heaps[i])) {
            PyErr_SetString(PyExc_AssertionError, "recovery runs before anything else reaches the index");
            return NULL;
        }
    FOR_RECORDS(records, page, {
        page_t *p = &self->pages[page];
        heap_t *h = heap_for(self, 1, p->tenant, p->shard, 0);
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
        if (!check(self->live_ns[i] == ((p->flags & F_ALIVE) ? p->ns : NONE), "a slot's live namespace is its page's"))
            return NULL;
        if (!(p->flags & F_ALIVE))
            continue;
        alive++;
        if (!check(in_dram(p) || (p->flags & (F_NVME | F_BUSY)), "an indexed page is held somewhere"))
            return NULL;
        pkey_t k = {.data = page_key(p), .len = p->key_len, .hex = (p->flags & F_HEX) != 0};
        size_t position;
        if (!check(table_find(self, p->ns, &k, &position) == i, "a page is found by its key")
            || !check(table_distance_agrees(self, position), "a page's distance from its home position is kept"))
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
    size_t total = (size_t)self->used * (sizeof(page_t) + sizeof(uint32_t)) + (self->table ? (self->table_mask + 1) * 6 : 0)
                   + (self->proxies ? (self->proxy_mask + 1) * sizeof(proxy_slot_t) : 0);
    for (size_t i = 0; i < self->heap_count; i++)
        total += (self->heaps[i].capacity + self->heaps[i].run_capacity) * sizeof(entry_t);
    return PyLong_FromSize_t(total);
}

static PyObject *index_get_dram_pages(index_t *self, void *unused) {
    return PyLong_FromLongLong(self->dram_pages);
}

static PyObject *index_get_nvme_pages(index_t *self, void *unused) {
    return PyLong_FromLongLong(self->nvme_pages);
}

/* ---------------------------------------------------------------- the guard every method passes

   A method may call Python code midway (the namespace id's __hash__ and __eq__, tenant_of,
   on_removed, on_dram_dropped, an argument's __index__) while the index is half-way through a change;
   a call back into the index from there would find it so, so it is refused. */

static int index_enter(index_t *self) {
    if (!self->ns_slot || !self->on_removed) {   /* __new__ without __init__, or cleared by the collector */
        PyErr_SetString(PyExc_RuntimeError, "PageIndex is not initialised");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "PageIndex called from within one of its own calls (a callback or "
                                            "an argument's __hash__, __eq__ or __index__): call it afterwards");
        return -1;
    }
    self->busy = 1;
    return 0;
}

#define GUARDED(name, params, ...)                   \
    static PyObject *guarded_##name params {         \
        if (index_enter(self) < 0)                   \
            return NULL;                             \
        PyObject *out_ = name(self, __VA_ARGS__);    \
        self->busy = 0;                              \
        return out_;                                 \
    }
#define GUARDED_O(name) GUARDED(name, (index_t *self, PyObject *arg), arg)
#define GUARDED_KW(name) GUARDED(name, (index_t *self, PyObject *args, PyObject *kwargs), args, kwargs)

GUARDED_O(index_get)
GUARDED_KW(index_add)
GUARDED_KW(index_add_chain)
GUARDED_KW(index_positions_held)
GUARDED_KW(index_places_each)
GUARDED_KW(index_leading)
GUARDED_KW(index_leading_places)
GUARDED_O(index_touch_all)
GUARDED_O(index_read_all)
GUARDED_O(index_ready_prefix)
GUARDED_KW(index_scan)
GUARDED_O(index_pin)
GUARDED_KW(index_pin_all)
GUARDED_O(index_unpin_all)
GUARDED_KW(index_set_dram)
GUARDED_KW(index_set_on_nvme)
GUARDED_O(index_release_busy)
GUARDED_KW(index_evict_dram)
GUARDED_KW(index_evict_dram_many)
GUARDED_KW(index_evict_nvme)
GUARDED_KW(index_dram_only_lru)
GUARDED_KW(index_remove_subtree)
GUARDED_KW(index_remove_subtree_slots)
GUARDED_O(index_roots)
GUARDED_O(index_all)
GUARDED_O(index_offer_recovered)
GUARDED_O(index_check_prefix_closed)
GUARDED_O(index_anchored)
GUARDED_O(index_usage_rows)
GUARDED_O(index_namespace_rows)
GUARDED_O(index_memory_bytes)

static int guarded_index_contains(index_t *self, PyObject *page_id) {
    if (index_enter(self) < 0)
        return -1;
    int found = index_contains(self, page_id);
    self->busy = 0;
    return found;
}

static PyMethodDef index_methods[] = {
    {"get", (PyCFunction)guarded_index_get, METH_O, "get(page_id) -> record | None"},
    {"add", (PyCFunction)(void (*)(void))guarded_index_add, METH_VARARGS | METH_KEYWORDS,
     "add(page_id, parent, offset, slot_bytes, checksum, on_nvme=False, anchor=b'') -> record"},
    {"add_chain", (PyCFunction)(void (*)(void))guarded_index_add_chain, METH_VARARGS | METH_KEYWORDS,
     "add_chain(namespace_id, keys, parent, offsets, slot_bytes, checksums, records=True) -> records (or, with "
     "records=False, their number), each the next's parent, added and touched together"},
    {"positions_held", (PyCFunction)(void (*)(void))guarded_index_positions_held, METH_VARARGS | METH_KEYWORDS,
     "positions_held(namespace_id, keys) -> positions of the keys whose pages are held, in order"},
    {"places_each", (PyCFunction)(void (*)(void))guarded_index_places_each, METH_VARARGS | METH_KEYWORDS,
     "places_each(namespace_id, keys, key_bytes=0, digests=False) -> bytes: 0 not held, 1 in DRAM, 2 on NVMe only, "
     "a key each; digests: the packed keys are hex keys' 32 bytes"},
    {"leading", (PyCFunction)(void (*)(void))guarded_index_leading, METH_VARARGS | METH_KEYWORDS,
     "leading(namespace_id, keys, key_bytes=0, digests=False) -> records of the leading keys present; keys may be "
     "one bytes-like of key_bytes-long keys (digests: hex keys' 32 bytes each)"},
    {"leading_places", (PyCFunction)(void (*)(void))guarded_index_leading_places, METH_VARARGS | METH_KEYWORDS,
     "leading_places(namespace_id, keys, key_bytes=0, digests=False) -> bytes: where each page of leading(...) is, "
     "as places_each"},
    {"touch_all", (PyCFunction)guarded_index_touch_all, METH_O, "touch_all(records): one access tick"},
    {"read_all", (PyCFunction)guarded_index_read_all, METH_O, "read_all(records): one hit each, one access tick"},
    {"ready_prefix", (PyCFunction)guarded_index_ready_prefix, METH_O,
     "ready_prefix(records) -> int: how many leading records are alive and in DRAM"},
    {"scan", (PyCFunction)(void (*)(void))guarded_index_scan, METH_VARARGS | METH_KEYWORDS,
     "scan(start, positions_max, namespace_id=None, keys=False, found_max=-1) -> (pages, next position or None)"},
    {"pin", (PyCFunction)guarded_index_pin, METH_O, "pin(record)"},
    {"pin_all", (PyCFunction)(void (*)(void))guarded_index_pin_all, METH_VARARGS | METH_KEYWORDS,
     "pin_all(records, hit)"},
    {"unpin_all", (PyCFunction)guarded_index_unpin_all, METH_O, "unpin_all(records)"},
    {"set_dram", (PyCFunction)(void (*)(void))guarded_index_set_dram, METH_VARARGS | METH_KEYWORDS,
     "set_dram(record, offset)"},
    {"set_on_nvme", (PyCFunction)(void (*)(void))guarded_index_set_on_nvme, METH_VARARGS | METH_KEYWORDS,
     "set_on_nvme(record, on_nvme)"},
    {"release_busy", (PyCFunction)guarded_index_release_busy, METH_O, "release_busy(record)"},
    {"evict_dram", (PyCFunction)(void (*)(void))guarded_index_evict_dram, METH_VARARGS | METH_KEYWORDS,
     "evict_dram(slot_bytes, clean_only, tenant=None, older_than_unsaved=False) -> record | None"},
    {"evict_dram_many", (PyCFunction)(void (*)(void))guarded_index_evict_dram_many, METH_VARARGS | METH_KEYWORDS,
     "evict_dram_many(slot_bytes, clean_only, count, tenant=None, until_bytes=0, older_than_unsaved=False)"
     " -> (offsets, tenants)"},
    {"evict_nvme", (PyCFunction)(void (*)(void))guarded_index_evict_nvme, METH_VARARGS | METH_KEYWORDS,
     "evict_nvme(shard, count, tenant=None) -> records"},
    {"dram_only_lru", (PyCFunction)(void (*)(void))guarded_index_dram_only_lru, METH_VARARGS | METH_KEYWORDS,
     "dram_only_lru(count, tenant=None) -> records"},
    {"remove_subtree", (PyCFunction)(void (*)(void))guarded_index_remove_subtree, METH_VARARGS | METH_KEYWORDS,
     "remove_subtree(record, limit=-1) -> records removed, descendants first"},
    {"remove_subtree_slots", (PyCFunction)(void (*)(void))guarded_index_remove_subtree_slots,
     METH_VARARGS | METH_KEYWORDS,
     "remove_subtree_slots(record, limit=-1) -> (records, DRAM offsets now the caller's), no on_removed"},
    {"roots", (PyCFunction)guarded_index_roots, METH_O, "roots(namespace_id) -> records"},
    {"_all", (PyCFunction)guarded_index_all, METH_O, "_all(ids) -> every page's record, or page id"},
    {"_offer_recovered", (PyCFunction)guarded_index_offer_recovered, METH_O, "_offer_recovered(records)"},
    {"check_prefix_closed", (PyCFunction)guarded_index_check_prefix_closed, METH_NOARGS, "assert the invariants"},
    {"anchored", (PyCFunction)guarded_index_anchored, METH_O, "anchored(parent_id) -> set of records"},
    {"_usage_rows", (PyCFunction)guarded_index_usage_rows, METH_NOARGS, "[(tenant, dram, nvme, nvme_bytes)]"},
    {"_namespace_rows", (PyCFunction)guarded_index_namespace_rows, METH_NOARGS, "[(namespace id, pages)]"},
    {"memory_bytes", (PyCFunction)guarded_index_memory_bytes, METH_NOARGS, "bytes held in C"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef index_getset[] = {
    {"dram_pages", (getter)index_get_dram_pages, NULL, "pages with a DRAM copy", NULL},
    {"nvme_pages", (getter)index_get_nvme_pages, NULL, "pages on NVMe", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods index_sequence = {
    .sq_length = (lenfunc)index_len,
    .sq_contains = (objobjproc)guarded_index_contains,
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

int page_index_register(PyObject *module) {
    hex_value_fill();
    return PyModule_AddType(module, &IndexType) < 0 || PyModule_AddType(module, &RecordType) < 0 ? -1 : 0;
}
