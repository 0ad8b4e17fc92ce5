"""Tenants on the NVMe tier and across a restart: pages come back to their own tenant only; and another
tenant's lookups of present keys are timed like misses (two distributions compared, no time threshold)."""

from __future__ import annotations

import math
import random
import signal
import time

import numpy as np
import pytest

from identities import Tokens
from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.channel import GrpcChannel
from kvstore_client.credentials import Credentials
from kvstore_client.proto import pb

PAGE = 16384
NS = Namespace(model="durable-tenant", page_bytes=PAGE)


@pytest.fixture
def tokens(tmp_path):
    return Tokens(tmp_path)


def nvme_pages(node, tokens) -> int:
    admin = GrpcChannel(node.address, 5, Credentials(token=tokens.ops)).call("Stats", pb.StatsRequest())
    return sum(t.pages for t in admin.tiers if t.tier == pb.NVME)


def test_pages_on_nvme_and_after_a_restart_stay_their_tenants(start_server, tokens, tmp_path):
    settings = {"auth.tokens_file": str(tokens.path), "nvme.enabled": "true", "nvme.paths": f"{tmp_path}/shard",
                "nvme.map_bytes": "64MiB"}
    keys = [f"d{i}" for i in range(4)]
    data = np.random.default_rng(3).integers(0, 256, (4, PAGE), dtype=np.uint8)
    first = start_server(settings)
    with KVStoreClient(first.address, token=tokens.alice) as alice:
        assert alice.put(NS, keys, data) == 4
    deadline = time.monotonic() + 20
    while nvme_pages(first, tokens) < 4:
        assert time.monotonic() < deadline, "pages never reached NVMe"
        time.sleep(0.05)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_server(settings)
    with KVStoreClient(second.address, token=tokens.bob) as bob:
        assert bob.lookup(NS, keys) == 0 and bob.get(NS, keys, np.zeros_like(data)) == 0
        assert bob.delete(NS, keys) == 0 and bob.clear(NS) == 0
        assert [(ns.tenant, ns.pages) for ns in bob.stats().namespaces] == [("bob", 0)]   # his own, empty
    with KVStoreClient(second.address, token=tokens.alice) as alice:
        assert [(ns.tenant, ns.pages) for ns in alice.stats().namespaces] == [("alice", 4)]
        assert alice.lookup(NS, keys) == 4
        out = np.zeros_like(data)
        assert alice.get(NS, keys, out, verify=True) == 4 and np.array_equal(out, data)   # promoted from NVMe


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with the tie correction)."""
    pooled = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        ties += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    n1, n2 = len(a), len(b)
    u = sum(r for r, (_, group) in zip(ranks, pooled) if group == 0) - n1 * (n1 + 1) / 2
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    z = (u - n1 * n2 / 2) / sigma
    return math.erfc(abs(z) / math.sqrt(2))


def timed_lookups(bob: GrpcChannel, ns_id: int, batches: list[list[bytes]]) -> list[float]:
    times = []
    for keys in batches:
        started = time.perf_counter()
        bob.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=keys))
        times.append(time.perf_counter() - started)
    return times


def test_another_tenants_lookups_of_present_keys_time_like_misses(start_server, tokens):
    node = start_server({"auth.tokens_file": str(tokens.path)})
    present = [f"p{i:011d}".encode() for i in range(64)]
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.put(NS, present, np.ones((64, PAGE), np.uint8)) == 64
    bob = GrpcChannel(node.address, 5, Credentials(token=tokens.bob))
    ns_id = bob.call("OpenNamespace", pb.OpenNamespaceRequest(spec=NS.to_proto())).namespace_id
    rng = random.Random(7)
    rounds = 300
    kinds = ["present"] * rounds + ["absent"] * rounds + ["long"] * rounds
    rng.shuffle(kinds)   # interleaved, so drift in the machine's load falls on every kind alike
    samples: dict[str, list[float]] = {"present": [], "absent": [], "long": []}
    timed_lookups(bob, ns_id, [present[:32]] * 50)   # warm-up
    for n, kind in enumerate(kinds):
        # fresh 12-byte keys for every kind, so no kind is served from a warmer cache
        count = 1024 if kind == "long" else 32
        keys = [bytes(bytearray(present[i])) if kind == "present" else f"{kind[0]}{n:05d}{i:06d}".encode()
                for i in range(count)]
        samples[kind] += timed_lookups(bob, ns_id, [keys])
    # The comparison can tell apart two paths that differ: 1024-key lookups from 32-key ones.
    assert mann_whitney_p(samples["absent"], samples["long"]) < 1e-6
    # bob's lookups of alice's present keys are the same as his misses (they are misses in his key space).
    assert mann_whitney_p(samples["present"], samples["absent"]) > 1e-3
