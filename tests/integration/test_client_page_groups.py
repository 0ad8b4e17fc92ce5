"""Page groups through the SDK against a real server process: a hybrid model's KV page and sidecar pages of
one position are stored in one commit, answered by one lookup and read under one acquire."""

import threading
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, errors
from kvstore_client.groups import GroupPart
from kvstore_client.keys import Namespace

KV = Namespace(model="hybrid", page_bytes=8192, page_tokens=16, layout="kv")
STATE = Namespace(model="hybrid", page_bytes=2048, page_tokens=16, layout="mamba")


def pages(namespace, n, seed):
    return np.random.default_rng(seed).integers(0, 255, (n, namespace.page_bytes), dtype=np.uint8)


def keys(n, start=0):
    return [f"{i:064x}" for i in range(start, start + n)]


@pytest.mark.parametrize("control", ["local", "grpc"])
def test_put_group_lookup_group_and_get_group_round_trip(server, control):
    with KVStoreClient(server.address, timeout_s=10, control=control) as client:
        kv, state = pages(KV, 4, 1), pages(STATE, 4, 2)
        assert client.put_group(keys(4), [(KV, kv), (STATE, state)]) == 4
        hits = client.lookup_group(keys(4), [GroupPart(KV), GroupPart(STATE, "trailing_pages", 1)])
        assert (hits.hit_pages, hits.part_hit_pages, hits.restorable_pages) == (4, [4, 4], [1, 2, 3, 4])
        out_kv, out_state = np.zeros_like(kv), np.zeros_like(state[:2])
        assert client.get_group([(KV, keys(4), out_kv), (STATE, keys(2, 2), out_state)], verify=True) == [4, 2]
        assert (out_kv == kv).all() and (out_state == state[2:]).all()


def test_staged_pages_are_invisible_until_their_group_commits(client):
    kv, state = pages(KV, 3, 3), pages(STATE, 3, 4)
    staged_state = client.stage(STATE, keys(3), state)
    staged_kv = client.stage(KV, keys(3), kv)
    assert client.lookup(STATE, keys=keys(3)) == client.lookup(KV, keys=keys(3)) == 0
    assert client.lookup_group(keys(3), [GroupPart(KV), GroupPart(STATE)]).hit_pages == 0
    # The first two positions go together; the third stays staged for a later group.
    results = client.commit_group([staged_kv.take(keys(2)), staged_state.take(keys(2))])
    assert [int(r) for r in results] == [2, 2]
    assert client.lookup(KV, keys=keys(3)) == client.lookup(STATE, keys=keys(3)) == 2
    client.commit_group([staged_kv, staged_state])
    assert client.lookup_group(keys(3), [GroupPart(KV), GroupPart(STATE)]).hit_pages == 3


def test_a_group_with_an_expired_lease_publishes_nothing_and_names_it(start_server):
    server = start_server({"leases.write_ttl_ms": 1000, "leases.reap_interval_ms": 50})
    with KVStoreClient(server.address, timeout_s=10) as client:
        staged_state = client.stage(STATE, keys(2), pages(STATE, 2, 5))
        time.sleep(1.3)   # the node reaps the state's lease
        staged_kv = client.stage(KV, keys(2), pages(KV, 2, 6))
        staged_state.commit_by = time.monotonic() + 10   # as if the client's clock were wrong: the node decides
        with pytest.raises(errors.LeaseNotFound, match=f"{staged_state.lease_id:#x}"):
            client.commit_group([staged_kv, staged_state])
        assert client.lookup(KV, keys=keys(2)) == client.lookup(STATE, keys=keys(2)) == 0
        assert client.stats().leases_open == 0   # the group's other lease was aborted with it
        assert client.put_group(keys(2), [(KV, pages(KV, 2, 6)), (STATE, pages(STATE, 2, 5))]) == 2


