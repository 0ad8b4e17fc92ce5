/* kvstore_native: the hot loops of kvstore's client and server, for CPython.
 *
 *   prefix_hashes(tokens, page_tokens, prior[, kernel]) -> list[str]   the SHA-256 prefix chain, as hex
 *   prefix_hashes_packed(tokens, page_tokens, prior[, kernel]) -> bytes the same keys, 64 ASCII bytes
 *                                                            each, back to back (kernel: tests)
 *   encode_keys(keys, key_bytes_max) -> list[bytes] | None   str or bytes keys as bytes, their lengths checked
 *   pack_keys(keys, key_bytes_max) -> (bytes, int) | None    str or bytes keys of one length, back to back
 *   hex_digests(packed) -> bytes | None                      packed hex keys (64 digits each) as their 32 bytes
 *   copy_hash(dst, segments) -> int                          copy a page into place and xxh3 it
 *   copy_hash_pages(base, pages) -> list[int]                the same for many pages, one call
 *   copy_hash_into(base, offsets, pages) -> list[int]        the same, offsets and segments apart
 *   copy_out(base, offsets, pages) -> None                   copy slots out into pages' segments
 *   copy_out_hashed(base, offsets, pages) -> list[int]       the same, and the xxh3 of each copy
 *   xxh3_64(buffer) -> int                                   XXH3_64bits of a buffer
 *   key_hashes(keys) -> bytes                                BLAKE2b-64 of each bytes key, 8 bytes each (placement)
 *   xxh3_64_kernel(buffer, kernel, cuts) -> int              the same by a named kernel, maybe streamed (tests)
 *   copy_kernel(name) -> str                                 the copies kept to a kernel no wider (tests)
 *   CopyHasher                                               xxh3 of a page copied into place piece by piece
 *   PageIndex, IndexRecord                                   the page index (page_index.c)
 *
 * Addresses are plain integers, as the SDK's segments already are (buffers.py); the caller keeps
 * the memory alive. Long loops run without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "copy_hash.h"
#include "copy_hasher.h"
#include "key_set.h"
#include "page_index.h"
#include "placement_hash.h"
#include "prefix_hash.h"
#include "xxh3.h"

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

/* The chain's keys as a list of str, or (packed) as one bytes object of 64 hex digits a key. */
static PyObject *prefix_chain(PyObject *args, int packed) {
    PyObject *array;
    Py_buffer tokens, prior;
    Py_ssize_t page_tokens;
    const char *kernel_name = "auto";
    if (!PyArg_ParseTuple(args, "Ony*|s", &array, &page_tokens, &prior, &kernel_name))
        return NULL;
    int kernel = prefix_hash_kernel(kernel_name);
    if (kernel < 0) {
        PyErr_Format(PyExc_ValueError, "kernel %s is not one this CPU runs (auto, libcrypto, or sha_ni where the "
                     "CPU has the SHA extensions)", kernel_name);
        PyBuffer_Release(&prior);
        return NULL;
    }
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
                               prior.buf, (size_t)prior.len, kernel, digests);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_SetString(PyExc_ValueError, "token ids must be 0 to 2**63-1 (int64's maximum, the widest SGLang hashes)");
        goto done;
    }
    if (packed) {
        keys = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(pages * 64));
        if (!keys)
            goto done;
        for (size_t p = 0; p < pages; p++)
            to_hex(digests[p], PyBytes_AS_STRING(keys) + p * 64);
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

static PyObject *py_prefix_hashes(PyObject *self, PyObject *args) {
    return prefix_chain(args, 0);
}

static PyObject *py_prefix_hashes_packed(PyObject *self, PyObject *args) {
    return prefix_chain(args, 1);
}

/* The bytes of one key if it is ASCII str or bytes (the kind of the first key), else NULL. */
static const char *key_data(PyObject *key, int is_str, Py_ssize_t *len) {
    if (is_str) {
        if (!PyUnicode_CheckExact(key) || PyUnicode_READY(key) < 0 || !PyUnicode_IS_ASCII(key)) {
            PyErr_Clear();   /* a string that cannot be read as ASCII is left to the Python path */
            return NULL;
        }
        *len = PyUnicode_GET_LENGTH(key);
        return (const char *)PyUnicode_DATA(key);
    }
    if (!PyBytes_CheckExact(key))
        return NULL;
    *len = PyBytes_GET_SIZE(key);
    return PyBytes_AS_STRING(key);
}

/* (keys, key_bytes_max): 1 with the items of a list or tuple of keys; 0 for any other object, which
 * the SDK's Python path then takes; -1 with an exception set when the arguments do not parse. */
static int key_list_args(PyObject *args, PyObject ***items, Py_ssize_t *n, Py_ssize_t *key_bytes_max) {
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "On", &keys, key_bytes_max))
        return -1;
    if (!PyList_CheckExact(keys) && !PyTuple_CheckExact(keys))
        return 0;
    *n = PySequence_Fast_GET_SIZE(keys);
    *items = PySequence_Fast_ITEMS(keys);
    return 1;
}

/* The keys as a list of bytes (an ASCII str encoded, a bytes key itself), every one 1 to
 * key_bytes_max bytes; None for any other list, which the SDK's Python path then encodes or refuses
 * naming the key (it accepts what this accepts, and more: non-ASCII str, bytearray, memoryview). */
static PyObject *py_encode_keys(PyObject *self, PyObject *args) {
    PyObject **items;
    Py_ssize_t n, key_bytes_max;
    int listed = key_list_args(args, &items, &n, &key_bytes_max);
    if (listed <= 0)
        return listed < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *encoded = PyList_New(n);
    if (!encoded)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {   /* checked as it is encoded: one pass, as pack_keys */
        PyObject *key = items[i];
        int is_str = PyUnicode_CheckExact(key);
        Py_ssize_t len;
        const char *data = key_data(key, is_str, &len);
        if (!data || len <= 0 || len > key_bytes_max) {
            Py_DECREF(encoded);   /* the slots not yet filled are NULL, which the list's release skips */
            Py_RETURN_NONE;
        }
        key = is_str ? PyBytes_FromStringAndSize(data, len) : Py_NewRef(key);
        if (!key) {
            Py_DECREF(encoded);
            return NULL;
        }
        PyList_SET_ITEM(encoded, i, key);
    }
    return encoded;
}

