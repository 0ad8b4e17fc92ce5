/* CopyHasher: the xxh3 of a page that arrives a piece at a time, each piece copied into place and
 * hashed in one pass (copy_hash_update).
 *
 * A socket read lands in a small private buffer that stays in the CPU's cache; copy() moves it to
 * the page's place with streamed stores (no read for ownership of the destination, where the
 * kernel's copy into a cold page pays one) and hashes it from that buffer on the way, so what is
 * hashed is exactly what was written, whatever else may write the destination.
 *
 *   h = CopyHasher(); h.copy(dst, src); ...; h.intdigest() == xxh3_64 of every src given
 *
 * receive() runs a reader's whole loop for one page (recv into the buffer, copy out, until the page is
 * full) without the GIL, where a Python loop took a pass of the interpreter for every read.
 */
#define PY_SSIZE_T_CLEAN
#include "copy_hasher.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#include "copy_hash.h"

typedef struct {
    PyObject_HEAD
    xxh3_state_t *state;   /* 64-byte aligned: Python's allocator gives 16 */
    int busy;              /* a copy runs without the GIL: a second thread must not feed the stream meanwhile */
} CopyHasher;

static PyObject *ch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (!_PyArg_NoKeywords("CopyHasher", kwargs) || !PyArg_ParseTuple(args, ":CopyHasher"))
        return NULL;
    CopyHasher *self = (CopyHasher *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    if (posix_memalign((void **)&self->state, 64, sizeof(xxh3_state_t)) != 0) {
        self->state = NULL;
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    xxh3_reset(self->state);
    return (PyObject *)self;
}

static void ch_dealloc(CopyHasher *self) {
    free(self->state);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int claim(CopyHasher *self) {
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "this CopyHasher is being fed by another thread");
        return -1;
    }
    return 0;
}

/* n bytes from src into dst, fed to the stream or not: the same streamed stores either way. Without the GIL. */
static void land(CopyHasher *self, uint8_t *dst, const uint8_t *src, size_t n, int hashed) {
    if (hashed)
        copy_hash_update(self->state, dst, src, n);
    else
        copy_streamed(dst, src, n);
}

static PyObject *copy_into(CopyHasher *self, PyObject *args, const char *format, int hashed) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, format, &dst, &src))
        return NULL;
    PyObject *result = NULL;   /* "w*" and "y*" take contiguous buffers only */
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "a copy of %zd bytes into a buffer of %zd", src.len, dst.len);
    } else if (claim(self) == 0) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        land(self, dst.buf, src.buf, (size_t)src.len, hashed);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *ch_copy(CopyHasher *self, PyObject *args) {
    return copy_into(self, args, "w*y*:copy", 1);
}

static PyObject *ch_copy_unhashed(CopyHasher *self, PyObject *args) {
    return copy_into(self, args, "w*y*:copy_unhashed", 0);
}

static double monotonic_s(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);   /* the clock of Python's time.monotonic() */
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* receive(fd, dst, buffer, hashed, deadline): fill dst from a blocking socket, each read landing in
 * `buffer` and copied out (hashed or not), the whole page without the GIL. */
static PyObject *ch_receive(CopyHasher *self, PyObject *args) {
    int fd, hashed;
    double deadline;
    Py_buffer dst, buffer;
    if (!PyArg_ParseTuple(args, "iw*w*pd:receive", &fd, &dst, &buffer, &hashed, &deadline))
        return NULL;
    PyObject *result = NULL;
    size_t got = 0, total = (size_t)dst.len, room = (size_t)buffer.len;
    if (room == 0) {
        PyErr_SetString(PyExc_ValueError, "receive() needs a buffer of at least one byte");
        goto done;
    }
    if (claim(self) < 0)
        goto done;
    self->busy = 1;
    while (got < total) {
        ssize_t n;
        int error = 0, late = 0;
        Py_BEGIN_ALLOW_THREADS
        if (deadline > 0 && monotonic_s() > deadline) {
            late = 1;   /* a trickle must not outlive the call */
            n = -1;
        } else {
            /* hashing, part-way through a line: read to its end (copy-and-hash runs in one pass from a line on) */
            size_t want = hashed && got % 64 ? 64 - got % 64 : room;
            if (want > room)
                want = room;
            if (want > total - got)
                want = total - got;
            n = recv(fd, buffer.buf, want, 0);
            if (n > 0)
                land(self, (uint8_t *)dst.buf + got, buffer.buf, (size_t)n, hashed);
            else if (n < 0)
                error = errno;
        }
        Py_END_ALLOW_THREADS
        if (n > 0) {
            got += (size_t)n;
        } else if (late) {
            PyObject *why = Py_BuildValue("(is)", EAGAIN, "the call's timeout_s ran out");
            if (why) {
                PyErr_SetObject(PyExc_TimeoutError, why);
                Py_DECREF(why);
            }
            break;
        } else if (n == 0) {
            PyErr_SetString(PyExc_ConnectionResetError, "the server closed the TCP data plane connection");
            break;
        } else if (error == EINTR) {
            if (PyErr_CheckSignals() < 0)
                break;
        } else {
            errno = error;
            PyErr_SetFromErrno(PyExc_OSError);
            break;
        }
    }
    self->busy = 0;
    if (got == total)
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&buffer);
    return result;
}

static PyObject *ch_intdigest(CopyHasher *self, PyObject *unused) {
    if (claim(self) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(copy_hash_digest(self->state));
}

static PyObject *ch_reset(CopyHasher *self, PyObject *unused) {
    if (claim(self) < 0)
        return NULL;
    xxh3_reset(self->state);
    Py_RETURN_NONE;
}

static PyMethodDef ch_methods[] = {
    {"copy", (PyCFunction)ch_copy, METH_VARARGS,
     "copy(dst, src) -> None: copy src into the start of dst (a writable buffer) and feed its bytes to the stream"},
    {"copy_unhashed", (PyCFunction)ch_copy_unhashed, METH_VARARGS,
     "copy_unhashed(dst, src) -> None: copy() without feeding the stream (bytes no one needs hashed)"},
    {"receive", (PyCFunction)ch_receive, METH_VARARGS,
     "receive(fd, dst, buffer, hashed, deadline) -> None: fill dst from the blocking socket fd, each read landing "
     "in buffer and copied into place (fed to the stream if hashed), without the GIL; past deadline "
     "(time.monotonic(), 0: none) TimeoutError, on end of stream ConnectionResetError, else OSError"},
    {"intdigest", (PyCFunction)ch_intdigest, METH_NOARGS, "intdigest() -> int: XXH3_64bits of every byte copied"},
    {"reset", (PyCFunction)ch_reset, METH_NOARGS, "reset() -> None: start a new stream"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyHasherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore_native.CopyHasher",
    .tp_basicsize = sizeof(CopyHasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CopyHasher(): the xxh3 of bytes copied into place a piece at a time (copy, intdigest, reset)",
    .tp_new = ch_new,
    .tp_dealloc = (destructor)ch_dealloc,
    .tp_methods = ch_methods,
};

int copy_hasher_register(PyObject *module) {
    return PyModule_AddType(module, &CopyHasherType);   /* ready, added under its tp_name's last part */
}
