/* CopyHasher: an xxh3 stream fed by copies (copy_hasher.c). */
#ifndef KVSTORE_NATIVE_COPY_HASHER_H
#define KVSTORE_NATIVE_COPY_HASHER_H
#include <Python.h>

int copy_hasher_register(PyObject *module);
#endif
