"""The packed fields of Reserve, Commit and Acquire (kvstore.proto: Limits.pages_packed): per-page numbers back
to back in one bytes field instead of a repeated field.

A repeated field costs protobuf a Python int per entry on each side: building the 512 states and offsets of
one Reserve's answer took the node 25-30 us and reading them the client as long, a tenth of a Reserve of
small pages. Bytes cost one copy. Offsets and checksums are little-endian uint64s, states one byte each.
Each reader takes either form, so a node answers an older client, and a client an older node, as before.
"""

from __future__ import annotations

import array
import sys
from typing import Any, Sequence

_BIG_ENDIAN = sys.byteorder != "little"


def u64s(values: Sequence[int]) -> bytes:
    """Little-endian uint64s, back to back."""
    if isinstance(values, memoryview) and values.format == "Q" and not _BIG_ENDIAN:
        return values.tobytes()   # already uint64s (copy_hash_rows' checksums)
    packed = array.array("Q", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def read_u64s(data: bytes, what: str = "a packed field") -> Sequence[int]:
    """The numbers of u64s(data): a view of `data` on a little-endian host. ValueError when `data` is not
    a whole number of them."""
    if len(data) % 8:
        raise ValueError(f"{what} holds {len(data)} bytes, not a whole number of 8-byte numbers")
    if not _BIG_ENDIAN:
        return memoryview(data).cast("Q")
    values = array.array("Q", data)
    values.byteswap()
    return values


def reserve_states(answer: Any) -> list[int]:
    """Each key's ReserveState, from a ReserveResponse in either form."""
    return list(answer.states_packed) if answer.states_packed else list(answer.states)


def offsets(answer: Any) -> Sequence[int]:
    """Each page's slot offset, from a ReserveResponse or an AcquireResponse in either form."""
    return read_u64s(answer.offsets_packed, "offsets_packed") if answer.offsets_packed else answer.offsets


def checksums(answer: Any) -> Sequence[int]:
    """Each page's checksum, from a CommitResponse or an AcquireResponse in either form."""
    return read_u64s(answer.checksums_packed, "checksums_packed") if answer.checksums_packed else answer.checksums


def commit_states(answer: Any) -> Sequence[int]:
    """Each page's CommitState, from a CommitResponse in either form."""
    return answer.states_packed if answer.states_packed else answer.states
