"""Follow every node of a cluster: one inventory of the pool, per node, namespace and tier, kept from their events.

    with KVStoreCluster("etcd://10.0.0.1:2379/prod") as pool:
        events = ClusterInventory(pool, [ns])
        while serving:
            events.poll(100)
            events.inventory()        # node id -> namespace id -> key -> {"CPU", "DISK"}
            events.membership()       # [(time, node id, "joined" | "left")], oldest first

Each node publishes its own page event stream (events_out) and names it in its cluster
record (Member.events_endpoint). This keeps one StoreInventory (events.py: snapshot, stream,
replay, no gap) per serving member that publishes, through that member's own client of the
cluster (so the snapshots it takes are the tenant's). The membership is read on each poll: a
member that joins is followed from a snapshot of its own; one that leaves, or whose record
now names another stream (it restarted elsewhere), is dropped with its pages, and each change
is noted in membership(). A member that cannot be followed yet (it does not answer, or
publishes nothing) is tried again on the next poll. Not thread-safe: one thread calls poll().
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from kvstore_client import errors
from kvstore_client.events import StoreInventory
from kvstore_client.keys import Namespace

log = logging.getLogger(__name__)

CHANGES_MAX = 10_000     # membership changes kept, oldest dropped first


class ClusterInventory:
    def __init__(self, cluster: Any, namespaces: Sequence[Namespace], decode: Callable[[bytes], Any] | None = None,
                 replay_timeout_ms: int = 5_000):
        """`cluster`: a KVStoreCluster of the tenant; `decode` as StoreInventory's."""
        if not namespaces:
            raise errors.InvalidArgument("ClusterInventory needs at least one namespace to follow")
        self.cluster = cluster
        self.namespaces = list(namespaces)
        self._decode = decode
        self._replay_timeout_ms = replay_timeout_ms
        self._followed: dict[str, tuple[tuple[str, str], StoreInventory]] = {}   # node id -> (endpoints, inventory)
        self._members: set[str] = set()    # noted as joined and not since as left
        self._changes: list[tuple[float, str, str]] = []

    def poll(self, timeout_ms: int) -> int:
        """Follow the membership, then apply the batches each node's stream brings within about `timeout_ms`
        (split over the nodes); returns how many were applied."""
        self._follow_members()
        if not self._followed:
            time.sleep(timeout_ms / 1000)
            return 0
        share = max(1, timeout_ms // len(self._followed))
        applied = 0
        for node_id, (_, inventory) in list(self._followed.items()):
            try:
                applied += inventory.poll(share)
            except errors.KVStoreError as exc:   # its snapshot could not be taken: dropped, followed again later
                log.info("store events of node %s: %s; following it again from a snapshot", node_id, exc)
                self._drop(node_id, noted=False)
        return applied

    def inventory(self) -> dict[str, dict[int, dict[bytes, set[str]]]]:
        """node id -> namespace id -> key -> mediums ("CPU": its DRAM, "DISK": its NVMe), a copy."""
        return {node_id: inventory.inventory() for node_id, (_, inventory) in self._followed.items()}

    def membership(self) -> list[tuple[float, str, str]]:
        """(unix time, node id, "joined" or "left") of each change seen, oldest first."""
        return list(self._changes)

    def close(self) -> None:
        for node_id in list(self._followed):
            self._drop(node_id, noted=False)

    def __enter__(self) -> "ClusterInventory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _follow_members(self) -> None:
        serving = {m.node_id: (m.events_endpoint, m.events_replay_endpoint)
                   for m in self.cluster.members() if m.state == "serving" and m.events_endpoint}
        for node_id, (endpoints, _) in list(self._followed.items()):
            if serving.get(node_id) != endpoints:
                self._drop(node_id, noted=True)
        for node_id in self._members - set(serving):   # left while it could not be followed
            self._note(node_id, "left")
        for node_id, endpoints in serving.items():
            if node_id not in self._followed:
                self._start(node_id, endpoints)

    def _start(self, node_id: str, endpoints: tuple[str, str]) -> None:
        inventory = StoreInventory(self.cluster.node_client(node_id), self.namespaces, endpoints[0], endpoints[1],
                                   decode=self._decode, replay_timeout_ms=self._replay_timeout_ms)
        try:
            inventory.start()
        except errors.KVStoreError as exc:
            inventory.close()
            log.info("store events of node %s cannot be followed yet: %s", node_id, exc)
            return
        self._followed[node_id] = (endpoints, inventory)
        if node_id not in self._members:
            self._note(node_id, "joined")

    def _drop(self, node_id: str, noted: bool) -> None:
        _, inventory = self._followed.pop(node_id)
        inventory.close()
        if noted:
            self._note(node_id, "left")

    def _note(self, node_id: str, change: str) -> None:
        (self._members.add if change == "joined" else self._members.discard)(node_id)
        self._changes.append((time.time(), node_id, change))
        del self._changes[:-CHANGES_MAX]
