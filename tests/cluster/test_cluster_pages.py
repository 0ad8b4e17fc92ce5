"""Three real nodes in a real etcd, as one pool: any client gets what any other put; a killed node costs only misses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from typing import AsyncIterator

import numpy as np
import pytest

from cluster_parts import etcd, first_page_on, start_node, wait_members  # noqa: F401
from kvstore.admin import cli
from kvstore_client import AsyncKVStoreClient, KVStoreClient, errors
from kvstore_client.cluster import KVStoreCluster
from kvstore_client.etcd import EtcdSession
from kvstore_client.keys import Namespace, encode_keys, prefix_hashes
from kvstore_client.membership import Member, node_key
from kvstore_client.placement import placeable, rank

PAGE_BYTES = 4096
NS = Namespace(model="cluster-test", page_bytes=PAGE_BYTES, page_tokens=4)


def chain(seed: int, pages: int) -> tuple[list[bytes], np.ndarray]:
    tokens = random.Random(seed).choices(range(32000), k=4 * pages)
    data = np.random.default_rng(seed).integers(0, 255, (pages, PAGE_BYTES), dtype=np.uint8)
    return prefix_hashes(tokens, page_tokens=4), data


@pytest.fixture
def three_nodes(start_node, request):
    """Three nodes in a cluster of the test's own (a SIGKILLed node's id stays taken for a lease TTL)."""
    cluster = request.node.name.removeprefix("test_")[:40]
    return cluster, {name: start_node(name, cluster=cluster) for name in ("n1", "n2", "n3")}


def test_pages_put_through_one_client_are_got_through_another(three_nodes, etcd):
    cluster, three_nodes = three_nodes
    url = f"etcd://{etcd.endpoint}/{cluster}"
    with KVStoreClient(url, replicas=2) as writer, KVStoreClient(url, transport="tcp", replicas=2) as reader:
        wait_members(writer, set(three_nodes))
        wait_members(reader, set(three_nodes))
        chains = [chain(seed, 24) for seed in range(6)]
        for keys, data in chains:
            assert writer.put(NS, keys, data) == 24
        for keys, data in chains:
            assert reader.lookup(NS, keys) == 24
            out = np.zeros_like(data)
            assert reader.get(NS, keys, out) == 24
            assert np.array_equal(out, data)
        assert all(client.transport == "tcp" for _, client in reader._nodes.values())
        holding = {node: sum(t.pages for t in answer.tiers) for node, answer in reader.node_stats().items()}
        assert set(holding) == set(three_nodes) and all(holding.values())   # spread over every node
        keys, data = chains[0]
        assert sum(t.pages for t in reader.stats().tiers) == sum(holding.values())   # the members' sum
        assert reader.delete(NS, keys[:1]) >= 24           # the page and every page after it, on every node
        assert writer.lookup(NS, keys) == 0
        assert writer.held(NS, keys) == [False] * 24


def test_cluster_status_lists_every_member_with_its_pages(three_nodes, etcd, capsys):
    cluster, three_nodes = three_nodes
    url = f"etcd://{etcd.endpoint}/{cluster}"
    with KVStoreCluster(url) as client:
        wait_members(client, set(three_nodes))
        keys, data = chain(3, 40)
        assert client.put(NS, keys, data) == 40
    three_nodes["n2"].terminate()                # drains, then leaves: etcd forgets it
    assert cli.main(["--json", "cluster", "status", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["etcd_reachable"]
    assert {m["node_id"] for m in report["members"]} == {"n1", "n3"}
    assert all(m["state"] == "serving" and m["answers"] and m["weight_percent"] == 100 for m in report["members"])
    assert sum(m["pages"] for m in report["members"]) > 0
    assert cli.main(["cluster", "status", url]) == 0
    assert "n1" in capsys.readouterr().out


def test_killing_a_node_under_four_clients_loses_only_its_pages(three_nodes, etcd):
    cluster, three_nodes = three_nodes
    url = f"etcd://{etcd.endpoint}/{cluster}"
    chains = [chain(100 + seed, 12) for seed in range(24)]
    with KVStoreCluster(url, replicas=1) as loader:
        wait_members(loader, set(three_nodes))
        for keys, data in chains:
            assert loader.put(NS, keys, data) == 12
        survives = [first_page_on(loader, keys, "n3") for keys, _ in chains]   # each chain up to its first on n3
    assert 0 < sum(survives) < 12 * len(chains)

    failures: list[BaseException] = []
    outcomes: list[tuple[int, int]] = []
    stop = threading.Event()

    def work(worker: int) -> None:
        with KVStoreCluster(url, replicas=1, transport="tcp" if worker % 2 else "auto") as c:
            rng = random.Random(worker)
            while not stop.is_set():
                index = rng.randrange(len(chains))
                keys, data = chains[index]
                out = np.zeros_like(data)
                try:
                    loaded = c.get(NS, keys, out)
                    assert np.array_equal(out[:loaded], data[:loaded])
                    outcomes.append((index, loaded))
                    c.put(NS, *chain(10_000 + rng.randrange(10**6), 8))
                except errors.Unavailable:
                    pass              # the one typed error a lost node may cost
                except BaseException as exc:   # anything else fails the test
                    failures.append(exc)
                    return

    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    three_nodes["n3"].kill()                    # SIGKILL, under load
    time.sleep(4.0)                             # past the 2 s lease: n3 leaves every view
    stop.set()
    for w in workers:
        w.join(60)
    assert not failures, failures
    with KVStoreCluster(url, replicas=1) as after:
        wait_members(after, {"n1", "n2"})
        for (keys, data), kept in zip(chains, survives):
            out = np.zeros_like(data)
            assert after.get(NS, keys, out) == kept          # n3's pages are misses; nothing else is lost
            assert np.array_equal(out[:kept], data[:kept])
        # New writes land on the two that remain.
        keys, data = chain(7, 12)
        assert after.put(NS, keys, data) == 12 and after.get(NS, keys, np.zeros_like(data)) == 12
    assert len(outcomes) > 20


def test_a_new_node_takes_load_gradually(start_node, etcd):
    for name in ("r1", "r2"):
        start_node(name, cluster="p2")
    with KVStoreCluster(f"etcd://{etcd.endpoint}/p2", replicas=1) as cluster:
        wait_members(cluster, {"r1", "r2"})
        stored_keys, data = chain(61, 600)
        assert cluster.put(NS, stored_keys, data) == 600            # on r1 and r2 alone
        start_node("r3", cluster="p2", **{"cluster.ramp_s": 6})
        wait_members(cluster, {"r1", "r2", "r3"})
        keys = [random.Random(i).randbytes(16) for i in range(3000)]
        weights = placeable(cluster.members(), time.time())
        moved = [k for k in encode_keys(stored_keys) if rank(k, weights, 1) == ("r3",)]
        out = np.zeros_like(data)
        assert moved and cluster.get(NS, stored_keys, out) == 600   # r3 misses them: read where they were
        assert np.array_equal(out, data)

        def share() -> float:
            weights = placeable(cluster.members(), time.time())
            return sum(rank(k, weights, 1) == ("r3",) for k in keys) / len(keys)

        early = share()
        time.sleep(6.5)
        late = share()
    assert early < 0.2           # near RAMP_FLOOR's share at first
    assert 0.25 < late < 0.42    # then its full third


def test_a_chain_stored_chunk_by_chunk_is_waited_for_and_got_whole(three_nodes, etcd):
    cluster, three_nodes = three_nodes
    url = f"etcd://{etcd.endpoint}/{cluster}"
    keys, data = chain(11, 40)
    with KVStoreCluster(url) as prefill, KVStoreCluster(url, transport="tcp") as decode:
        wait_members(prefill, set(three_nodes))
        wait_members(decode, set(three_nodes))
        out = np.zeros_like(data)
        waiting = threading.Thread(target=lambda: outcomes.append(decode.get(NS, keys, out, wait_ms=10_000)))
        outcomes: list[int] = []
        waiting.start()
        for start in range(0, 40, 6):            # chunk by chunk, each after the one before
            stop = min(start + 6, 40)
            parent = keys[start - 1] if start else None
            assert prefill.put(NS, keys[start:stop], data[start:stop], parent=parent) == stop - start
            time.sleep(0.02)
        waiting.join(30)
        assert outcomes == [40]
        assert np.array_equal(out, data)
        tail = np.zeros_like(data[13:])
        assert decode.get(NS, keys[13:], tail) == 27                  # the rest of a chain, from its middle
        assert np.array_equal(tail, data[13:])


def test_lookup_by_tokens_hashes_them_as_a_put_by_keys_did(three_nodes, etcd):
    cluster, three_nodes = three_nodes
    with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}", replicas=1) as client:
        wait_members(client, set(three_nodes))
        tokens = random.Random(7).choices(range(32000), k=4 * 20)
        data = np.random.default_rng(7).integers(0, 255, (20, PAGE_BYTES), dtype=np.uint8)
        assert client.put(NS, prefix_hashes(tokens, page_tokens=4), data) == 20
        assert client.lookup(NS, tokens=tokens) == 20
        assert client.lookup(NS, tokens=np.array(tokens + [1, 2], dtype=np.int64)) == 20   # a partial page is no page
        assert client.lookup(NS, tokens=tokens[:4 * 9]) == 9
        assert client.lookup(NS, tokens=tokens[:3]) == 0
        assert client.lookup(NS, tokens=[5] + tokens[1:]) == 0                            # another chain from page 0
        with pytest.raises(errors.InvalidArgument, match="exactly one|one of"):
            client.lookup(NS, keys=prefix_hashes(tokens, page_tokens=4), tokens=tokens)
        with pytest.raises(errors.InvalidArgument, match="page_tokens"):
            client.lookup(Namespace(model="cluster-test", page_bytes=PAGE_BYTES), tokens=tokens)


def test_a_replica_that_misses_a_page_is_read_from_the_next(three_nodes, etcd):
    cluster, nodes = three_nodes
    with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}", replicas=3, replicated_pages=8) as pool:
        wait_members(pool, set(nodes))
        keys, data = chain(7, 8)                       # a chain's first put: each page on all three nodes
        assert pool.put(NS, keys, data) == 8
        owners = pool._place(encode_keys(keys), chain_start=True)
        assert all(sorted(o) == sorted(nodes) for o in owners)
        best = owners[0][0]
        assert pool._node(best).delete(NS, keys[:1]) == 8        # the best replica of page 0 loses the chain
        for _ in range(5):
            out = np.zeros_like(data)
            assert pool.get(NS, keys, out) == 8 and np.array_equal(out, data)
        assert pool.lookup(NS, keys) == 8
        nodes[owners[0][1]].kill()                     # and with the next replica gone too
        for _ in range(5):
            out = np.zeros_like(data)
            assert pool.get(NS, keys, out) == 8 and np.array_equal(out, data)


def test_a_replica_that_misses_one_page_still_serves_the_later_ones_it_holds(three_nodes, etcd):
    cluster, nodes = three_nodes
    with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}", replicas=3, replicated_pages=1) as pool:
        wait_members(pool, set(nodes))
        for seed in range(100, 300):   # a chain whose page 0's best replica also holds a later page alone
            keys, data = chain(seed, 12)
            owners = pool._place(encode_keys(keys), chain_start=True)
            best = owners[0][0]
            if owners[1] != (best,) and (best,) in owners[2:]:
                break
        assert pool.put(NS, keys, data) == 12
        assert pool._node(best).delete(NS, keys[:1]) == 1       # that replica loses page 0 only
        out = np.zeros_like(data)
        assert pool.get(NS, keys, out) == 12 and np.array_equal(out, data)   # page 0 from another replica
        assert pool.lookup(NS, keys) == 12


def test_a_delete_removes_every_page_that_extends_the_key_on_every_node(three_nodes, etcd):
    cluster, nodes = three_nodes
    with KVStoreClient(f"etcd://{etcd.endpoint}/{cluster}") as pool:
        wait_members(pool, set(nodes))
        keys, data = chain(21, 64)
        assert pool.put(NS, keys[:40], data[:40]) == 40
        assert pool.put(NS, keys[40:], data[40:], parent=keys[39]) == 24     # a second call, after the first
        other, other_data = chain(22, 16)
        assert pool.put(NS, other, other_data) == 16
        owners = [o[0] for o in pool._place(encode_keys(keys), chain_start=False)]
        assert len(set(owners[32:])) == 3                                    # the tail is spread over all three
        assert pool.delete(NS, keys[32:33]) == 32                            # page 32 and the 31 after it
        assert pool.held(NS, keys) == [True] * 32 + [False] * 32             # on every node
        assert pool.get(NS, keys[48:], np.zeros_like(data[48:])) == 0        # mid-chain reads find nothing
        listed = set(pool.list_keys(NS))
        assert listed.isdisjoint(encode_keys(keys[32:])) and listed.issuperset(encode_keys(keys[:32]))
        assert pool.lookup(NS, keys) == 32 and pool.get(NS, keys, np.zeros_like(data)) == 32
        assert pool.lookup(NS, other) == 16                                  # another chain keeps every page
        assert pool.delete(NS, keys[32:33]) == 0


def test_page_groups_commit_and_answer_whole_positions_across_nodes(three_nodes, etcd):
    from kvstore_client.groups import GroupPart
    cluster, nodes = three_nodes
    sidecar = Namespace(model="cluster-test-state", page_bytes=512, page_tokens=4)
    with KVStoreClient(f"etcd://{etcd.endpoint}/{cluster}") as pool:
        wait_members(pool, set(nodes))
        keys, data = chain(31, 40)
        states = np.random.default_rng(31).integers(0, 255, (40, 512), dtype=np.uint8)
        assert pool.put_group(keys, [(NS, data), (sidecar, states)]) == 40
        parts = [GroupPart(NS), GroupPart(sidecar, "trailing_pages", 1)]
        hits = pool.lookup_group(keys, parts)
        assert hits.hit_pages == 40 and hits.restorable_pages == list(range(1, 41))
        out, out_states = np.zeros_like(data), np.zeros_like(states)
        assert pool.get_group([(NS, keys, out), (sidecar, keys, out_states)]) == [40, 40]
        assert np.array_equal(out, data) and np.array_equal(out_states, states)
        owner = pool._place(encode_keys(keys[39:]), chain_start=False)[0][0]
        assert pool._node(owner).delete(sidecar, keys[39:]) == 1            # the last state page is lost
        hits = pool.lookup_group(keys, parts)
        assert hits.hit_pages == 39 and hits.restorable_pages == list(range(1, 40))
        assert pool.get_group([(NS, keys, out), (sidecar, keys, out_states)]) == [39, 39]
        staged = pool.stage(NS, keys[:4], data[:4])
        pool.abort_staged([staged])                                          # staged on their nodes, given up
        assert pool.lookup(NS, keys) == 40


def test_a_group_read_asks_the_next_replica_where_one_misses_or_is_lost(three_nodes, etcd):
    cluster, nodes = three_nodes
    sidecar = Namespace(model="cluster-test-state", page_bytes=512, page_tokens=4)
    with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}", replicas=3, replicated_pages=8) as pool:
        wait_members(pool, set(nodes))
        keys, data = chain(33, 8)                            # a chain's first put: each position on all three
        states = np.random.default_rng(33).integers(0, 255, (8, 512), dtype=np.uint8)
        assert pool.put_group(keys, [(NS, data), (sidecar, states)]) == 8
        owners = pool._place(encode_keys(keys), chain_start=True)
        best = owners[0][0]
        assert pool._node(best).delete(sidecar, keys[:1]) == 8      # the best node of position 0 loses a part
        out, out_states = np.zeros_like(data), np.zeros_like(states)
        assert pool.get_group([(NS, keys, out), (sidecar, keys, out_states)]) == [8, 8]
        assert np.array_equal(out, data) and np.array_equal(out_states, states)
        nodes[owners[0][1]].kill()                           # and the next replica of position 0 is lost
        out, out_states = np.zeros_like(data), np.zeros_like(states)
        assert pool.get_group([(NS, keys, out), (sidecar, keys, out_states)]) == [8, 8]
        assert np.array_equal(out, data) and np.array_equal(out_states, states)


@contextlib.asynccontextmanager
async def async_pool(url: str, nodes: dict) -> AsyncIterator:
    """AsyncKVStoreClient of the cluster URL, once a client's view holds every node."""
    async with AsyncKVStoreClient(url, timeout_s=5) as pool:
        with KVStoreCluster(url) as watcher:
            wait_members(watcher, set(nodes))
        yield pool


