"""Which arena memory another process can write, and the reads this node vouches for meanwhile.

A get hashes each page it receives and compares it with the page's commit checksum, because a
client of the tenant with the arena mapped (shared memory) could have changed the slot after
its commit. Where no other process has ever been able to write the memory, only this node wrote
the slot: its bytes are those committed (the node hashed them as they landed, or checked them
against their checksum as they came back from NVMe), and a TCP reader need not hash them again.
That read is *vouched* (tcp_framing.VOUCHED), and lands unhashed: on loopback with client and
node on one core, 1 MiB gets went from 0.70 to 0.82 of a raw socket's pace.

An arena key (one tenant's memfd, or the one memfd all tenants share) is *exposed* from just
before its memfd first goes to a local client (local_server.py, MAP_ARENA) and for the rest of
the node's life; every key is exposed from the start where RDMA is on (remote writes reach the
arena). Exposing a key waits for its vouched reads still being sent (a GET answer is held until
the kernel has taken its bytes, tcp.py), so no byte of a vouched read can change under it.

A part of PageStore (store.py), which owns the state and the one lock these methods take.
"""

from __future__ import annotations

import collections
import threading
import time


class Exposure:
    """Exposed arena keys, and the vouched reads in flight of the others."""

    def _init_exposure(self, all_exposed: bool) -> None:
        self._exposed: set[str] = set()
        self._all_exposed = all_exposed
        self._vouched: collections.Counter[str] = collections.Counter()   # arena key -> reads in flight
        self._unvouched = threading.Condition(self._lock)   # a key's last vouched read in flight ended

    def expose(self, tenant: str, wait_s: float) -> bool:
        """Stop vouching for the memory of the tenant's memfd, for good, and wait up to `wait_s` for its
        vouched reads still in flight. False: some still are (a reader that stopped reading holds its grant
        until its lease's deadline); the memfd must not go out yet."""
        key, deadline = self.arena.key(tenant), time.monotonic() + wait_s
        with self._lock:
            self._exposed.add(key)
            while self._vouched[key]:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._unvouched.wait(left)
            return True

    def _vouch(self, tenant: str) -> bool:
        """Whether a read of the tenant's memory starting now is vouched; if so, it counts until _unvouch."""
        key = self.arena.key(tenant)
        if self._all_exposed or key in self._exposed:
            return False
        self._vouched[key] += 1
        return True

    def _unvouch(self, tenant: str) -> None:
        key = self.arena.key(tenant)
        self._vouched[key] -= 1
        assert self._vouched[key] >= 0, "a vouched read ended twice"
        if not self._vouched[key]:
            del self._vouched[key]
            self._unvouched.notify_all()
