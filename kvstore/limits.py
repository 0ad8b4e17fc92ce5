"""Budgets derived from the configuration, one term per line, with the relations they must keep."""

from __future__ import annotations

import dataclasses

from kvstore.config import Config
from kvstore_client import framing
from kvstore_client.keys import KEY_BYTES_MAX


@dataclasses.dataclass(frozen=True)
class Limits:
    batch_pages_max: int        # pages in one Reserve/Acquire/Delete
    lookup_pages_max: int       # pages in one Lookup/Route (read-only: no slot, no lease per page)
    page_bytes_max: int         # the largest page a namespace may declare
    key_bytes_max: int          # bytes of one prefix hash
    slabs: int                  # arena units, each given to one page size at a time
    frame_bytes_max: int        # one local-channel frame
    request_bytes_max: int      # the largest request a full batch produces

    @classmethod
    def from_config(cls, config: Config) -> "Limits":
        batch = config.limits.batch_pages_max
        limits = cls(
            batch_pages_max=batch,
            lookup_pages_max=config.limits.lookup_pages_max,
            page_bytes_max=config.limits.page_bytes_max or config.dram.slab_bytes,
            key_bytes_max=KEY_BYTES_MAX,
            slabs=config.dram.arena_bytes // config.dram.slab_bytes,
            frame_bytes_max=framing.FRAME_BYTES_MAX,
            # keys (+ 2 bytes of tag and length each) and per-page fixed64/uint64 fields
            request_bytes_max=batch * (KEY_BYTES_MAX + 2) + batch * 2 * 10 + 1024,
        )
        assert limits.slabs >= 1, "the arena holds at least one slab"
        assert limits.page_bytes_max <= config.dram.slab_bytes, "a page fits in one slab"
        assert limits.request_bytes_max <= limits.frame_bytes_max, "a full batch fits in one frame"
        # a full Lookup by keys: each key with its tag and length
        assert limits.lookup_pages_max * (KEY_BYTES_MAX + 2) + 1024 <= limits.frame_bytes_max, \
            "a full Lookup fits in one frame"
        return limits