def test_the_async_client_of_a_cluster_url_has_the_same_calls(three_nodes, etcd):
    cluster, nodes = three_nodes
    keys, data = chain(41, 20)

    async def run() -> None:
        async with async_pool(f"etcd://{etcd.endpoint}/{cluster}", nodes) as pool:
            stored = await pool.put(NS, keys, data)
            assert stored == 20 and stored.complete
            out = np.zeros_like(data)
            assert await pool.get(NS, keys, out) == 20 and np.array_equal(out, data)
            assert await pool.lookup(NS, keys) == 20
            assert await pool.held(NS, keys[::2]) == [True] * 10
            assert sum(t.pages for t in (await pool.stats()).tiers) >= 20
            assert await pool.delete(NS, keys[:1]) >= 20
            assert await pool.lookup(NS, keys) == 0

    asyncio.run(run())


def test_a_cancelled_async_cluster_get_ends_only_when_it_stopped_writing_the_buffer(three_nodes, etcd):
    cluster, nodes = three_nodes
    keys, data = chain(42, 8)

    async def run() -> None:
        async with async_pool(f"etcd://{etcd.endpoint}/{cluster}", nodes) as pool:
            out = np.zeros_like(data)
            reading = asyncio.create_task(pool.get(NS, keys, out, wait_ms=10_000))
            await asyncio.sleep(0.3)
            reading.cancel()                                          # while the get waits for the pages
            await asyncio.sleep(0.3)
            assert not reading.done()                                 # its thread still holds `out`
            assert await pool.put(NS, keys, data) == 8                # the get now copies the pages in
            with pytest.raises(asyncio.CancelledError):
                await reading
            assert np.array_equal(out, data)                          # copied before the cancellation came

    asyncio.run(run())