/* Keys of one length, 1 to key_bytes_max, all ASCII str or all bytes, back to back; None for any
 * other list (the SDK's Python path then decides, so both paths pack exactly the same lists). */
static PyObject *py_pack_keys(PyObject *self, PyObject *args) {
    PyObject **items;
    Py_ssize_t n, key_bytes_max;
    int listed = key_list_args(args, &items, &n, &key_bytes_max);
    if (listed <= 0)
        return listed < 0 ? NULL : Py_NewRef(Py_None);
    if (n == 0)
        Py_RETURN_NONE;
    int is_str = PyUnicode_CheckExact(items[0]);
    Py_ssize_t key_bytes;
    if (!key_data(items[0], is_str, &key_bytes) || key_bytes <= 0 || key_bytes > key_bytes_max)
        Py_RETURN_NONE;
    PyObject *packed = PyBytes_FromStringAndSize(NULL, n * key_bytes);
    if (!packed)
        return NULL;
    char *out = PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < n; i++) {   /* checked as it is copied: one pass over the keys, not two */
        Py_ssize_t len;
        const char *data = key_data(items[i], is_str, &len);
        if (!data || len != key_bytes) {
            Py_DECREF(packed);
            Py_RETURN_NONE;
        }
        memcpy(out + i * key_bytes, data, (size_t)key_bytes);
    }
    return Py_BuildValue("(Nn)", packed, key_bytes);
}

/* A Reserve's (or Acquire's, Delete's) keys as a list of bytes when every one is a bytes of 1 to
 * key_bytes_max bytes and none repeats; None otherwise, and the node's Python check then names the key at
 * fault. One pass with Python's own hash of each key (PyObject_Hash), which the bytes object caches for the
 * dicts and sets the node puts the keys in next; a table of positions finds a repeat. */
static PyObject *py_distinct_keys(PyObject *self, PyObject *args) {
    PyObject *given;
    Py_ssize_t key_bytes_max;
    if (!PyArg_ParseTuple(args, "On", &given, &key_bytes_max))
        return NULL;
    PyObject *keys = PySequence_List(given);
    if (!keys)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    size_t capacity = 16;
    while (capacity < 2 * (size_t)n)
        capacity <<= 1;
    Py_ssize_t *table = PyMem_Calloc(capacity, sizeof *table);   /* position + 1 of the key there; 0: empty */
    Py_hash_t *hashes = PyMem_Malloc((n ? (size_t)n : 1) * sizeof *hashes);
    PyObject *result = NULL;
    if (!table || !hashes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) <= 0 || PyBytes_GET_SIZE(key) > key_bytes_max) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        Py_hash_t hash = PyObject_Hash(key);
        if (hash == -1)
            goto done;
        hashes[i] = hash;
        size_t at = (size_t)hash & (capacity - 1);
        for (; table[at]; at = (at + 1) & (capacity - 1)) {
            Py_ssize_t j = table[at] - 1;
            PyObject *other = PyList_GET_ITEM(keys, j);
            if (hashes[j] == hash && PyBytes_GET_SIZE(other) == PyBytes_GET_SIZE(key)
                && memcmp(PyBytes_AS_STRING(other), PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key)) == 0) {
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
        table[at] = i + 1;
    }
    result = Py_NewRef(keys);
done:
    PyMem_Free(table);
    PyMem_Free(hashes);
    Py_DECREF(keys);
    return result;
}

/* Every key of a list of bytes put in a dict with one value when none of them is in it yet: True. Else the
 * dict is left as it was: False. A Reserve's claim of keys in flight in one pass, where isdisjoint and
 * update(dict.fromkeys(...)) took two and built a dict to throw away (50 us for 512 keys). Keys are bytes, so
 * no Python code runs while the dict changes. */
static PyObject *py_claim_keys(PyObject *self, PyObject *args) {
    PyObject *dict, *keys, *value;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyDict_Type, &dict, &PyList_Type, &keys, &value))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(PyList_GET_ITEM(keys, i))) {
            PyErr_SetString(PyExc_TypeError, "claim_keys takes a list of bytes keys");
            return NULL;
        }
    Py_ssize_t added = 0;
    int present = 0;
    for (; added < n; added++) {
        PyObject *key = PyList_GET_ITEM(keys, added);
        present = PyDict_Contains(dict, key);
        if (present != 0 || PyDict_SetItem(dict, key, value) < 0)
            break;
    }
    if (added == n)
        Py_RETURN_TRUE;
    PyObject *type, *error, *trace;
    PyErr_Fetch(&type, &error, &trace);   /* a failure to add is raised once the keys added are taken out */
    for (Py_ssize_t j = 0; j < added; j++)
        if (PyDict_DelItem(dict, PyList_GET_ITEM(keys, j)) < 0)
            PyErr_Clear();
    PyErr_Restore(type, error, trace);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_FALSE;
}

/* Each key of a list taken out of a dict (KeyError for one not in it, the keys before it taken out): a
 * Commit's keys claimed no more, in one call. */
