/* KeySet, a set of bytes keys with a chain's leading run counted in C (key_set.c). */
#ifndef KVSTORE_NATIVE_KEY_SET_H
#define KVSTORE_NATIVE_KEY_SET_H
#include <Python.h>

int key_set_register(PyObject *module);
#endif
