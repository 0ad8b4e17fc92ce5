/* IndexRecord: a view of one page index slot, made on demand; the same object while anyone holds it
 * (the slot's live record is found in the index's record table). A removed page's slot is freed
 * when its last record goes and no pin is left. */
#include "page_index_parts.h"

/* A new reference to the page's record: its live proxy, or a new one. */
PyObject *record_of(index_t *self, uint32_t page) {
    page_t *p = &self->pages[page];
    if (p->flags & F_PROXY) {
        PyObject *proxy = proxy_find(self, page);
        Py_INCREF(proxy);
        return proxy;
    }
    record_t *r = PyObject_GC_New(record_t, &RecordType);
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
    PyObject_GC_Track(r);
    return (PyObject *)r;
}

/* The page a record argument names; -1 with an error set when it is not one of this index's. */
int64_t page_of(index_t *self, PyObject *obj) {
    if (Py_TYPE(obj) != &RecordType || ((record_t *)obj)->index != self) {
        PyErr_Format(PyExc_TypeError, "expected a record of this index, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    return ((record_t *)obj)->page;
}

void page_free(index_t *self, uint32_t page) {
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

PyObject *page_id_of(index_t *self, uint32_t page) {
    PyObject *key = page_key_object(&self->pages[page]);
    return key ? Py_BuildValue("(ON)", self->ns[self->pages[page].ns].id, key) : NULL;
}

/* ---------------------------------------------------------------- the record proxy */

/* A record holds its index, and the index (its anchors' sets) may hold the record: the collector must
 * see the edge. No tp_clear: the index's clear drops the sets, which breaks any such cycle, and a
 * record without its index could not be read. */
static int record_traverse(record_t *self, visitproc visit, void *arg) {
    Py_VISIT(self->index);
    return 0;
}

static void record_dealloc(record_t *self) {
    PyObject_GC_UnTrack(self);
    index_t *index = self->index;
    if (self->page != NONE) {
        proxy_drop(index, self->page);
        page_t *p = &index->pages[self->page];
        p->flags &= ~F_PROXY;
        if (!(p->flags & F_ALIVE) && p->pins == 0)
            page_free(index, self->page);
    }
    Py_DECREF(index);
    PyObject_GC_Del(self);
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

/* hits saturates at UINT32_MAX rather than refuse a count past it: a page read 2^32 times (50 days
   at 1,000 gets/s) stays readable, and hits only tells hot pages from cold. */
static PyObject *record_get_hits(record_t *self, void *unused) {
    return PyLong_FromUnsignedLong(PAGE(self)->hits);
}

static int record_set_hits(record_t *self, PyObject *value, void *unused) {
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "hits cannot be deleted");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();   /* past 64 bits as well: saturated all the same */
    }
    PAGE(self)->hits = v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
    return 0;
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

PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore_native.IndexRecord",
    .tp_basicsize = sizeof(record_t),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)record_traverse,
    .tp_doc = "A page of a native PageIndex: a view of its slot (the same object while anyone holds it).",
    .tp_dealloc = (destructor)record_dealloc,
    .tp_repr = (reprfunc)record_repr,
    .tp_getset = record_getset,
    .tp_methods = record_methods,
};

