"""What loading a page from each tier has cost this node lately: the node's half of a fetch-or-recompute answer.

An Acquire's time on the node, from the request to its answer, is spent pinning the pages in DRAM and, for
pages only on NVMe, promoting them (a read from the disk, the check of its checksum). Both are measured on
every Acquire and kept per tier as seconds per page, an exponentially weighted mean with a half-life in
seconds (recent reads count most, and a slow spell fades as reads come fast again). A residency answer
carries them (LookupResponse.load_rates) so a client adds what its own data plane costs (the copy out of the
arena, or the bytes over TCP) and compares the sum with a prefill of the same tokens
(kvstore_client/load_estimate.py). A tier not read lately has no figure: the client then assumes loading
pays, as it did before any estimate existed.
"""

from __future__ import annotations

import math
import threading
import time

from kvstore_client.proto import pb

HALF_LIFE_S = 30.0


class LoadRates:
    def __init__(self, half_life_s: float = HALF_LIFE_S, clock=time.monotonic):
        self._half_life_s, self._clock = half_life_s, clock
        self._rates: dict[int, tuple[float, float, float]] = {}   # tier -> (seconds a page, weight, when)
        self._lock = threading.Lock()

    def observe(self, tier: int, pages: int, seconds: float) -> None:
        """`pages` of `tier` cost `seconds` on this node (their share of one Acquire)."""
        if pages <= 0 or seconds < 0:
            return
        now = self._clock()
        with self._lock:
            mean, weight, when = self._rates.get(tier, (0.0, 0.0, now))
            weight *= math.exp2(-(now - when) / self._half_life_s)
            total = weight + pages
            self._rates[tier] = ((mean * weight + seconds) / total, total, now)

    def answer(self) -> list[pb.TierRate]:
        """Each tier's recent seconds a page, with how many pages (decayed) the figure rests on."""
        now = self._clock()
        with self._lock:
            return [pb.TierRate(tier=tier, seconds_per_page=mean,
                                pages=weight * math.exp2(-(now - when) / self._half_life_s))
                    for tier, (mean, weight, when) in sorted(self._rates.items())]
