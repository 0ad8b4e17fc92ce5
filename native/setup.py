"""Builds kvstore_native, the C extension of kvstore's hot loops (see README.md)."""

import sys

from setuptools import Extension, setup

if sys.byteorder != "little":
    raise SystemExit("kvstore_native packs token ids as little-endian uint32 in place: a little-endian CPU only")

setup(
    packages=[],
    py_modules=[],
    ext_modules=[Extension(
        "kvstore_native",
        sources=["csrc/module.c", "csrc/prefix_hash.c", "csrc/copy_hash.c", "csrc/copy_hash_avx2.c",
                 "csrc/page_index.c", "csrc/page_table.c", "csrc/page_heaps.c", "csrc/index_record.c"],
        include_dirs=["csrc"],
        libraries=["crypto"],
        extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            "-Wno-missing-field-initializers"],
    )],
)
