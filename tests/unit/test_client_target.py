"""A client names one node or a cluster: a cluster URL gives the cluster client, with the same methods."""

from __future__ import annotations

import inspect

import pytest

from kvstore_client import KVStoreClient, errors
from kvstore_client.async_client import AsyncKVStoreClient
from kvstore_client.async_cluster import AsyncKVStoreCluster
from kvstore_client.cluster import KVStoreCluster

UNANSWERED_URL = "etcd://127.0.0.1:9/prod"   # nothing listens on port 9: no member is ever listed


def test_a_cluster_url_gives_the_cluster_client():
    with KVStoreClient(UNANSWERED_URL, members_wait_s=0.1) as pool:
        assert isinstance(pool, KVStoreCluster)
        assert pool.cluster == "prod"


def test_the_async_client_of_a_cluster_url_is_the_async_cluster():
    assert isinstance(AsyncKVStoreClient(UNANSWERED_URL), AsyncKVStoreCluster)   # nothing is dialled yet


def test_the_cluster_has_every_public_method_of_the_node_client_with_its_arguments():
    for name, method in inspect.getmembers(KVStoreClient, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(KVStoreCluster, name, None)
        assert ours is not None, f"KVStoreCluster has no {name}()"
        theirs_args = list(inspect.signature(method).parameters)
        assert list(inspect.signature(ours).parameters)[:len(theirs_args)] == theirs_args, name
    for name in ("limits", "transport", "server_version"):
        assert isinstance(getattr(KVStoreCluster, name), property), name


def test_the_async_cluster_has_every_coroutine_of_the_async_client():
    for name, method in inspect.getmembers(AsyncKVStoreClient, inspect.iscoroutinefunction):
        if not name.startswith("_"):
            assert inspect.iscoroutinefunction(getattr(AsyncKVStoreCluster, name, None)), name


@pytest.mark.parametrize("target", ["", None, 50051])
def test_a_target_that_is_no_address_is_refused(target):
    with pytest.raises(errors.InvalidArgument, match="target must be a node's address"):
        KVStoreClient(target)


def test_a_bad_cluster_url_is_refused_naming_the_form():
    with pytest.raises(errors.InvalidArgument, match=r"etcd://host:2379"):
        KVStoreClient("etcd://127.0.0.1:2379")


def test_a_cluster_with_no_member_stores_nothing_and_says_why():
    import numpy as np
    from kvstore_client import Namespace
    with KVStoreClient(UNANSWERED_URL, members_wait_s=0.1) as pool:
        ns = Namespace(model="m", page_bytes=16)
        stored = pool.put(ns, [b"k0", b"k1"], np.zeros((2, 16), np.uint8))
        assert stored == 0 and "no member of cluster 'prod'" in stored.reason
        assert pool.lookup(ns, [b"k0"]) == 0 and pool.held(ns, [b"k0"]) == [False]


def test_a_cluster_refuses_one_page_snapshot_and_gives_each_nodes_own():
    from kvstore_client import Namespace
    with KVStoreClient(UNANSWERED_URL, members_wait_s=0.1) as pool:
        ns = Namespace(model="m", page_bytes=16)
        with pytest.raises(errors.InvalidArgument, match="node_list_pages"):
            pool.list_pages(ns)
        with pytest.raises(errors.InvalidArgument, match="node_list_pages"):
            pool.events_run(ns)
        assert pool.node_list_pages(ns) == {}    # no member: nothing by node id