def test_route_asks_every_member(three_nodes, etcd):
    cluster, nodes = three_nodes
    # Every page on every node, so each node's own score sees the whole prefix in its store (a node scores
    # only the store pages it holds itself: a prefix spread over nodes counts less; see route()).
    with KVStoreClient(f"etcd://{etcd.endpoint}/{cluster}", replicated_pages=8) as pool:
        wait_members(pool, set(nodes))
        keys, data = chain(51, 8)
        assert pool.put(NS, keys, data) == 8
        answer = pool.route(NS, ["engine-a", "engine-b"], keys=keys)
        assert [s.engine_id for s in answer.scores] == ["engine-a", "engine-b"]
        assert all(s.prefix_pages == 8 and s.dram_pages == 8 for s in answer.scores)   # from this store
        assert answer.best_engine_id == "engine-a"


def test_a_page_read_often_is_copied_to_its_replicas_and_read_from_any(start_node, etcd):
    cluster = "hot-pages"
    nodes = {name: start_node(name, cluster=cluster, **{"cluster.hot_reads": 3}) for name in ("n1", "n2", "n3")}
    with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}", replicas=3) as pool:
        wait_members(pool, set(nodes))
        hot, data = chain(31, 16)
        cold, cold_data = chain(32, 16)
        assert pool.put(NS, hot, data) == 16 and pool.put(NS, cold, cold_data) == 16

        def copies(keys: list) -> list[int]:
            held = [pool._node(n).held(NS, keys) for n in sorted(nodes)]
            return [sum(column) for column in zip(*held)]

        assert copies(hot) == [1] * 16 and copies(cold) == [1] * 16      # each page on its best node alone
        for reads in range(3):
            assert copies(hot) == [1] * 16                               # not read often enough yet
            out = np.zeros_like(data)
            assert pool.get(NS, hot, out) == 16 and np.array_equal(out, data)
        assert copies(hot) == [3] * 16                                   # the third read: on all three nodes
        assert pool.get(NS, cold, np.zeros_like(cold_data)) == 16
        assert copies(cold) == [1] * 16                                  # read once: still single

        def hits() -> dict[str, int]:
            return {n: sum(t.hits for t in answer.tiers) for n, answer in pool.node_stats().items()}

        before = hits()
        for _ in range(30):
            out = np.zeros_like(data[:1])
            assert pool.get(NS, hot[:1], out) == 1 and np.array_equal(out, data[:1])
        after = hits()
        assert all(after[n] > before[n] for n in nodes), (before, after)   # one page, read from every node

        victim = sorted(nodes)[0]
        assert pool._node(victim).delete(NS, hot[:1]) == 16                # one replica loses its copies
        for _ in range(40):
            out = np.zeros_like(data)
            assert pool.get(NS, hot, out) == 16 and np.array_equal(out, data)
        assert copies(hot) == [3] * 16               # repaired by the reads: a miss there, then a flag, a copy

        best = pool._place(encode_keys(hot[:1]), chain_start=False)[0][0]
        nodes[best].kill()                                               # its best node lost: still every page
        for _ in range(5):
            out = np.zeros_like(data)
            assert pool.get(NS, hot, out) == 16 and np.array_equal(out, data)
        assert pool.delete(NS, hot[:1]) >= 32                            # each copy on both live nodes
        assert [pool._node(n).held(NS, hot) for n in sorted(nodes) if n != best] == [[False] * 16] * 2


