/* kvstore_native: the hot loops of kvstore's client and server, for CPython.
 *
 *   prefix_hashes(tokens, page_tokens, prior) -> list[str]   the SHA-256 prefix chain, as hex
 *   copy_hash(dst, segments) -> int                          copy a page into place and xxh3 it
 *   copy_hash_pages(base, pages) -> list[int]                the same for many pages, one call
 *   xxh3_64(buffer) -> int                                   XXH3_64bits of a buffer
 *
 * Addresses are plain integers, as the SDK's segments already are (buffers.py); the caller keeps
 * the memory alive. Long loops run without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "copy_hash.h"
#include "prefix_hash.h"

enum { SEGMENTS_ON_STACK = 16 };

/* The element size and signedness of a buffer of integers, from its struct format. */
static int integer_format(const Py_buffer *view, int *is_signed) {
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (f[0] == '\0' || f[1] != '\0')
        return 0;
    *is_signed = (*f == 'i' || *f == 'l' || *f == 'q');
    if ((*f == 'i' || *f == 'I') && view->itemsize == 4)
        return 4;
    if ((*f == 'l' || *f == 'L' || *f == 'q' || *f == 'Q') && view->itemsize == 8)
        return 8;
    if ((*f == 'l' || *f == 'L') && view->itemsize == 4)
        return 4;
    return 0;
}

static PyObject *py_prefix_hashes(PyObject *self, PyObject *args) {
    PyObject *array;
    Py_buffer tokens, prior;
    Py_ssize_t page_tokens;
    if (!PyArg_ParseTuple(args, "Ony*", &array, &page_tokens, &prior))
        return NULL;
    if (PyObject_GetBuffer(array, &tokens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&prior);
        return NULL;
    }
    PyObject *keys = NULL;
    uint8_t (*digests)[32] = NULL;
    int is_signed = 0;
    int itemsize = integer_format(&tokens, &is_signed);
    if (!itemsize) {
        PyErr_Format(PyExc_TypeError, "tokens must be a contiguous buffer of 32- or 64-bit integers, not format %s",
                     tokens.format ? tokens.format : "B");
        goto done;
    }
    if (page_tokens <= 0) {
        PyErr_Format(PyExc_ValueError, "page_tokens must be positive, got %zd", page_tokens);
        goto done;
    }
    size_t count = (size_t)(tokens.len / itemsize);
    size_t pages = count / (size_t)page_tokens;
    digests = malloc(pages ? pages * 32 : 1);
    if (!digests) {
        PyErr_NoMemory();
        goto done;
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = prefix_hash_chain(tokens.buf, count, itemsize, is_signed, (size_t)page_tokens,
                               prior.buf, (size_t)prior.len, digests);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_SetString(PyExc_ValueError, "token ids must fit in uint32");
        goto done;
    }
    keys = PyList_New((Py_ssize_t)pages);
    if (!keys)
        goto done;
    for (size_t p = 0; p < pages; p++) {
        PyObject *key = PyUnicode_New(64, 127);
        if (!key) {
            Py_CLEAR(keys);
            goto done;
        }
        to_hex(digests[p], (char *)PyUnicode_DATA(key));
        PyList_SET_ITEM(keys, (Py_ssize_t)p, key);
    }
done:
    free(digests);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&prior);
    return keys;
}

/* Segments of one page from a list of (address, nbytes) pairs; *total gets their sum. */
static segment_t *parse_segments(PyObject *list, segment_t *on_stack, size_t *count, size_t *total) {
    PyObject *seq = PySequence_Fast(list, "segments must be a list of (address, nbytes) pairs");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    segment_t *segments = n <= SEGMENTS_ON_STACK ? on_stack : malloc((size_t)n * sizeof(segment_t));
    if (!segments) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    *total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long address;
        Py_ssize_t nbytes;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "Kn", &address, &nbytes) || nbytes < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a segment's nbytes is negative");
            if (segments != on_stack)
                free(segments);
            Py_DECREF(seq);
            return NULL;
        }
        segments[i].src = (const uint8_t *)(uintptr_t)address;
        segments[i].nbytes = (size_t)nbytes;
        *total += (size_t)nbytes;
    }
    Py_DECREF(seq);
    *count = (size_t)n;
    return segments;
}

static PyObject *py_copy_hash(PyObject *self, PyObject *args) {
    unsigned long long dst;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "KO", &dst, &list))
        return NULL;
    segment_t on_stack[SEGMENTS_ON_STACK];
    size_t count, total;
    segment_t *segments = parse_segments(list, on_stack, &count, &total);
    if (!segments)
        return NULL;
    uint64_t sum;
    Py_BEGIN_ALLOW_THREADS
    sum = copy_hash((uint8_t *)(uintptr_t)dst, segments, count);
    Py_END_ALLOW_THREADS
    if (segments != on_stack)
        free(segments);
    return PyLong_FromUnsignedLongLong(sum);
}

/* pages: a list of (offset, segments); each page is copied to base + offset. */
static PyObject *py_copy_hash_pages(PyObject *self, PyObject *args) {
    unsigned long long base;
    PyObject *pages;
    if (!PyArg_ParseTuple(args, "KO", &base, &pages))
        return NULL;
    PyObject *seq = PySequence_Fast(pages, "pages must be a list of (offset, segments)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *sums = PyList_New(n);
    for (Py_ssize_t i = 0; sums && i < n; i++) {
        unsigned long long offset;
        PyObject *list;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KO", &offset, &list)) {
            Py_CLEAR(sums);
            break;
        }
        segment_t on_stack[SEGMENTS_ON_STACK];
        size_t count, total;
        segment_t *segments = parse_segments(list, on_stack, &count, &total);
        if (!segments) {
            Py_CLEAR(sums);
            break;
        }
        uint64_t sum;
        if (total >= (64u << 10)) {
            Py_BEGIN_ALLOW_THREADS
            sum = copy_hash((uint8_t *)(uintptr_t)(base + offset), segments, count);
            Py_END_ALLOW_THREADS
        } else {   /* a small page: dropping the GIL would cost more than the copy */
            sum = copy_hash((uint8_t *)(uintptr_t)(base + offset), segments, count);
        }
        if (segments != on_stack)
            free(segments);
        PyObject *value = PyLong_FromUnsignedLongLong(sum);
        if (!value) {
            Py_CLEAR(sums);
            break;
        }
        PyList_SET_ITEM(sums, i, value);
    }
    Py_DECREF(seq);
    return sums;
}

static PyObject *py_xxh3_64(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    uint64_t sum;
    Py_BEGIN_ALLOW_THREADS
    sum = hash_bytes(data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(sum);
}

static PyMethodDef methods[] = {
    {"prefix_hashes", py_prefix_hashes, METH_VARARGS,
     "prefix_hashes(tokens, page_tokens, prior) -> list[str]: hex SHA-256 chain of every full page"},
    {"copy_hash", py_copy_hash, METH_VARARGS,
     "copy_hash(dst, segments) -> int: copy (address, nbytes) segments to dst; XXH3_64bits of the bytes"},
    {"copy_hash_pages", py_copy_hash_pages, METH_VARARGS,
     "copy_hash_pages(base, pages) -> list[int]: copy_hash of each (offset, segments) to base + offset"},
    {"xxh3_64", py_xxh3_64, METH_VARARGS, "xxh3_64(buffer) -> int: XXH3_64bits of the buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvstore_native(void) {
    return PyModule_Create(&module);
}
