#ifndef KVSTORE_NATIVE_PAGE_INDEX_H
#define KVSTORE_NATIVE_PAGE_INDEX_H
#include <Python.h>
#include <stdint.h>

/* Adds PageIndex and IndexRecord (page_index.c) to the module; -1 with an error set on failure. */
int page_index_register(PyObject *module);

/* 64 lowercase hex digits into the 32 bytes they spell; 0 (and `out` unspecified) when any byte is not
 * one. The index's own decoding of hex keys (AVX2 where the CPU has it), valid once the module is registered. */
int hex64_decode(const uint8_t *in, uint8_t *out);
#endif
