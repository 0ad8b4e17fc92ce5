"""xxh3-64 of a page, as the server records it at commit: the optional end-to-end check (verify=True).

A put hashes what the caller handed over, so the server refuses a slot that does not hold it; a
get hashes what landed in the caller's buffer, so a page damaged on the way is never returned.
"""

from __future__ import annotations

import ctypes

from kvstore_client.buffers import Segment

import xxhash


def page_hasher() -> "xxhash.xxh3_64":
    """An incremental xxh3-64, fed a page's bytes in order."""
    return xxhash.xxh3_64()


def of_page(segments: list[Segment]) -> int:
    """xxh3-64 of a page given as (address, nbytes) segments, hashed as one run of bytes."""
    hasher = xxhash.xxh3_64()
    for address, nbytes in segments:
        hasher.update(memoryview((ctypes.c_char * nbytes).from_address(address)))
    return hasher.intdigest()
