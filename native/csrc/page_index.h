#ifndef KVSTORE_NATIVE_PAGE_INDEX_H
#define KVSTORE_NATIVE_PAGE_INDEX_H
#include <Python.h>

/* Adds PageIndex and IndexRecord (page_index.c) to the module; -1 with an error set on failure. */
int page_index_register(PyObject *module);
#endif