def test_residency_names_each_pages_tier_and_node_and_each_engines_prefix(start_node, etcd, tmp_path):
    """One call across the cluster: the leading pages held, each read from its node's tier, and the prefix each
    engine holds (from the events the node following it heard); a killed node ends the store's run."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm_publisher import BLOCK, FakeEngine

    kv_cache_utils.init_none_hash(sha256_cbor)
    engines = [FakeEngine(tmp_path, "e1"), FakeEngine(tmp_path, "e2", int_hashes=False)]
    follows = {"events.engine_ids": "e1,e2", "events.endpoints": ",".join(e.endpoint for e in engines),
               "events.replay_endpoints": ",".join(e.replay for e in engines)}
    cluster = "residency"
    nodes = {name: start_node(name, cluster=cluster, **(follows if name == "n1" else {})) for name in ("n1", "n2", "n3")}
    ns = Namespace(model="residency", page_bytes=PAGE_BYTES, page_tokens=BLOCK)
    tokens = random.Random(5).choices(range(32000), k=96 * BLOCK)
    keys = prefix_hashes(tokens, page_tokens=BLOCK)
    try:
        engines[0].prefill(tokens)
        engines[1].prefill(tokens[:40 * BLOCK])
        with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}", replicas=1) as pool:
            wait_members(pool, set(nodes))
            assert pool.put(ns, keys[:64], np.zeros((64, PAGE_BYTES), np.uint8)) == 64
            placed = [nodes_of[0] for nodes_of in pool._place(encode_keys(keys[:64]), chain_start=True)]
            deadline = time.monotonic() + 20
            while True:
                answer = pool.residency(ns, tokens=tokens, engine_ids=["e1", "e2", "e3"])
                if answer.engines["e2"].gpu_pages == 40 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert answer.pages == 64 and answer.tier_pages()["dram"] == 64
            assert list(answer.nodes) == placed and len(answer.node_pages()) == 3
            assert {e: (h.gpu_pages, h.held_pages) for e, h in answer.engines.items()} == {
                "e1": (96, 96), "e2": (40, 40), "e3": (0, 0)}
            with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}", replicas=1, transport="tcp") as over_grpc:
                wait_members(over_grpc, set(nodes))
                remote = over_grpc.residency(ns, tokens=tokens, engine_ids=["e1", "e2", "e3"])
                assert (remote.pages, remote.tiers, remote.nodes, remote.engines) == (
                    answer.pages, answer.tiers, answer.nodes, answer.engines)
            cut = placed.index("n3")
            nodes["n3"].kill()
            lost_under = pool.residency(ns, keys=keys, engine_ids=["e1"])   # still a member: lost under the call
            assert lost_under.pages == cut and "n3" not in lost_under.nodes
            wait_members(pool, {"n1", "n2"})
            after = pool.residency(ns, keys=keys, engine_ids=["e1"])
            assert after.pages == cut and "n3" not in after.nodes and after.engines["e1"].gpu_pages == 96
    finally:
        for engine in engines:
            engine.close()


def test_a_member_still_joining_counts_as_a_miss_where_every_member_is_asked(three_nodes, etcd):
    """A node's first record names no address (it is joining); stats and list_keys, which ask every member,
    answer from the others, as they do for a lost node (a client's view can hold that record a moment after
    the node serves)."""
    cluster, nodes = three_nodes
    session = EtcdSession([etcd.endpoint], timeout_s=3)
    try:
        joining = Member(node_id="n4", host_id="elsewhere", state="joining")
        session.call(lambda client: client.put(node_key(cluster, "n4"), joining.encode()))
    finally:
        session.close()
    keys, data = chain(43, 8)
    with KVStoreCluster(f"etcd://{etcd.endpoint}/{cluster}") as pool:
        wait_members(pool, set(nodes))
        assert "n4" in {m.node_id for m in pool.members()}
        assert pool.put(NS, keys, data) == 8
        assert set(pool.node_stats()) == set(nodes)
        assert sum(t.pages for t in pool.stats().tiers) >= 8
        assert set(encode_keys(keys)) <= set(pool.list_keys(NS))