static PyObject *py_unclaim_keys(PyObject *self, PyObject *args) {
    PyObject *dict, *keys;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &dict, &keys))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "unclaim_keys takes a sequence of keys");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "unclaim_keys takes bytes keys");
            Py_DECREF(seq);
            return NULL;
        }
        if (PyDict_DelItem(dict, key) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* spin_until_readable(fd, spin_s) -> bool: poll the socket for input without waiting, yielding the CPU between
 * polls, until it is readable (True) or spin_s has passed (False); an error on it counts as readable, for the
 * read that follows to raise. All of it without the GIL: a connection thread waiting for its client's next
 * frame this way holds up no other thread's Python, where a loop in Python took the GIL back between polls. */
static PyObject *py_spin_until_readable(PyObject *self, PyObject *args) {
    int fd;
    double spin_s;
    if (!PyArg_ParseTuple(args, "id", &fd, &spin_s))
        return NULL;
    int readable = 0;
    Py_BEGIN_ALLOW_THREADS
    struct pollfd wanted = {.fd = fd, .events = POLLIN};
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double deadline = (double)now.tv_sec + (double)now.tv_nsec / 1e9 + spin_s;
    for (;;) {
        if (poll(&wanted, 1, 0) != 0) {
            readable = 1;
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((double)now.tv_sec + (double)now.tv_nsec / 1e9 >= deadline)
            break;
        sched_yield();
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(readable);
}

/* Packed keys of 64 lowercase hex digits each as the 32 bytes each spells, back to back: a Lookup's keys in
 * half the bytes (LookupRequest.hex_digests). None when the length is not a multiple of 64 or any key is not
 * such digits (uppercase ones are other keys), as keys.hex_digests_python. */
static PyObject *py_hex_digests(PyObject *self, PyObject *arg) {
    Py_buffer in;
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    if (in.len % 64) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    if (!(out = PyBytes_FromStringAndSize(NULL, in.len / 2)))
        goto done;
    const uint8_t *keys = in.buf;
    uint8_t *digests = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < in.len / 64; i++)
        if (!hex64_decode(keys + 64 * i, digests + 32 * i)) {
            Py_SETREF(out, Py_NewRef(Py_None));
            break;
        }
done:
    PyBuffer_Release(&in);
    return out;
}

/* Segments of one page from a list of (address, nbytes) pairs; *total gets their sum. The list is read
 * through a tuple of our own: a number's __index__ may run Python code that changes the list. */
static segment_t *parse_segments(PyObject *list, segment_t *on_stack, size_t *count, size_t *total) {
    if (!PyList_Check(list) && !PyTuple_Check(list)) {
        PyErr_Format(PyExc_TypeError, "segments must be a list of (address, nbytes) pairs, not %.100s",
                     Py_TYPE(list)->tp_name);
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(list);
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
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(pair))
            PyErr_Format(PyExc_TypeError, "a segment is an (address, nbytes) tuple, not %.100s",
                         Py_TYPE(pair)->tp_name);
        if (PyErr_Occurred() || !PyArg_ParseTuple(pair, "Kn", &address, &nbytes) || nbytes < 0) {
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
    Py_XSETREF(seq, seq ? PySequence_Tuple(seq) : NULL);   /* our own: an offset's __index__ may change the list */
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *sums = PyList_New(n);
    for (Py_ssize_t i = 0; sums && i < n; i++) {
        unsigned long long offset;
        PyObject *list;
        PyObject *page = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(page)) {
            PyErr_Format(PyExc_TypeError, "a page is an (offset, segments) tuple, not %.100s", Py_TYPE(page)->tp_name);
            Py_CLEAR(sums);
            break;
        }
        if (!PyArg_ParseTuple(page, "KO", &offset, &list)) {
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

/* A batch of pages parsed up front, so that the copies run in one stretch without the GIL:
 * page i is the arena slot base + offsets[i] and segments [first[i], first[i + 1]). */
typedef struct {
    size_t pages;
    uint8_t **slots;
    size_t *first;
    segment_t *segments;
    size_t total;
} batch_t;

static void batch_free(batch_t *b) {
    free(b->slots);
    free(b->first);
    free(b->segments);
}

/* One (address, nbytes) pair; 0 and an exception if it is not one. */
static int parse_pair(PyObject *pair, segment_t *segment) {
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "a segment is an (address, nbytes) tuple");
        return 0;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 0));
    if (address == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    Py_ssize_t nbytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
    if (nbytes == -1 && PyErr_Occurred())
        return 0;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "a segment's nbytes is negative");
        return 0;
    }
    segment->src = (const uint8_t *)(uintptr_t)address;
    segment->nbytes = (size_t)nbytes;
    return 1;
}

/* offsets: a sequence of arena offsets; pages: as many lists of (address, nbytes) segments. The lists are
 * read in place: PyLong_AsUnsignedLongLong and PyLong_AsSsize_t take ints only (no __index__), so no
 * Python code runs while they are read. */
static int parse_batch(unsigned long long base, PyObject *offsets, PyObject *pages, batch_t *b) {
    memset(b, 0, sizeof(*b));
    int ok = 0;
    size_t capacity = 0;
    PyObject *offset_seq = PySequence_Fast(offsets, "offsets must be a sequence of ints");
    PyObject *page_seq = offset_seq ? PySequence_Fast(pages, "pages must be a sequence of segment lists") : NULL;
    if (!page_seq)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(page_seq);
    if (PySequence_Fast_GET_SIZE(offset_seq) != n) {
        PyErr_Format(PyExc_ValueError, "%zd offsets for %zd pages", PySequence_Fast_GET_SIZE(offset_seq), n);
        goto done;
    }
    b->pages = (size_t)n;
    capacity = (size_t)n + 1;
    b->slots = malloc(capacity * sizeof(*b->slots));
    b->first = malloc(capacity * sizeof(*b->first));
    b->segments = malloc(capacity * sizeof(*b->segments));
    if (!b->slots || !b->first || !b->segments) {
        PyErr_NoMemory();
        goto done;
    }
    size_t used = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long offset = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(offset_seq, i));
        if (offset == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        b->slots[i] = (uint8_t *)(uintptr_t)(base + offset);
        b->first[i] = used;
        PyObject *list = PySequence_Fast_GET_ITEM(page_seq, i);
        if (!PyList_Check(list) && !PyTuple_Check(list)) {
            PyErr_SetString(PyExc_TypeError, "each page is a list of (address, nbytes) segments");
            goto done;
        }
        PyObject *seg_seq = PySequence_Fast(list, "each page is a list of (address, nbytes) segments");
        if (!seg_seq)
            goto done;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(seg_seq);
        if (used + (size_t)count > capacity) {
            capacity = (used + (size_t)count) * 2;
            segment_t *grown = realloc(b->segments, capacity * sizeof(*b->segments));
            if (!grown) {
                Py_DECREF(seg_seq);
                PyErr_NoMemory();
                goto done;
            }
            b->segments = grown;
        }
        for (Py_ssize_t s = 0; s < count; s++) {
            if (!parse_pair(PySequence_Fast_GET_ITEM(seg_seq, s), &b->segments[used])) {
                Py_DECREF(seg_seq);
                goto done;
            }
            b->total += b->segments[used++].nbytes;
        }
        Py_DECREF(seg_seq);
    }
    b->first[n] = used;
    ok = 1;
done:
    Py_XDECREF(offset_seq);
    Py_XDECREF(page_seq);
    if (!ok)
        batch_free(b);
    return ok;
}

