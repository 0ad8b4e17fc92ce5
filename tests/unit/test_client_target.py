"""A client names one node; a cluster URL is refused before anything is sent, naming the class that takes it."""

from __future__ import annotations

import pytest

from kvstore_client import KVStoreClient, errors
from kvstore_client.async_client import AsyncKVStoreClient

CLUSTER_URL = "etcd://127.0.0.1:2379/prod"


@pytest.mark.parametrize("client_class", [KVStoreClient, AsyncKVStoreClient])
def test_a_cluster_url_is_refused_naming_kvstore_cluster(client_class):
    with pytest.raises(errors.InvalidArgument, match=r"names a cluster.*KVStoreCluster\('etcd://127.0.0.1:2379/prod'\)"):
        client_class(CLUSTER_URL)


@pytest.mark.parametrize("target", ["", None, 50051])
def test_a_target_that_is_no_address_is_refused(target):
    with pytest.raises(errors.InvalidArgument, match="target must be a node's address"):
        KVStoreClient(target)
