"""A put that fails part-way leaves nothing claimed: every lease it opened is aborted, the one a Reserve
sent ahead for the next group opened too, so the same keys can be put again at once."""

import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, errors

PAGE = 64 << 10
NS = Namespace(model="put-failures", page_bytes=PAGE)


@pytest.mark.parametrize("control", ["grpc", "local"])
def test_a_put_whose_commit_fails_leaves_no_lease_open(start_server, control):
    server = start_server({"testing.failpoints": "commit.before_publish=error@1"})   # the first Commit fails
    keys = [f"k{i}" for i in range(256)]     # Reserve groups of 32, 128, 96: the next in flight as one moves
    data = np.random.default_rng(1).integers(0, 256, (len(keys), PAGE), dtype=np.uint8)
    with KVStoreClient(server.address, control=control) as client:
        with pytest.raises(errors.Internal):
            client.put(NS, keys, data)
        deadline = time.monotonic() + 5      # the Aborts are posted; the write TTL is 30 s
        while client.stats().leases_open:
            assert time.monotonic() < deadline, f"{client.stats().leases_open} leases left open"
            time.sleep(0.05)
        assert client.put(NS, keys, data) == len(keys)
        out = np.zeros_like(data)
        assert client.get(NS, keys, out) == len(keys) and np.array_equal(out, data)