/* Below this many bytes in a batch, dropping and taking back the GIL costs more than the copy. */
enum { UNLOCKED_BYTES_MIN = 64 << 10 };

/* Lines of a page asked for ahead of its copy. A small page is one TLB miss and a few cold lines
 * that the hardware prefetcher, which stops at 4 KiB boundaries, does not fetch ahead; asking for
 * the next page's lines while this one is copied keeps several misses in flight. */
enum { PREFETCH_BYTES = 4 << 10 };

/* A put's next page: its first segment's first lines (its slot is written with streaming stores,
 * which need nothing read ahead). */
static void prefetch_source(const batch_t *b, size_t i) {
    if (b->first[i + 1] == b->first[i])
        return;
    const segment_t *first = &b->segments[b->first[i]];
    size_t nbytes = first->nbytes < PREFETCH_BYTES ? first->nbytes : PREFETCH_BYTES;
    for (size_t done = 0; done < nbytes; done += 64)
        __builtin_prefetch(first->src + done, 0, 3);
}

/* A batch's copy runs without the GIL for up to milliseconds (a put's group of 32 MiB) on a core that other
 * threads, of this process or another, may be woken on. Where the kernel lets a woken thread run only at the
 * running one's next tick (a virtual machine here: a get waited 1.9-3.4 ms beside a process that only computed,
 * even one at nice 19 or SCHED_IDLE, 0.2 ms beside one that yielded), every YIELD_BYTES the copy lets a thread
 * that is ready run first; with none ready, a yield returns at once. A reader whose client shared its core with
 * a writer putting 64 KiB pages (bench/hot_path.py's write-down row): loaded p99 1.37-1.51 ms in three runs
 * before, 0.99-1.06 in three after; puts and gets of 64 KiB to 4 MiB moved as fast as before. */
enum { YIELD_BYTES = 1 << 20 };

static void yield_every(size_t *copied, size_t nbytes) {
    *copied += nbytes;
    if (*copied >= YIELD_BYTES) {
        *copied = 0;
        sched_yield();
    }
}

static size_t page_bytes(const batch_t *b, size_t i) {
    size_t nbytes = 0;
    for (size_t s = b->first[i]; s < b->first[i + 1]; s++)
        nbytes += b->segments[s].nbytes;
    return nbytes;
}

static void copy_hash_batch(const batch_t *b, uint64_t *sums) {
    size_t copied = 0;
    for (size_t i = 0; i < b->pages; i++) {
        if (i + 1 < b->pages)
            prefetch_source(b, i + 1);
        sums[i] = copy_hash_unfenced(b->slots[i], b->segments + b->first[i], b->first[i + 1] - b->first[i]);
        yield_every(&copied, page_bytes(b, i));
    }
    copy_fence();
}

static void prefetch_page(const batch_t *b, size_t i) {
    if (b->first[i + 1] == b->first[i])
        return;
    const uint8_t *src = b->slots[i];
    const uint8_t *dst = b->segments[b->first[i]].src;
    size_t nbytes = b->segments[b->first[i]].nbytes;
    if (nbytes > PREFETCH_BYTES)
        nbytes = PREFETCH_BYTES;
    for (size_t done = 0; done < nbytes; done += 64) {
        __builtin_prefetch(src + done, 0, 0);
        __builtin_prefetch(dst + done, 1, 0);
    }
}

static void copy_out_hash_batch(const batch_t *b, uint64_t *sums) {
    size_t copied = 0;
    for (size_t i = 0; i < b->pages; i++) {
        if (i + 1 < b->pages)
            prefetch_page(b, i + 1);
        sums[i] = copy_out_hash_unfenced(b->slots[i], b->segments + b->first[i], b->first[i + 1] - b->first[i]);
        yield_every(&copied, page_bytes(b, i));
    }
    copy_fence();
}

static void copy_out_batch(const batch_t *b) {
    size_t copied = 0;
    for (size_t i = 0; i < b->pages; i++) {
        if (i + 1 < b->pages)
            prefetch_page(b, i + 1);
        const uint8_t *src = b->slots[i];
        for (size_t s = b->first[i]; s < b->first[i + 1]; s++) {
            memcpy((void *)(uintptr_t)b->segments[s].src, src, b->segments[s].nbytes);
            src += b->segments[s].nbytes;
        }
        yield_every(&copied, page_bytes(b, i));
    }
}

/* The batch named by a call's (base, offsets, pages) arguments. */
static int batch_from_args(PyObject *args, batch_t *b) {
    unsigned long long base;
    PyObject *offsets, *pages;
    if (!PyArg_ParseTuple(args, "KOO", &base, &offsets, &pages))
        return 0;
    return parse_batch(base, offsets, pages, b);
}

