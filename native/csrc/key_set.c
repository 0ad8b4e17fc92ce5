/* KeySet: a set of bytes keys whose leading run over a chain is counted in one call, without a Python
 * object per key of the chain (the node's engine index: which of our keys an engine holds; a residency
 * query asks it about a 128k-token prompt's 8192 keys, packed in one buffer).
 *
 * Open addressing with linear probing and backward-shift deletion (no tombstones, so a probe ends at
 * the first empty position however many keys came and went). Each position keeps the key's 64-bit
 * hash, which is compared before the bytes, and a reference to the bytes object itself: the set owns
 * no copy of a key, as a Python set owns none. Every call runs under the GIL and never releases it, so
 * the set needs no lock of its own. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "key_set.h"
#include "xxh3.h"

#define KS_CAPACITY_MIN 16   /* positions; a power of two */

typedef struct {
    uint64_t hash;
    PyObject *key;   /* a bytes object, NULL where the position is empty */
} ks_slot_t;

typedef struct {
    PyObject_HEAD
    ks_slot_t *slots;
    size_t mask;      /* positions - 1 */
    Py_ssize_t count;
} key_set_t;

static inline uint64_t ks_hash(const uint8_t *data, size_t len) {
    return xxh3_64_scalar(data, len);   /* keys are short: the scalar kernel is the fast one */
}

/* The position holding the key, or of the empty position where its probe ends. */
static size_t ks_find(const key_set_t *self, const uint8_t *data, size_t len, uint64_t h, int *found) {
    size_t i = (size_t)h & self->mask;
    for (;;) {
        const ks_slot_t *slot = &self->slots[i];
        if (slot->key == NULL) {
            *found = 0;
            return i;
        }
        if (slot->hash == h && (size_t)PyBytes_GET_SIZE(slot->key) == len &&
            memcmp(PyBytes_AS_STRING(slot->key), data, len) == 0) {
            *found = 1;
            return i;
        }
        i = (i + 1) & self->mask;
    }
}

static int ks_resize(key_set_t *self, size_t positions) {
    ks_slot_t *slots = PyMem_Calloc(positions, sizeof *slots);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ks_slot_t *old = self->slots;
    size_t old_positions = old ? self->mask + 1 : 0;
    self->slots = slots;
    self->mask = positions - 1;
    for (size_t i = 0; i < old_positions; i++) {
        if (old[i].key == NULL)
            continue;
        size_t j = (size_t)old[i].hash & self->mask;
        while (slots[j].key != NULL)
            j = (j + 1) & self->mask;
        slots[j] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* The key's bytes, or -1 with TypeError for anything but bytes (the index keys by bytes only). */
static int ks_key_bytes(PyObject *key, const uint8_t **data, size_t *len) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "KeySet keys are bytes, not %.80s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *data = (const uint8_t *)PyBytes_AS_STRING(key);
    *len = (size_t)PyBytes_GET_SIZE(key);
    return 0;
}

static PyObject *ks_add(key_set_t *self, PyObject *key) {
    const uint8_t *data;
    size_t len;
    if (ks_key_bytes(key, &data, &len) < 0)
        return NULL;
    if ((size_t)(self->count + 1) * 4 > (self->mask + 1) * 3 && ks_resize(self, (self->mask + 1) * 2) < 0)
        return NULL;   /* kept at most three quarters full: probes stay short */
    uint64_t h = ks_hash(data, len);
    int found;
    size_t i = ks_find(self, data, len, h, &found);
    if (!found) {
        Py_INCREF(key);
        self->slots[i].hash = h;
        self->slots[i].key = key;
        self->count++;
    }
    Py_RETURN_NONE;
}

static PyObject *ks_discard(key_set_t *self, PyObject *key) {
    const uint8_t *data;
    size_t len;
    if (ks_key_bytes(key, &data, &len) < 0)
        return NULL;
    int found;
    size_t i = ks_find(self, data, len, ks_hash(data, len), &found);
    if (!found)
        Py_RETURN_NONE;
    PyObject *gone = self->slots[i].key;
    /* Backward shift: move each later key of the run back into the hole when the hole lies on its
     * probe path (between its home and where it sits), until an empty position ends the run. */
    size_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & self->mask;
        if (self->slots[j].key == NULL)
            break;
        size_t home = (size_t)self->slots[j].hash & self->mask;
        if (((j - home) & self->mask) >= ((j - hole) & self->mask)) {
            self->slots[hole] = self->slots[j];
            hole = j;
        }
    }
    self->slots[hole].key = NULL;
    self->count--;
    Py_DECREF(gone);
    Py_RETURN_NONE;
}

static int ks_contains(key_set_t *self, PyObject *key) {
    if (!PyBytes_Check(key))
        return 0;
    int found;
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(key);
    size_t len = (size_t)PyBytes_GET_SIZE(key);
    ks_find(self, data, len, ks_hash(data, len), &found);
    return found;
}

