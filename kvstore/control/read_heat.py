"""Which pages are read often on this node: decayed read counts, for a cluster's replication by popularity.

A cluster places each page on one node by its key (kvstore_client/placement.py). A page many
engines read (a system prompt's, a shared document's) would load that one node; a cold page
needs no second copy. So each node counts the reads it serves, per page, decayed with a
half-life (cluster.hot_half_life_s), and flags a page hot in Acquire's answer (hot_pages) once
its count reaches cluster.hot_reads, give or take half a read (reads moments apart have decayed
a little: three in a second count 2.99). The cluster client that read it then writes it to the
page's other replicas and spreads its later reads over them.

The count is exponentially decayed, kept as (count, time of the last read) and brought up to
date on each read, so no sweep ever runs. The table is bounded (cluster.hot_pages_max): the page
read longest ago goes first, which loses only counts that had decayed the most. A page read
less than once per half-life never reaches a threshold above 2. Kept apart from the store's
lock: one lock of its own, held for one dictionary step per page of the Acquire.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Sequence


class ReadHeat:
    def __init__(self, hot_reads: int, half_life_s: float, pages_max: int,
                 clock: Callable[[], float] = time.monotonic):
        assert hot_reads > 0 and half_life_s > 0 and pages_max > 0
        self.hot_reads, self.half_life_s, self.pages_max = hot_reads, half_life_s, pages_max
        self._clock = clock
        self._heat: collections.OrderedDict[tuple[int, bytes], tuple[float, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._heat)

    def read(self, ns_id: int, keys: Sequence[bytes]) -> list[int]:
        """Count one read of each page; the positions of those now hot."""
        now, half_life, heat, hot = self._clock(), self.half_life_s, self._heat, []
        with self._lock:
            for position, key in enumerate(keys):
                page = (ns_id, key)
                count, last = heat.pop(page, (0.0, now))
                count = count * 0.5 ** ((now - last) / half_life) + 1.0
                heat[page] = (count, now)   # moved to the end: the most recently read
                if count + 0.5 >= self.hot_reads:
                    hot.append(position)
            while len(heat) > self.pages_max:
                heat.popitem(last=False)
        return hot
