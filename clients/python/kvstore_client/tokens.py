"""Token ids as callers hold them (a list, a numpy array, a torch tensor on any device) -> one uint32 array.

Every call that takes token ids (lookup, route, put and get by tokens, prefix_hashes) reads them
through token_array, so each form works everywhere and a wrong one fails the same way: a
float or 2-D array, or an id outside uint32, is InvalidArgument, never silently truncated.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore_client.errors import InvalidArgument

TOKEN_ID_MAX = 0xFFFFFFFF
# Kept as they are (no copy): the native prefix-hash chain reads these in place.
_KEPT_DTYPES = (np.dtype("<u4"), np.dtype("<i4"), np.dtype("<u8"), np.dtype("<i8"))


def token_array(tokens: Any) -> np.ndarray:
    """The ids as a C-contiguous 1-D array of 32- or 64-bit integers, all in uint32's range (a copy only
    where the input's type, dtype or device needs one)."""
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().cpu().numpy()
    elif isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise InvalidArgument(f"token ids must be a list, numpy array or torch tensor of ints, "
                              f"got {type(tokens).__name__}")
    array = np.asarray(tokens)
    if array.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if array.ndim != 1:
        raise InvalidArgument(f"token ids must be one sequence, got an array of shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {array.dtype} "
                              f"(e.g. {array[0]!r}); pass the tokenizer's ids, not text or floats")
    if array.min() < 0 or array.max() > TOKEN_ID_MAX:
        raise InvalidArgument(f"token ids must be 0 to {TOKEN_ID_MAX} (uint32), got "
                              f"{array.min()}..{array.max()}")
    return np.ascontiguousarray(array if array.dtype in _KEPT_DTYPES else array.astype(np.uint32))
