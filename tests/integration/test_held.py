"""held(): whether the node holds each key's page, each key on its own (keys of several chains at once),
in one Lookup per limits.lookup_pages_max keys, on the sync and the async client alike."""

import asyncio

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.async_client import AsyncKVStoreClient
from kvstore_client.proto import pb

PAGE = 4096
NS = Namespace(model="held", page_bytes=PAGE)


def stored_and_asked(client):
    assert client.put(NS, ["a0", "a1", "a2"], np.zeros((3, PAGE), np.uint8)) == 3
    assert client.put(NS, ["b0"], np.zeros((1, PAGE), np.uint8)) == 1
    asked = ["a0", "x", "a2", "b0", "y", "a1"]
    return asked, [True, False, True, True, False, True]


def test_each_key_is_answered_on_its_own(start_server):
    server = start_server({"limits.lookup_pages_max": 4})   # six keys: two Lookups
    with KVStoreClient(server.address) as client:
        asked, expected = stored_and_asked(client)
        assert client.held(NS, asked) == expected
        assert client.lookup(NS, asked) == 1                 # a lookup still counts the leading run
        assert client.held(NS, []) == []

        async def from_async():
            async with AsyncKVStoreClient(server.address) as aclient:
                return await aclient.held(NS, asked)
        assert asyncio.run(from_async()) == expected


def test_each_key_takes_keys_only(server):
    with KVStoreClient(server.address) as client:
        ns_id = client._namespace_id(NS)
        with pytest.raises(errors.InvalidArgument, match="each_key asks about keys"):
            client._grpc.call("Lookup", pb.LookupRequest(namespace_id=ns_id, tokens=[1] * 16, each_key=True))
