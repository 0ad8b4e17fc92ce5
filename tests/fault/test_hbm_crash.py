"""A node SIGKILLed while pages move into its HBM pool (at hbm.before_publish: bytes in the pool, the copies
not yet answered) loses none of the pages it had on NVMe and serves every one byte for byte after the
restart; its new pool starts empty, so nothing a dead pool held is named, and the pages come in again."""

from __future__ import annotations

import hashlib
import time

import numpy as np

from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.proto import pb

PAGE = 64 << 10
NS = Namespace(model="hbm-crash", page_bytes=PAGE)


def page_of(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(key, digest_size=64).digest() * (PAGE // 64), dtype=np.uint8)


def read_all(client: KVStoreClient, keys: list[bytes]) -> None:
    """A GPU engine's read (hbm_reader): what it counts toward bringing pages in; then every byte, as a get."""
    acquired = client._conn.call_in(NS, "Acquire", pb.AcquireRequest(keys=keys, hbm_reader=True))
    client._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
    assert acquired.hit_pages == len(keys)
    out = np.zeros((len(keys), PAGE), np.uint8)
    assert client.get(NS, keys, out, verify=True) == len(keys)
    assert all(np.array_equal(out[i], page_of(k)) for i, k in enumerate(keys))


def test_a_kill_while_pages_move_into_hbm_loses_nothing_and_names_nothing_torn(start_server, tmp_path):
    settings = {"dram.arena_bytes": "8MiB", "dram.slab_bytes": "256KiB", "hbm.pool_bytes": "1MiB",
                "testing.hbm_on_host": "true", "hbm.promote_hits": 2, "nvme.enabled": "true",
                "nvme.paths": f"{tmp_path / 's0'},{tmp_path / 's1'}", "nvme.map_bytes": "32MiB",
                "controller.write_policy": "write_through"}
    first, second = [b"a%d" % i for i in range(6)], [b"b%d" % i for i in range(6)]
    node = start_server(settings, {"KVSTORE_TESTING_FAILPOINTS": "hbm.before_publish=kill@2"})
    with KVStoreClient(node.address, timeout_s=10) as client:
        for keys in (first, second):
            assert client.put(NS, keys, np.stack([page_of(k) for k in keys]), durable=True).stored == 6
        read_all(client, first)
        read_all(client, first)          # the first move: published
        deadline = time.monotonic() + 10
        while client.residency(NS, keys=first).tier_pages()["hbm"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.residency(NS, keys=first).tier_pages()["hbm"] == 6
        read_all(client, second)
        try:
            read_all(client, second)     # the second move: killed with its bytes in the pool, maybe mid-call
        except errors.Unavailable:
            pass
    assert node.process.wait(10) == -9, node.log()
    restarted = start_server(settings)
    with KVStoreClient(restarted.address, timeout_s=10) as client:
        for keys in (first, second):
            assert client.residency(NS, keys=keys).tier_pages() == {"hbm": 0, "dram": 0, "nvme": 6}
            answer = client._conn.call_in(NS, "Acquire", pb.AcquireRequest(keys=keys, hbm_reader=True))
            assert answer.hit_pages == 6 and list(answer.hbm_offsets) == []
            client._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[answer.lease_id]))
            read_all(client, keys)
        deadline = time.monotonic() + 10
        while client.residency(NS, keys=second).tier_pages()["hbm"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.residency(NS, keys=second).tier_pages()["hbm"] == 6   # read twice since: in again
        read_all(client, second)
