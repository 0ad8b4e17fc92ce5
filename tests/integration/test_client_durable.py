"""put(durable=True) counts a page only once the node has it on NVMe: after a SIGKILL and a restart
on the same NVMe paths, every page such a put counted comes back byte for byte, on every data plane."""

import signal

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace

PAGE = 64 << 10
PAGES = 100          # several Reserve groups and Commit runs over shared memory
NS = Namespace(model="durable", page_bytes=PAGE)
MODES = {"local": {"control": "local"}, "grpc": {"control": "grpc"}, "tcp": {"transport": "tcp"}}


def node_settings(tmp_path) -> dict:
    # write_back below its watermark writes nothing down by itself: only `durable` puts pages on NVMe.
    return {"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/shard0,{tmp_path}/shard1", "nvme.map_bytes": "256MiB",
            "controller.write_policy": "write_back", "controller.high_watermark": 0.9,
            "dram.arena_bytes": "64MiB"}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_durable_put_survives_sigkill(start_server, tmp_path, mode):
    settings = node_settings(tmp_path)
    keys = [f"d{i}" for i in range(PAGES)]
    data = np.random.default_rng(PAGES).integers(0, 256, (PAGES, PAGE), dtype=np.uint8)
    first = start_server(settings)
    with KVStoreClient(first.address, **MODES[mode]) as client:
        assert client.put(NS, keys, data, durable=True) == PAGES
        assert client.put(NS, keys, data, durable=True) == PAGES  # all present: counted as stored
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(10)
    second = start_server(settings)
    with KVStoreClient(second.address, **MODES[mode]) as client:
        out = np.zeros_like(data)
        assert client.get(NS, keys, out, verify=True) == PAGES
        assert np.array_equal(out, data)