/* `run` over a batch, without the GIL where it moves enough bytes to be worth handing the GIL over. */
static void run_batch(const batch_t *b, void (*run)(const batch_t *, uint64_t *), uint64_t *sums) {
    if (b->total >= UNLOCKED_BYTES_MIN) {
        Py_BEGIN_ALLOW_THREADS
        run(b, sums);
        Py_END_ALLOW_THREADS
    } else {
        run(b, sums);
    }
}

/* (base, offsets, pages) -> list[int]: `run` over the batch, one checksum a page. */
static PyObject *batch_sums(PyObject *args, void (*run)(const batch_t *, uint64_t *)) {
    batch_t b;
    if (!batch_from_args(args, &b))
        return NULL;
    PyObject *result = NULL;
    uint64_t *sums = malloc((b.pages ? b.pages : 1) * sizeof(*sums));
    if (!sums) {
        PyErr_NoMemory();
        goto done;
    }
    run_batch(&b, run, sums);
    result = PyList_New((Py_ssize_t)b.pages);
    for (size_t i = 0; result && i < b.pages; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(sums[i]);
        if (!value) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)i, value);
    }
done:
    free(sums);
    batch_free(&b);
    return result;
}

/* The offsets of a batch: a buffer of uint64s (format "Q": a packed Reserve answer's view), read in place, or a
 * sequence of ints. *values is malloc'ed; 0 with an exception set when they cannot be read. */
static int read_offsets(PyObject *offsets, unsigned long long **values, Py_ssize_t *n) {
    if (PyObject_CheckBuffer(offsets)) {
        Py_buffer view;
        if (PyObject_GetBuffer(offsets, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return 0;
        int ok = view.itemsize == 8 && view.format && strcmp(view.format, "Q") == 0;
        if (!ok)
            PyErr_SetString(PyExc_TypeError, "offsets in a buffer are uint64s (format 'Q')");
        else if ((*values = malloc((view.len ? (size_t)view.len : 1))) == NULL) {
            PyErr_NoMemory();
            ok = 0;
        } else {
            memcpy(*values, view.buf, (size_t)view.len);
            *n = view.len / 8;
        }
        PyBuffer_Release(&view);
        return ok;
    }
    PyObject *seq = PySequence_Fast(offsets, "offsets must be a sequence of ints or a buffer of uint64s");
    if (!seq)
        return 0;
    *n = PySequence_Fast_GET_SIZE(seq);
    *values = malloc((*n ? (size_t)*n : 1) * sizeof **values);
    int ok = *values != NULL;
    if (!ok)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < *n; i++) {
        (*values)[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        ok = !((*values)[i] == (unsigned long long)-1 && PyErr_Occurred());
    }
    Py_DECREF(seq);
    if (!ok) {
        free(*values);
        *values = NULL;
    }
    return ok;
}

/* (base, offsets, rows, page_bytes, count) -> bytes: `run` over `count` pages that lie back to back at `rows`
 * (page i at rows + i * page_bytes: a put's or a get's one buffer, the SDK's PageRows) and the arena slots
 * base + offsets[i], one checksum a page, as native uint64s in one bytes object. No segment tuple and no int a
 * page: making those took 512 pages of 4 KiB about 50 us, on the client's path between two messages. */
static PyObject *rows_sums(PyObject *args, void (*run)(const batch_t *, uint64_t *)) {
    unsigned long long base, rows;
    PyObject *offsets;
    Py_ssize_t page_bytes, count;
    if (!PyArg_ParseTuple(args, "KOKnn", &base, &offsets, &rows, &page_bytes, &count))
        return NULL;
    if (page_bytes <= 0 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "page_bytes is positive and count not negative");
        return NULL;
    }
    unsigned long long *slot_offsets = NULL;
    Py_ssize_t n = 0;
    if (!read_offsets(offsets, &slot_offsets, &n))
        return NULL;
    if (n != count) {
        free(slot_offsets);
        PyErr_Format(PyExc_ValueError, "%zd offsets for %zd pages", n, count);
        return NULL;
    }
    batch_t b = {.pages = (size_t)n, .total = (size_t)n * (size_t)page_bytes};
    b.slots = malloc((n ? (size_t)n : 1) * sizeof *b.slots);
    b.first = malloc(((size_t)n + 1) * sizeof *b.first);
    b.segments = malloc((n ? (size_t)n : 1) * sizeof *b.segments);
    uint64_t *sums = malloc((n ? (size_t)n : 1) * sizeof *sums);
    PyObject *result = NULL;
    if (!b.slots || !b.first || !b.segments || !sums) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        b.slots[i] = (uint8_t *)(uintptr_t)(base + slot_offsets[i]);
        b.first[i] = (size_t)i;
        b.segments[i].src = (const uint8_t *)(uintptr_t)(rows + (unsigned long long)i * (unsigned long long)page_bytes);
        b.segments[i].nbytes = (size_t)page_bytes;
    }
    b.first[n] = (size_t)n;
    run_batch(&b, run, sums);
    result = PyBytes_FromStringAndSize((const char *)sums, n * (Py_ssize_t)sizeof *sums);
done:
    free(slot_offsets);
    free(sums);
    batch_free(&b);
    return result;
}

/* copy_hash_rows(base, offsets, src, page_bytes, count) -> bytes: copy_hash_into of pages back to back at src. */
static PyObject *py_copy_hash_rows(PyObject *self, PyObject *args) {
    return rows_sums(args, copy_hash_batch);
}

/* copy_out_hashed_rows(base, offsets, dst, page_bytes, count) -> bytes: copy_out_hashed into pages back to back
 * at dst. */
static PyObject *py_copy_out_hashed_rows(PyObject *self, PyObject *args) {
    return rows_sums(args, copy_out_hash_batch);
}

