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


def test_each_key_packed_answers_each_pages_tier(server):
    """A residency question: keys of one length back to back, each answered with the tier it is read from."""
    with KVStoreClient(server.address) as client:
        asked, expected = stored_and_asked(client)
        ns_id = client._namespace_id(NS)
        padded = [key.encode().ljust(4, b"_") for key in asked]   # keys of one length, for keys_packed
        assert client.put(NS, [padded[0], padded[5]], np.zeros((2, PAGE), np.uint8)) == 2
        answer = client._grpc.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys_packed=b"".join(padded),
                                                              key_bytes=4, each_key=True))
        assert list(answer.held) == [pb.DRAM, 0, 0, 0, 0, pb.DRAM] and answer.hit_pages == 1
        by_list = client._grpc.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[k.encode() for k in asked],
                                                               each_key=True))
        assert [bool(b) for b in by_list.held] == expected and set(by_list.held) <= {0, pb.DRAM}
