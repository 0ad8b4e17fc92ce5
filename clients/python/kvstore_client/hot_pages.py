"""Replication by popularity, the client's half: the pages nodes flagged hot, and which this client copied.

Each page of a cluster lives on the one node its key ranks best (placement.py), which keeps cold
pages single. A node counts the reads it serves per page, decayed over time, and flags a page
hot in its Acquire answer once it is read often (kvstore/control/read_heat.py). A cluster client
that loaded a flagged page writes it, from the bytes it just loaded (checked first against the
checksum the node gave: a copy carries a fresh one), to the page's other `replicas` best nodes
(a node that has it already answers PRESENT and nothing moves), and from then on reads it from
any of them, so a hot prefix's reads spread over R nodes instead of one. A replica that lost its copy (restarted empty, or evicted it) answers a miss and the read
goes on to the next; the page is copied again the next time a node flags it, so a lost copy is
repaired by the reads themselves.

Bounded: at most `keys_max` pages are remembered, the least recently flagged forgotten first
(forgetting costs one more copy round, answered PRESENT, when the page is flagged again).
"""

from __future__ import annotations

import collections
import random
import threading
from typing import Sequence

from kvstore_client.keys import Namespace

KEYS_MAX = 65536

# An entry's value: the page's checksum (never negative) while it waits to be copied, then COPIED; LOST_COPY
# once a replica missed it (restarted empty, or evicted it): copied again when a node next flags it.
COPIED, LOST_COPY = -1, -2


class HotPages:
    def __init__(self, keys_max: int = KEYS_MAX):
        self._keys_max = keys_max
        # (namespace, key) -> the checksum its node gave, until this client copied it: then COPIED
        self._pages: collections.OrderedDict[tuple[Namespace, bytes], int] = collections.OrderedDict()
        # Per namespace, how many of its entries wait to be copied and how many are copied (or lost a copy): a
        # read of a namespace with none of either asks nothing per key.
        self._waiting: collections.Counter[Namespace] = collections.Counter()
        self._spread: collections.Counter[Namespace] = collections.Counter()
        self._lock = threading.Lock()

    def flag(self, namespace: Namespace, pages: Sequence[tuple[bytes, int]]) -> None:
        """A node flagged these (key, checksum) pages hot (called from the threads of a call's pieces)."""
        with self._lock:
            for key, checksum in pages:
                page = (namespace, key)
                if self._pages.get(page) != COPIED:
                    self._set(page, checksum)
                self._pages.move_to_end(page)
            while len(self._pages) > self._keys_max:
                page, value = self._pages.popitem(last=False)
                (self._spread if value < 0 else self._waiting)[page[0]] -= 1

    def to_copy(self, namespace: Namespace, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """(position, checksum) of the keys flagged hot and not yet copied to their replicas."""
        with self._lock:
            if not self._waiting[namespace]:
                return []
            found = [(i, self._pages.get((namespace, key), COPIED)) for i, key in enumerate(keys)]
        return [(i, checksum) for i, checksum in found if checksum >= 0]

    def copied(self, namespace: Namespace, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                if (namespace, key) in self._pages:
                    self._set((namespace, key), COPIED)

    def lost_copy(self, namespace: Namespace, keys: Sequence[bytes]) -> None:
        """A replica missed these copied pages: copy them again the next time a node flags them."""
        with self._lock:
            for key in keys:
                if self._pages.get((namespace, key)) == COPIED:
                    self._set((namespace, key), LOST_COPY)

    def spread(self, namespace: Namespace, keys: Sequence[bytes]) -> list[int]:
        """Positions of the keys whose reads go to any of their replicas (copied there)."""
        with self._lock:
            if not self._spread[namespace]:
                return []
            return [i for i, key in enumerate(keys) if self._pages.get((namespace, key), 0) < 0]

    def _set(self, page: tuple[Namespace, bytes], value: int) -> None:
        """An entry's new value, its namespace's counts kept (the lock held)."""
        before = self._pages.get(page)
        if before is not None:
            (self._spread if before < 0 else self._waiting)[page[0]] -= 1
        (self._spread if value < 0 else self._waiting)[page[0]] += 1
        self._pages[page] = value


def rotated(owners: tuple[str, ...], rng: random.Random) -> tuple[str, ...]:
    """The same nodes, starting at a random one: a hot page's reads spread over its replicas."""
    start = rng.randrange(len(owners))
    return owners[start:] + owners[:start]