def test_sdk_arguments_of_groups_are_checked_before_anything_is_sent(client):
    with pytest.raises(errors.InvalidArgument, match="hit_policy"):
        client.lookup_group(keys(1), [GroupPart(KV, "most_pages")])
    with pytest.raises(errors.InvalidArgument, match="GroupPart"):
        client.lookup_group(keys(1), [KV])
    with pytest.raises(errors.InvalidArgument, match="StagedPages"):
        client.commit_group([object()])
    with pytest.raises(errors.InvalidArgument, match="at least one"):
        client.put_group(keys(1), [])
    with pytest.raises(errors.InvalidArgument, match="one write lease"):
        client.stage(KV, keys(client.limits.batch_pages_max + 1), pages(KV, client.limits.batch_pages_max + 1, 0))
    with pytest.raises(errors.InvalidArgument, match="GROUP_ALL_PAGES"):   # the node's own check
        client.lookup_group(keys(1), [GroupPart(KV, "trailing_pages"), GroupPart(STATE)])


def test_a_lookup_never_sees_a_kv_page_without_its_state_while_groups_commit(server):
    """A writer process-side thread puts position after position as groups; a reader hammers LookupGroup
    over another connection. The KV part's own boundary never runs ahead of the group's answer."""
    chain = keys(60)
    done, answers, failures = threading.Event(), [], []

    def writer():
        try:
            with KVStoreClient(server.address, timeout_s=10) as client:
                for i, key in enumerate(chain):
                    parent = chain[i - 1] if i else None
                    client.put_group([key], [(KV, pages(KV, 1, i)), (STATE, pages(STATE, 1, i))], parent=parent)
        except Exception as exc:   # reported by the main thread
            failures.append(exc)
        finally:
            done.set()

    with KVStoreClient(server.address, timeout_s=10) as reader:
        thread = threading.Thread(target=writer)
        thread.start()
        while not done.is_set():
            hits = reader.lookup_group(chain, [GroupPart(KV), GroupPart(STATE)])
            answers.append((hits.hit_pages, hits.part_hit_pages[0]))
        thread.join()
        assert not failures
        assert all(group == kv for group, kv in answers), [a for a in answers if a[0] != a[1]][:3]
        assert reader.lookup_group(chain, [GroupPart(KV), GroupPart(STATE)]).hit_pages == 60
    assert len(answers) > 1


def test_the_async_client_stores_and_reads_groups_as_the_sync_client_does(server):
    import asyncio

    from kvstore_client import AsyncKVStoreClient

    kv, state = pages(KV, 3, 7), pages(STATE, 3, 8)

    async def run():
        async with AsyncKVStoreClient(server.address, timeout_s=10) as client:
            staged = await client.stage(STATE, keys(3), state)
            assert await client.lookup(STATE, keys=keys(3)) == 0
            assert await client.put_group(keys(3), [(KV, kv)]) == 3
            assert (await client.lookup_group(keys(3), [GroupPart(KV), GroupPart(STATE)])).hit_pages == 0
            assert [int(r) for r in await client.commit_group([staged])] == [3]
            hits = await client.lookup_group(keys(3), [GroupPart(KV), GroupPart(STATE, "trailing_pages", 1)])
            assert (hits.hit_pages, hits.part_hit_pages, hits.restorable_pages) == (3, [3, 3], [1, 2, 3])
            out_kv, out_state = np.zeros_like(kv), np.zeros_like(state)
            assert await client.get_group([(KV, keys(3), out_kv), (STATE, keys(3), out_state)], verify=True) == [3, 3]
            assert (out_kv == kv).all() and (out_state == state).all()
            with pytest.raises(errors.InvalidArgument, match="hit_policy"):
                await client.lookup_group(keys(1), [GroupPart(KV, "most_pages")])

    asyncio.run(run())
    with KVStoreClient(server.address, timeout_s=10) as sync:
        assert sync.lookup_group(keys(3), [GroupPart(KV), GroupPart(STATE)]).hit_pages == 3
