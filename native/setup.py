"""Builds kvstore_native, the C extension of kvstore's hot loops (see README.md).

It needs a C compiler and Python's headers, nothing else: xxh3 is in csrc/, and SHA-256 comes
from the libcrypto that Python's own hashlib already loads, linked by its file name (say
libcrypto.so.3), so neither OpenSSL's headers nor the unversioned libcrypto.so of a -dev package
are used.
"""

import ctypes.util
import glob
import os
import sys

from setuptools import Extension, setup

if sys.byteorder != "little":
    raise SystemExit("kvstore_native packs token ids as little-endian uint32 in place: a little-endian CPU only")


def libcrypto() -> tuple[str | None, str]:
    """(directory or None, file name) of OpenSSL's libcrypto: the one Python's _hashlib has loaded,
    else the one the dynamic linker's cache names."""
    try:
        import _hashlib  # noqa: F401  (loads its libcrypto into this process)
    except ImportError:   # a Python built without OpenSSL
        pass
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if os.path.basename(path).startswith("libcrypto.so."):
                return os.path.dirname(path), os.path.basename(path)
    name = ctypes.util.find_library("crypto")   # a hashlib with OpenSSL linked in statically
    if name:
        return None, name
    raise SystemExit(
        "kvstore_native links OpenSSL's libcrypto for SHA-256 and found none: Python's _hashlib has no "
        "libcrypto.so.* loaded and ctypes.util.find_library('crypto') finds none. Install the runtime "
        "library (Debian: libssl3; no -dev package is needed).")


crypto_dir, crypto_file = libcrypto()

setup(
    packages=[],
    py_modules=[],
    ext_modules=[Extension(
        "kvstore_native",
        sources=["csrc/module.c", "csrc/prefix_hash.c", "csrc/copy_hash.c", "csrc/copy_hash_avx2.c",
                 "csrc/copy_hash_avx512.c", "csrc/xxh3.c", "csrc/xxh3_scalar.c", "csrc/xxh3_sse2.c",
                 "csrc/xxh3_avx2.c", "csrc/xxh3_avx512.c",
                 "csrc/page_index.c", "csrc/page_table.c", "csrc/page_heaps.c", "csrc/index_record.c",
                 "csrc/placement_hash.c", "csrc/key_set.c",
                 "csrc/copy_hasher.c", "csrc/sha256_ni.c"],
        include_dirs=["csrc"],
        depends=sorted(glob.glob("csrc/*.h")),   # a changed header rebuilds, as a changed source does
        libraries=[":" + crypto_file],   # -l:libcrypto.so.3, the file itself
        library_dirs=[crypto_dir] if crypto_dir else [],
        runtime_library_dirs=[crypto_dir] if crypto_dir else [],   # the same one at run time
        # hidden: calls between our files are direct, not through the PLT, and the secret is read
        # without the GOT (a put of 1 GiB of 1 MiB pages: about 3% faster); PyInit_ is exported
        extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            "-Wno-missing-field-initializers", "-fvisibility=hidden"],
    )],
)
