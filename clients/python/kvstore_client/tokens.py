"""Token ids as callers hold them (a list, a numpy array, a torch tensor on any device) -> one integer array.

Every call that takes token ids (lookup, route, put and get by tokens, prefix_hashes) reads them
through token_array, so each form works everywhere and a wrong one fails the same way: a float or
2-D array, or an id outside 0..TOKEN_ID_MAX, is InvalidArgument, never silently truncated.

Ids past uint32 are real (SGLang's multimodal pad values are up to 62 bits) and SGLang hashes them
up to int64's maximum (keys.page_hash), so they are kept whole. Only the wire's `tokens` fields
are uint32: wire_tokens refuses wider ids there rather than cut them.
"""

from __future__ import annotations

from array import array as packed_ints
from typing import Any

import numpy as np

from kvstore_client import native
from kvstore_client.errors import InvalidArgument

TOKEN_ID_MAX = 2**63 - 1        # SGLang's get_hash_str refuses ids past int64's maximum, and negative ones
NARROW_TOKEN_ID_MAX = 0xFFFFFFFF   # ids a page hashes as 4 bytes each, and the wire's tokens fields carry
# Kept as they are (no copy): the native prefix-hash chain reads these in place.
_KEPT_DTYPES = (np.dtype("<u4"), np.dtype("<i4"), np.dtype("<u8"), np.dtype("<i8"))
# array.array codes of 4- and 8-byte unsigned ints on this platform, narrowest first.
_PACKED_CODES = tuple((code, dtype) for code, dtype in (("I", np.uint32), ("L", np.uint32), ("Q", np.uint64))
                      if packed_ints(code).itemsize == np.dtype(dtype).itemsize)


def token_array(tokens: Any) -> np.ndarray:
    """The ids as a C-contiguous 1-D array of 32- or 64-bit integers, all in 0..TOKEN_ID_MAX (a copy only
    where the input's type, dtype or device needs one)."""
    if type(tokens) in (list, tuple):
        held = _unsigned(tokens)
        if held is not None:
            return held
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
        if not isinstance(tokens, np.ndarray) and all(type(t) is int for t in tokens):
            # ints numpy holds as float64 or objects only: past 64 bits, or past int64 with a negative
            raise InvalidArgument(_range_message(min(tokens), max(tokens)))
        raise InvalidArgument(f"token ids must be integers, got dtype {array.dtype} "
                              f"(e.g. {array[0]!r}); pass the tokenizer's ids, not text or floats")
    # Only a signed id can be negative, and only a 64-bit unsigned one past TOKEN_ID_MAX: a uint32 prompt is not
    # read here at all (two reductions over 128k ids were a tenth of a lookup by tokens).
    wide_unsigned = array.dtype.kind == "u" and array.dtype.itemsize == 8
    if (array.dtype.kind == "i" and array.min() < 0) or (wide_unsigned and array.max() > TOKEN_ID_MAX):
        raise InvalidArgument(_range_message(array.min(), array.max()))
    return np.ascontiguousarray(array if array.dtype in _KEPT_DTYPES else array.astype(np.uint32))


def _unsigned(tokens: list | tuple) -> np.ndarray | None:
    """A list of ints as uint32 (or uint64 where one is wider), through an array.array: a seventh of np.asarray's
    time on 128k ids, which looks at each one twice to choose a dtype. None where one is negative, wider than 64
    bits or no int: the general path then says which. Ids that all fit 32 bits go through kvstore_native where it
    is built, in a fourth of array.array's time."""
    if native.token_ids_u32 is not None:
        narrow = native.token_ids_u32(tokens)
        if narrow is not None:
            return np.frombuffer(narrow, dtype=np.uint32)
    for code, dtype in _PACKED_CODES:
        try:
            ids = np.frombuffer(packed_ints(code, tokens), dtype=dtype)
        except OverflowError:   # negative, or too wide for this code: the next, or the general path
            continue
        except TypeError:       # not an int
            return None
        if dtype is np.uint64 and ids.size and ids.max() > TOKEN_ID_MAX:
            raise InvalidArgument(_range_message(int(ids.min()), int(ids.max())))
        return ids
    return None


def wire_tokens(tokens: Any) -> list[int]:
    """The ids for a request's uint32 `tokens` field (the node hashes them); an id past uint32 is refused."""
    array = token_array(tokens)
    if array.size and array.max() > NARROW_TOKEN_ID_MAX:
        raise InvalidArgument(
            f"token id {array.max()} is past {NARROW_TOKEN_ID_MAX}: a request's tokens field is uint32, so the "
            "node cannot hash it; pass keys=prefix_hashes(tokens, page_tokens, hash_seed) instead (computed "
            "here, with SGLang's encoding of wide ids)")
    return array.tolist()


def _range_message(low: int, high: int) -> str:
    return (f"token ids must be 0 to {TOKEN_ID_MAX} (int64's maximum, the widest SGLang hashes), got "
            f"{low}..{high}")
