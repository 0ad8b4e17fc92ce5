"""A set of our keys whose leading run over a chain is counted in one call: the engine index's sets of the
keys each engine holds, asked about a whole prompt's chain (a residency query of 128k tokens: 8192 keys).

kvstore_native.KeySet where the extension is built: it reads a Lookup's packed keys in place, with no
bytes object per key (a tenth of a takewhile over a Python set, measured on 8192 keys). Without it,
PyKeySet: a Python set with the same calls and the same answers (tests/unit/test_engine_index.py holds
the two to each other).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from kvstore_client import native
from kvstore_client.keys import unpack_keys


class PyKeySet(set):
    """A set of bytes keys with KeySet.leading."""

    def leading(self, keys: Sequence[bytes] | bytes, key_bytes: int = 0, start: int = 0) -> int:
        """How many keys from `start` on are in the set before the first that is not; `keys` packed,
        `key_bytes` each, or (key_bytes 0) a sequence of bytes."""
        if key_bytes:
            keys, start = unpack_keys(keys[start * key_bytes:], key_bytes), 0
        return len(list(itertools.takewhile(self.__contains__, itertools.islice(keys, start, None))))


KeySet = getattr(native.module, "KeySet", None) or PyKeySet
