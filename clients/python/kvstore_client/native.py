"""kvstore_native, the C hot loops (native/ at the top of the repository), when it is installed.

Everything it does has a pure-Python path with identical results (keys.prefix_hashes_python,
checksums.of_page with memmove): without a compiler the SDK works, only slower. The node says
which one it runs in its start-up log; the SDK logs it at INFO on import and prints nothing, so a
CLI call or an engine's output stays its own. `make install` builds it; `pip install ./native`
does it by hand (a C compiler and Python's headers are all it needs).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

try:
    import kvstore_native as module
    missing_reason = ""
except ImportError as error:  # pragma: no cover - exercised where the extension is not built
    module = None
    missing_reason = str(error)
    log.info("kvstore_native is not installed (%s): prefix hashes and page copies take the pure-Python path",
             error)


def available() -> bool:
    return module is not None


# Added to kvstore_native after its first functions: None where an older build is installed, and
# the SDK takes the Python path for them.
pack_keys = getattr(module, "pack_keys", None)
hex_digests = getattr(module, "hex_digests", None)
encode_keys = getattr(module, "encode_keys", None)
prefix_hashes_packed = getattr(module, "prefix_hashes_packed", None)
key_hashes = getattr(module, "key_hashes", None)
token_ids_u32 = getattr(module, "token_ids_u32", None)
distinct_keys = getattr(module, "distinct_keys", None)
claim_keys = getattr(module, "claim_keys", None)
copy_hash_rows = getattr(module, "copy_hash_rows", None)
copy_out_hashed_rows = getattr(module, "copy_out_hashed_rows", None)
copy_claimed = getattr(module, "copy_claimed", None)
spin_until_readable = getattr(module, "spin_until_readable", None)
unclaim_keys = getattr(module, "unclaim_keys", None)
CopyHasher = getattr(module, "CopyHasher", None)
if not hasattr(CopyHasher, "receive"):   # a build from before receive and copy_unhashed: the landings go direct
    CopyHasher = None