static PyObject *py_copy_hash_into(PyObject *self, PyObject *args) {
    return batch_sums(args, copy_hash_batch);
}

static PyObject *py_copy_out_hashed(PyObject *self, PyObject *args) {
    return batch_sums(args, copy_out_hash_batch);
}

/* Pages shared out between two processes copying at once (a client and its node: the SDK's shared page
 * buffers): each claims the next page with an atomic add to one counter in memory both map, and copies it,
 * hashed as copy_hash (into the arena) or copy_out_hash (out of it) hashes it. A caller claims at most n times,
 * whatever the other process does to the counter, so its work stays bounded by the n pages it was given. */
static void copy_claimed_pages(uint64_t *cursor, int out, uint8_t *arena, const unsigned long long *slot_offsets,
                               uint8_t *buffer, const unsigned long long *buffer_offsets, size_t n, size_t nbytes,
                               uint64_t *sums, uint8_t *claimed) {
    size_t copied = 0;
    for (size_t claims = 0; claims < n; claims++) {
        uint64_t i = __atomic_fetch_add(cursor, 1, __ATOMIC_RELAXED);
        if (i >= n)
            break;
        segment_t page = {buffer + buffer_offsets[i], nbytes};
        uint8_t *slot = arena + slot_offsets[i];
        sums[i] = out ? copy_out_hash_unfenced(slot, &page, 1) : copy_hash_unfenced(slot, &page, 1);
        claimed[i] = 1;
        yield_every(&copied, nbytes);
    }
    copy_fence();
}

/* copy_claimed(cursor, out, arena, slot_offsets, buffer, buffer_offsets, page_bytes) -> (sums, claimed). */
static PyObject *py_copy_claimed(PyObject *self, PyObject *args) {
    unsigned long long cursor, arena, buffer;
    int out;
    PyObject *slots_arg, *buffers_arg;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "KpKOKOn", &cursor, &out, &arena, &slots_arg, &buffer, &buffers_arg, &nbytes))
        return NULL;
    if (nbytes <= 0 || cursor % 8) {
        PyErr_SetString(PyExc_ValueError, "page_bytes is positive and the cursor a uint64 on an 8-byte boundary");
        return NULL;
    }
    unsigned long long *slot_offsets = NULL, *buffer_offsets = NULL;
    Py_ssize_t n = 0, m = 0;
    if (!read_offsets(slots_arg, &slot_offsets, &n))
        return NULL;
    PyObject *result = NULL;
    uint64_t *sums = NULL;
    uint8_t *claimed = NULL;
    if (!read_offsets(buffers_arg, &buffer_offsets, &m))
        goto done;
    if (n != m) {
        PyErr_Format(PyExc_ValueError, "%zd slot offsets for %zd buffer offsets", n, m);
        goto done;
    }
    sums = calloc(n ? (size_t)n : 1, sizeof *sums);
    claimed = calloc(n ? (size_t)n : 1, 1);
    if (!sums || !claimed) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_claimed_pages((uint64_t *)(uintptr_t)cursor, out, (uint8_t *)(uintptr_t)arena, slot_offsets,
                       (uint8_t *)(uintptr_t)buffer, buffer_offsets, (size_t)n, (size_t)nbytes, sums, claimed);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(y#y#)", (const char *)sums, n * (Py_ssize_t)sizeof *sums, (const char *)claimed, n);
done:
    free(slot_offsets);
    free(buffer_offsets);
    free(sums);
    free(claimed);
    return result;
}