static Py_ssize_t ks_len(key_set_t *self) {
    return self->count;
}

/* leading(keys, key_bytes=0, start=0): how many keys from `start` on are in the set before the first
 * that is not. `keys`: a bytes-like buffer of keys of key_bytes each, back to back, or (key_bytes 0) a
 * sequence of bytes. */
static PyObject *ks_leading(key_set_t *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"keys", "key_bytes", "start", NULL};
    PyObject *keys;
    Py_ssize_t key_bytes = 0, start = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|nn", names, &keys, &key_bytes, &start))
        return NULL;
    if (key_bytes < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "leading: key_bytes and start are not negative");
        return NULL;
    }
    Py_ssize_t run = 0;
    int found = 1;
    if (key_bytes) {
        Py_buffer view;
        if (PyObject_GetBuffer(keys, &view, PyBUF_SIMPLE) < 0)
            return NULL;
        if (view.len % key_bytes) {
            PyBuffer_Release(&view);
            return PyErr_Format(PyExc_ValueError, "leading: %zd bytes are not keys of %zd bytes", view.len,
                                key_bytes);
        }
        const uint8_t *data = view.buf;
        for (Py_ssize_t at = start * key_bytes; found && at < view.len; at += key_bytes) {
            ks_find(self, data + at, (size_t)key_bytes, ks_hash(data + at, (size_t)key_bytes), &found);
            run += found;
        }
        PyBuffer_Release(&view);
    } else {
        PyObject *seq = PySequence_Fast(keys, "leading: keys are a buffer (with key_bytes) or a sequence of bytes");
        if (seq == NULL)
            return NULL;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t at = start; found && at < count; at++) {
            found = ks_contains(self, PySequence_Fast_GET_ITEM(seq, at));
            run += found;
        }
        Py_DECREF(seq);
    }
    return PyLong_FromSsize_t(run);
}

static PyObject *ks_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    key_set_t *self = (key_set_t *)type->tp_alloc(type, 0);
    if (self != NULL && ks_resize(self, KS_CAPACITY_MIN) < 0)
        Py_CLEAR(self);
    return (PyObject *)self;
}

static int ks_init(key_set_t *self, PyObject *args, PyObject *kwargs) {
    PyObject *keys = NULL;
    if (!PyArg_ParseTuple(args, "|O", &keys))
        return -1;
    if (keys == NULL)
        return 0;
    PyObject *iterator = PyObject_GetIter(keys);
    if (iterator == NULL)
        return -1;
    PyObject *key;
    while ((key = PyIter_Next(iterator)) != NULL) {
        PyObject *done = ks_add(self, key);
        Py_DECREF(key);
        if (done == NULL) {
            Py_DECREF(iterator);
            return -1;
        }
        Py_DECREF(done);
    }
    Py_DECREF(iterator);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *ks_iter(key_set_t *self) {
    /* A list of the keys, iterated: the set may change while its keys are walked. */
    PyObject *keys = PyList_New(self->count);
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = 0;
    for (size_t i = 0; self->slots && i <= self->mask; i++) {
        if (self->slots[i].key != NULL) {
            Py_INCREF(self->slots[i].key);
            PyList_SET_ITEM(keys, n++, self->slots[i].key);
        }
    }
    PyObject *iterator = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return iterator;
}

static void ks_dealloc(key_set_t *self) {
    for (size_t i = 0; self->slots && i <= self->mask; i++)
        Py_XDECREF(self->slots[i].key);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef ks_methods[] = {
    {"add", (PyCFunction)ks_add, METH_O, "add(key: bytes)"},
    {"discard", (PyCFunction)ks_discard, METH_O, "discard(key: bytes): remove it where present"},
    {"leading", (PyCFunction)(void (*)(void))ks_leading, METH_VARARGS | METH_KEYWORDS,
     "leading(keys, key_bytes=0, start=0) -> int: keys from start on in the set before the first that is not"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ks_sequence = {
    .sq_length = (lenfunc)ks_len,
    .sq_contains = (objobjproc)ks_contains,
};

static PyTypeObject KeySetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore_native.KeySet",
    .tp_basicsize = sizeof(key_set_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeySet(keys=()): a set of bytes keys; leading() counts a chain's leading run in one call.",
    .tp_new = ks_new,
    .tp_init = (initproc)ks_init,
    .tp_dealloc = (destructor)ks_dealloc,
    .tp_iter = (getiterfunc)ks_iter,
    .tp_methods = ks_methods,
    .tp_as_sequence = &ks_sequence,
};

int key_set_register(PyObject *module) {
    return PyModule_AddType(module, &KeySetType);   /* ready, added under its tp_name's last part */
}
