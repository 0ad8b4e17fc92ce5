"""One subscription over every node of a cluster: each node's page events, rebuilt per node, and its membership."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cluster_parts import etcd, start_node, wait_members  # noqa: F401
from kvstore_client.cluster import KVStoreCluster
from kvstore_client.keys import Namespace, encode_keys, namespace_id, prefix_hashes

pytest.importorskip("zmq", reason="the events extra (pyzmq, msgspec) is part of the test install")
from kvstore_client.cluster_events import ClusterInventory  # noqa: E402

NS = Namespace(model="cluster-events", page_bytes=4096, page_tokens=4)


def chain(seed: int, pages: int) -> tuple[list[bytes], np.ndarray]:
    tokens = [seed] + list(range(4 * pages - 1))
    return prefix_hashes(tokens, page_tokens=4), np.random.default_rng(seed).integers(0, 255, (pages, 4096), np.uint8)


def test_one_subscription_follows_every_node_and_the_membership(start_node, etcd, tmp_path):
    cluster = "events"

    def node(name: str):
        return start_node(name, cluster=cluster, **{"events_out.enabled": "true",
                                                     "events_out.endpoint": f"ipc://{tmp_path}/{name}.pub",
                                                     "events_out.replay_endpoint": f"ipc://{tmp_path}/{name}.replay"})

    nodes = {name: node(name) for name in ("n1", "n2", "n3")}
    ns_id = namespace_id(NS)
    with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}") as pool, ClusterInventory(pool, [NS]) as events:
        wait_members(pool, set(nodes))

        def settled(members: set[str], timeout_s: float = 20.0) -> dict[str, dict[bytes, set[str]]]:
            """Poll until the subscription holds exactly what each member's ListPages says, page for page."""
            deadline = time.monotonic() + timeout_s
            while True:
                events.poll(100)
                seen = {n: inventory.get(ns_id, {}) for n, inventory in events.inventory().items()}
                truth = {n: snapshot.tiers() for n, snapshot in pool.node_list_pages(NS).items()}
                if set(seen) == members and seen == {n: truth.get(n) for n in members}:
                    return seen
                if time.monotonic() > deadline:
                    raise AssertionError(f"the subscription never matched the nodes: {set(seen)} vs {members}")

        keys, data = chain(1, 48)
        assert pool.put(NS, keys, data) == 48
        seen = settled({"n1", "n2", "n3"})
        assert sum(len(pages) for pages in seen.values()) == 48 and all(seen.values())   # spread, each page once
        assert [(n, change) for _, n, change in events.membership()] == [(n, "joined") for n in ("n1", "n2", "n3")]

        nodes["n2"].kill()                                   # SIGKILL: its record goes with its lease
        wait_members(pool, {"n1", "n3"})
        settled({"n1", "n3"})
        nodes["n4"] = node("n4")
        wait_members(pool, {"n1", "n3", "n4"})
        more, more_data = chain(2, 32)
        assert pool.put(NS, more, more_data) == 32
        seen = settled({"n1", "n3", "n4"})
        assert seen["n4"]                                    # pages written to the new member, seen from its stream
        assert set(encode_keys(more)) <= {key for pages in seen.values() for key in pages}
        assert [(n, change) for _, n, change in events.membership()][3:] == [("n2", "left"), ("n4", "joined")]