static PyObject *py_copy_out(PyObject *self, PyObject *args) {
    batch_t b;
    if (!batch_from_args(args, &b))
        return NULL;
    if (b.total >= UNLOCKED_BYTES_MIN) {
        Py_BEGIN_ALLOW_THREADS
        copy_out_batch(&b);
        Py_END_ALLOW_THREADS
    } else {
        copy_out_batch(&b);
    }
    batch_free(&b);
    Py_RETURN_NONE;
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

/* BLAKE2b with an 8-byte digest of each key of a list of bytes, as uint64s back to back (little-endian): what
 * placement.py's pure-Python path computes key by key with hashlib. The list is read through a tuple copy
 * this call owns, so nothing can change it while the GIL is released. */
static PyObject *py_key_hashes(PyObject *self, PyObject *args) {
    PyObject *keys_arg;
    if (!PyArg_ParseTuple(args, "O", &keys_arg))
        return NULL;
    PyObject *keys = PySequence_Tuple(keys_arg);
    if (keys == NULL)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(keys);
    const uint8_t **data = PyMem_Malloc(sizeof *data * (size_t)(count ? count : 1));
    size_t *sizes = PyMem_Malloc(sizeof *sizes * (size_t)(count ? count : 1));
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * count);
    if (data == NULL || sizes == NULL || out == NULL) {
        PyMem_Free(data);
        PyMem_Free(sizes);
        Py_XDECREF(out);
        Py_DECREF(keys);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        if (!PyBytes_Check(key)) {
            PyErr_Format(PyExc_TypeError, "key_hashes: key %zd is %.80s, not bytes", i, Py_TYPE(key)->tp_name);
            PyMem_Free(data);
            PyMem_Free(sizes);
            Py_DECREF(out);
            Py_DECREF(keys);
            return NULL;
        }
        data[i] = (const uint8_t *)PyBytes_AS_STRING(key);
        sizes[i] = (size_t)PyBytes_GET_SIZE(key);
    }
    uint8_t *hashes = (uint8_t *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t h = blake2b_64(data[i], sizes[i]);
        memcpy(hashes + 8 * i, &h, 8);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(data);
    PyMem_Free(sizes);
    Py_DECREF(keys);
    return out;
}

static int cpu_any(void) {
    return 1;
}

/* xxh3's kernels by name, for xxh3_64_kernel; `runs` says whether this CPU has the instructions. */
static const struct {
    const char *name;
    int (*runs)(void);
    uint64_t (*hash)(const uint8_t *, size_t);
    void (*update)(xxh3_state_t *, const uint8_t *, size_t);
    uint64_t (*digest)(const xxh3_state_t *);
} XXH3_KERNELS[] = {
    {"scalar", cpu_any, xxh3_64_scalar, xxh3_update_scalar, xxh3_digest_scalar},
    {"sse2", cpu_any, xxh3_64_sse2, xxh3_update_sse2, xxh3_digest_sse2},
    {"avx2", cpu_avx2, xxh3_64_avx2, xxh3_update_avx2, xxh3_digest_avx2},
    {"avx512", cpu_avx512, xxh3_64_avx512, xxh3_update_avx512, xxh3_digest_avx512},
};

/* One kernel's XXH3_64bits of the buffer: one-shot (cuts None), or streamed in the pieces between
 * the offsets `cuts` (ascending, within the buffer), so a test reaches every kernel and split. */
static PyObject *py_xxh3_64_kernel(PyObject *self, PyObject *args) {
    Py_buffer data;
    const char *name;
    PyObject *cuts;
    if (!PyArg_ParseTuple(args, "y*sO", &data, &name, &cuts))
        return NULL;
    PyObject *result = NULL, *seq = NULL;
    size_t k = 0;
    while (k < sizeof(XXH3_KERNELS) / sizeof(XXH3_KERNELS[0]) && strcmp(XXH3_KERNELS[k].name, name) != 0)
        k++;
    if (k == sizeof(XXH3_KERNELS) / sizeof(XXH3_KERNELS[0])) {
        PyErr_Format(PyExc_ValueError, "kernel must be 'scalar', 'sse2', 'avx2' or 'avx512', got %R",
                     PyTuple_GET_ITEM(args, 1));
        goto done;
    }
    if (!XXH3_KERNELS[k].runs()) {
        PyErr_Format(PyExc_RuntimeError, "this CPU cannot run the %s kernel", name);
        goto done;
    }
    const uint8_t *bytes = data.buf;
    if (cuts == Py_None) {
        result = PyLong_FromUnsignedLongLong(XXH3_KERNELS[k].hash(bytes, (size_t)data.len));
        goto done;
    }
    seq = PySequence_Fast(cuts, "cuts must be a list of offsets");
    Py_XSETREF(seq, seq ? PySequence_Tuple(seq) : NULL);   /* our own: a cut's __index__ may change the list */
    if (!seq)
        goto done;
    xxh3_state_t state;
    xxh3_reset(&state);
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i <= PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t cut = data.len;
        if (i < PySequence_Fast_GET_SIZE(seq)) {
            cut = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i), PyExc_OverflowError);
            if (cut == -1 && PyErr_Occurred())
                goto done;
        }
        if (cut < at || cut > data.len) {
            PyErr_Format(PyExc_ValueError, "cuts must ascend within the buffer's %zd bytes, got %zd after %zd",
                         data.len, cut, at);
            goto done;
        }
        XXH3_KERNELS[k].update(&state, bytes + at, (size_t)(cut - at));
        at = cut;
    }
    result = PyLong_FromUnsignedLongLong(XXH3_KERNELS[k].digest(&state));
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&data);
    return result;
}

/* copy_kernel(name) -> str: keep the copies (copy_hash*, copy_out*, CopyHasher) to the kernel `name` or a
 * narrower one ('sse2', 'avx2', 'avx512'; None: back to the default choice), so a test reaches each kernel the
 * CPU runs; the name of the one they run now. Process-wide: for tests only. */
static PyObject *py_copy_kernel(PyObject *self, PyObject *arg) {
    static const char *const names[] = {"sse2", "avx2", "avx512"};
    if (arg == Py_None)
        return PyUnicode_FromString(names[copy_kernel_cap(-1)]);
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (!name) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "copy_kernel takes a kernel's name or None, got %R", arg);
        return NULL;
    }
    for (int k = COPY_SSE2; k <= COPY_AVX512; k++) {
        if (strcmp(name, names[k]) == 0)
            return PyUnicode_FromString(names[copy_kernel_cap(k)]);
    }
    PyErr_Format(PyExc_ValueError, "kernel must be 'sse2', 'avx2' or 'avx512', got %R", arg);
    return NULL;
}

/* An exact int of at most one internal digit (below 2**30: every token id of a real vocabulary) read
 * straight from the object, without the general conversion's call: that call was most of a long
 * prompt's packing. 0 where the int is larger, or the interpreter's layout is not one known here. */
static inline int small_int(PyObject *v, long long *value) {
#if PY_VERSION_HEX >= 0x030C0000 && !defined(Py_LIMITED_API)
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v))
        return 0;
    *value = (long long)PyUnstable_Long_CompactValue((PyLongObject *)v);
    return 1;
#elif PY_VERSION_HEX >= 0x030900A0 && !defined(Py_LIMITED_API)
    Py_ssize_t size = Py_SIZE(v);
    if (size < -1 || size > 1)
        return 0;
    *value = size == 0 ? 0 : size * (long long)((PyLongObject *)v)->ob_digit[0];
    return 1;
#else
    (void)v, (void)value;
    return 0;
#endif
}

/* token_ids_u32(ids: list | tuple) -> bytes | None: the ids as native uint32, back to back; None where one is
 * not an int of 0..2^32-1 (the caller's general path then packs them wider or says which is wrong). A tight
 * loop over the items: array.array('I', ids) spends most of its time per item in its generic conversion, a
 * millisecond on a 128k-token prompt. */
