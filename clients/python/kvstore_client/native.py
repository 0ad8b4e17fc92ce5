"""kvstore_native, the C hot loops (native/ at the top of the repository), when it is installed.

Everything it does has a pure-Python path with identical results (keys.prefix_hashes_python,
checksums.of_page with memmove): without a compiler the SDK works, only slower, and says so once
at import. `make install` builds it; `pip install ./native` does it by hand.
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
    log.warning("kvstore_native is not installed (%s): prefix hashes and page copies take the pure-Python "
                "path, several times slower; build it with `pip install ./native` (needs gcc, libssl-dev, "
                "libxxhash-dev)", error)


def available() -> bool:
    return module is not None


# Added to kvstore_native after its first functions: None where an older build is installed, and
# the SDK takes the Python path for them.
pack_keys = getattr(module, "pack_keys", None)
prefix_hashes_packed = getattr(module, "prefix_hashes_packed", None)
