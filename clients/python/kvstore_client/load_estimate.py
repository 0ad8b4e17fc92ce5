"""Fetch or recompute: how long loading a prompt's cached prefix would take, and how much of it is worth loading.

A hit is worth loading only if loading it is faster than prefilling its tokens again. The estimate adds:
- the node's recent cost per page of each tier (an Acquire's pinning, and a promotion from NVMe:
  kvstore/control/load_rates.py), carried by a residency answer;
- this client's recent data-plane rate (the bytes its gets moved per second, copy or wire), measured on its
  own gets (TransferRate), and the round trip the residency question itself took.
pages_worth_loading weighs that against the engine's own prefill cost per token and answers the leading
pages that save the most time; 0 when loading any of them is slower than recomputing them. Where nothing has
been measured yet (a fresh node or client) a cost counts as 0: loading is assumed to pay, as before any
estimate existed, and the first gets measure it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Mapping

import numpy as np

from kvstore_client.proto import pb

HALF_LIFE_S = 30.0


class TransferRate:
    """A connection's recent data-plane rate: bytes its gets moved over the seconds they took, both decayed with
    a half-life, so the last half minute counts most."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, clock=time.monotonic):
        self._half_life_s, self._clock = half_life_s, clock
        self._lock = threading.Lock()
        self._bytes = self._seconds = 0.0
        self._when = clock()

    def moved(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            now = self._clock()
            keep = math.exp2(-(now - self._when) / self._half_life_s)
            self._bytes, self._seconds, self._when = self._bytes * keep + nbytes, self._seconds * keep + seconds, now

    def bytes_per_s(self) -> float:
        """0 where nothing moved yet."""
        with self._lock:
            return self._bytes / self._seconds if self._seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class LoadCosts:
    """What loading pages costs now: per tier on the node, then this client's plane and round trip."""

    seconds_per_page: Mapping[int, float]   # a Tier -> the node's recent seconds a page (0 where not measured)
    plane_bytes_per_s: float                # 0: not measured
    round_trip_s: float

    def cumulative(self, tiers: bytes, page_bytes: int) -> np.ndarray:
        """Seconds to load the first k pages, for k = 1 .. len(tiers) (each page's tier in `tiers`)."""
        node = np.zeros(256)
        for tier, seconds in self.seconds_per_page.items():
            node[tier] = seconds
        if pb.NVME in self.seconds_per_page:   # a page on NVMe is promoted, then pinned in DRAM as any other
            node[pb.NVME] += self.seconds_per_page.get(pb.DRAM, 0.0)
        plane = page_bytes / self.plane_bytes_per_s if self.plane_bytes_per_s > 0 else 0.0
        per_page = node[np.frombuffer(tiers, dtype=np.uint8)] + plane
        return self.round_trip_s + np.cumsum(per_page)


NO_COSTS = LoadCosts({}, 0.0, 0.0)   # nothing measured: loading counts as free


def pages_worth_loading(tiers: bytes, costs: LoadCosts, page_bytes: int, page_tokens: int,
                        recompute_s_per_token: float) -> int:
    """The leading pages whose loading saves the most time against prefilling their tokens; 0 when none saves
    any (every prefix is slower to load than to recompute)."""
    if recompute_s_per_token <= 0:   # no prefill cost given: everything is worth loading
        return len(tiers)
    if not tiers:
        return 0
    pages = np.arange(1, len(tiers) + 1)
    saved = pages * page_tokens * recompute_s_per_token - costs.cumulative(tiers, page_bytes)
    best = int(np.argmax(saved))
    return best + 1 if saved[best] > 0 else 0