static PyObject *py_token_ids_u32(PyObject *self, PyObject *args) {
    PyObject *ids;
    if (!PyArg_ParseTuple(args, "O", &ids))
        return NULL;
    if (!PyList_Check(ids) && !PyTuple_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "token_ids_u32 takes a list or tuple");
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ids);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * count);
    if (out == NULL)
        return NULL;
    uint32_t *packed = (uint32_t *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(ids);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyLong_CheckExact(items[i]))
            goto not_u32;
        long long id;
        if (!small_int(items[i], &id)) {
            int overflow;
            id = PyLong_AsLongLongAndOverflow(items[i], &overflow);
            if (overflow)
                goto not_u32;
        }
        if (id < 0 || id > (long long)UINT32_MAX)
            goto not_u32;
        packed[i] = (uint32_t)id;
    }
    return out;
not_u32:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"prefix_hashes", py_prefix_hashes, METH_VARARGS,
     "prefix_hashes(tokens, page_tokens, prior, kernel='auto') -> list[str]: hex SHA-256 chain of every full page"},
    {"prefix_hashes_packed", py_prefix_hashes_packed, METH_VARARGS,
     "prefix_hashes_packed(tokens, page_tokens, prior, kernel='auto') -> bytes: the same keys, 64 ASCII hex digits "
     "each, back to back"},
    {"encode_keys", py_encode_keys, METH_VARARGS,
     "encode_keys(keys, key_bytes_max) -> list[bytes] | None: ASCII str and bytes keys of 1 to key_bytes_max bytes"},
    {"pack_keys", py_pack_keys, METH_VARARGS,
     "pack_keys(keys, key_bytes_max) -> (bytes, key_bytes) | None: ASCII str or bytes keys of one length, back to back"},
    {"distinct_keys", py_distinct_keys, METH_VARARGS,
     "distinct_keys(keys, key_bytes_max) -> list[bytes] | None: bytes keys of 1 to key_bytes_max bytes, none twice"},
    {"claim_keys", py_claim_keys, METH_VARARGS,
     "claim_keys(claimed, keys, value) -> bool: every key put in the dict with value if none is in it yet, else nothing"},
    {"unclaim_keys", py_unclaim_keys, METH_VARARGS,
     "unclaim_keys(claimed, keys) -> None: each key taken out of the dict (KeyError for one not in it)"},
    {"spin_until_readable", py_spin_until_readable, METH_VARARGS,
     "spin_until_readable(fd, spin_s) -> bool: poll fd without waiting, yielding between polls and without the GIL, "
     "until it is readable or spin_s has passed"},
    {"hex_digests", py_hex_digests, METH_O,
     "hex_digests(packed) -> bytes | None: keys of 64 lowercase hex digits, back to back, as their 32 bytes each"},
    {"copy_hash", py_copy_hash, METH_VARARGS,
     "copy_hash(dst, segments) -> int: copy (address, nbytes) segments to dst; XXH3_64bits of the bytes"},
    {"copy_hash_pages", py_copy_hash_pages, METH_VARARGS,
     "copy_hash_pages(base, pages) -> list[int]: copy_hash of each (offset, segments) to base + offset"},
    {"copy_hash_into", py_copy_hash_into, METH_VARARGS,
     "copy_hash_into(base, offsets, pages) -> list[int]: copy_hash of pages[i]'s segments to base + offsets[i]"},
    {"copy_hash_rows", py_copy_hash_rows, METH_VARARGS,
     "copy_hash_rows(base, offsets, src, page_bytes, count) -> bytes: copy_hash of count pages back to back from src "
     "to base + offsets[i]; their checksums as native uint64s"},
    {"copy_out_hashed_rows", py_copy_out_hashed_rows, METH_VARARGS,
     "copy_out_hashed_rows(base, offsets, dst, page_bytes, count) -> bytes: copy_out_hashed of the slots at base + "
     "offsets[i] into count pages back to back at dst; their checksums as native uint64s"},
    {"copy_claimed", py_copy_claimed, METH_VARARGS,
     "copy_claimed(cursor, out, arena, slot_offsets, buffer, buffer_offsets, page_bytes) -> (bytes, bytes): claim "
     "pages by an atomic add to the uint64 at cursor (at most as many times as there are pages) and copy each one "
     "claimed between buffer + buffer_offsets[i] and arena + slot_offsets[i] (out: into the buffer), hashed; the "
     "checksums as native uint64s and one byte a page, 1 where this call copied it"},
    {"copy_out", py_copy_out, METH_VARARGS,
     "copy_out(base, offsets, pages) -> None: copy the slot at base + offsets[i] out into pages[i]'s segments"},
    {"copy_out_hashed", py_copy_out_hashed, METH_VARARGS,
     "copy_out_hashed(base, offsets, pages) -> list[int]: copy_out, and XXH3_64bits of what landed in each page"},
    {"xxh3_64", py_xxh3_64, METH_VARARGS, "xxh3_64(buffer) -> int: XXH3_64bits of the buffer"},
    {"token_ids_u32", py_token_ids_u32, METH_VARARGS,
     "token_ids_u32(ids) -> bytes | None: a list or tuple of ints as native uint32, None where one does not fit"},
    {"key_hashes", py_key_hashes, METH_VARARGS,
     "key_hashes(keys) -> bytes: BLAKE2b with an 8-byte digest of each bytes key, back to back"},
    {"copy_kernel", py_copy_kernel, METH_O,
     "copy_kernel(name) -> str: the copies kept to kernel name ('sse2', 'avx2', 'avx512') or a narrower one the CPU "
     "runs (None: the default choice); the one they run now (tests)"},
    {"xxh3_64_kernel", py_xxh3_64_kernel, METH_VARARGS,
     "xxh3_64_kernel(buffer, kernel, cuts) -> int: XXH3_64bits by kernel 'scalar', 'sse2', 'avx2' or 'avx512', "
     "one-shot if cuts is None, else streamed in the pieces between the ascending offsets cuts"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kvstore_native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (page_index_register(m) < 0 || key_set_register(m) < 0 || copy_hasher_register(m) < 0))
        Py_CLEAR(m);
    return m;
}
