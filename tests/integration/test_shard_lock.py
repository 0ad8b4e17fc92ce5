"""An NVMe shard directory belongs to one kvstore-server: a second one refuses to start, naming the holder."""

import signal
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace

PAGE = 64 << 10
NS = Namespace(model="shard-lock", page_bytes=PAGE)


def pages(n):
    return np.random.default_rng(7).integers(0, 256, (n, PAGE), dtype=np.uint8)


def nvme_pages(client):
    return next(t.pages for t in client.stats().tiers if t.tier == 3)  # NVME


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_second_server_on_the_same_shard_exits_and_the_first_serves_on(start_server, tmp_path):
    shard = tmp_path / "s0"
    settings = {"nvme.enabled": "true", "nvme.paths": str(shard), "nvme.map_bytes": "64MiB"}
    first = start_server(settings)
    data = pages(4)
    keys = [f"k{i}" for i in range(4)]
    with KVStoreClient(first.address) as client:
        assert client.put(NS, keys, data) == 4
        wait_for(lambda: nvme_pages(client) == 4)  # the pages are in the shard the second one wants

    with pytest.raises(RuntimeError, match="kvstore-server exited with 1") as refused:
        start_server(settings)
    errors = [line for line in str(refused.value).splitlines() if " ERROR " in line]
    assert len(errors) == 1, refused.value
    assert f"NVMe shard directory {shard} is in use by another kvstore-server (pid {first.process.pid})" \
        in errors[0] and "nvme.paths" in errors[0]

    assert first.process.poll() is None
    with KVStoreClient(first.address) as client:
        out = np.zeros_like(data)
        assert client.get(NS, keys, out, verify=True) == 4
        assert np.array_equal(out, data)
        assert client.put(NS, ["after"], pages(1)) == 1


def test_the_lock_file_of_a_killed_server_does_not_hold_the_shard(start_server, tmp_path):
    """The lock is the flock, not the file: the kernel drops it with the process, so a restart serves."""
    settings = {"nvme.enabled": "true", "nvme.paths": str(tmp_path / "s0"), "nvme.map_bytes": "64MiB"}
    first = start_server(settings)
    with KVStoreClient(first.address) as client:
        assert client.put(NS, ["k"], pages(1)) == 1
        wait_for(lambda: nvme_pages(client) == 1)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    assert (tmp_path / "s0" / "kvstore.lock").read_text().strip() == str(first.process.pid)

    second = start_server(settings)
    assert (tmp_path / "s0" / "kvstore.lock").read_text().strip() == str(second.process.pid)
    with KVStoreClient(second.address) as client:
        out = np.zeros((1, PAGE), np.uint8)
        assert client.get(NS, ["k"], out, verify=True) == 1
        assert np.array_equal(out, pages(1))
