"""The HBM tier's export and the client side of it, with a host memfd standing in for the GPU: a node with
an HBM pool names it in Hello and one without does not; a client opens the pool once and keeps it;
pages the node answers with an HBM offset are read from the pool, the others from the arena; a node
asked for an HBM pool without a GPU refuses to start, naming the setting."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest
import torch

from kv_layout_cases import cases, page_bytes
from kvstore_client import KVStoreClient, errors, kv_layout
from kvstore_client.gpu import GpuPages
from kvstore_client.gpu_device import HostDevice
from kvstore_client.proto import pb

POOL = 4 << 20
HBM = {"hbm.pool_bytes": POOL, "testing.hbm_on_host": "true"}


def test_a_node_without_an_hbm_pool_names_none(client):
    assert not client._conn.hello.HasField("hbm")


def test_the_pool_is_shared_memory_of_the_node_opened_once_per_client(start_server):
    server = start_server(HBM)
    with KVStoreClient(server.address, timeout_s=10) as client:
        region = client._conn.hello.hbm
        assert region.nbytes == POOL and region.ipc_handle
        device = HostDevice()
        pages = GpuPages(client, device)
        case = cases()[0]
        fmt = kv_layout.PAGE_FORMATS["sglang_page_first"]
        plan = kv_layout.plan(case.shape, fmt, case.cache)
        # The engine side puts one page in the arena the ordinary way and lays another in the pool.
        assert pages.put_from_gpu(client_ns(case), ["a"], case.cache, fmt, [2]) == 1
        acquired = client._conn.call_in(client_ns(case), "Acquire", pb.AcquireRequest(keys=[b"a"]))
        other = cases(seed=3)[0]
        hbm_page = np.frombuffer(page_bytes(other.logical(1), fmt), dtype=np.uint8)
        writer = HostDevice()
        base = writer.open_ipc(region.ipc_handle)
        ctypes.memmove(base + 8192, hbm_page.ctypes.data, hbm_page.nbytes)
        # A second opening sees it: the pool is the node's memory, not a copy.
        reader = HostDevice()
        seen = reader.open_ipc(region.ipc_handle)
        assert ctypes.string_at(seen + 8192, hbm_page.nbytes) == hbm_page.tobytes()
        answer = pb.AcquireResponse(hit_pages=2, offsets=[acquired.offsets[0], 0], hbm_offsets=[-1, 8192],
                                    page_bytes=plan.page_bytes)
        target = cases(seed=5)[0]
        for _ in range(2):
            with pages._lock:
                addrs = pages._page_addresses(client._conn, answer, 2)
            device.pages_to_cache(kv_layout.plan(target.shape, fmt, target.cache), addrs, np.array([0, 4]))
            assert torch.equal(target.logical(0).view(torch.uint8), case.logical(2).view(torch.uint8))
            assert torch.equal(target.logical(4).view(torch.uint8), other.logical(1).view(torch.uint8))
        assert device.open_calls == 1 and len(device.opened) == 1
        client._conn.control.post("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
        past = pb.AcquireResponse(hit_pages=1, offsets=[0], hbm_offsets=[POOL - plan.page_bytes + 1], page_bytes=plan.page_bytes)
        with pytest.raises(errors.Internal, match="past its"):
            with pages._lock:
                pages._page_addresses(client._conn, past, 1)
        pages.close()
        assert not device.opened and not device.registered
        writer.close_ipc(base)
        reader.close_ipc(seen)


def client_ns(case):
    from kvstore_client import Namespace

    return Namespace(model="hbm-" + case.name, page_bytes=case.shape.page_bytes)


def test_an_hbm_pool_without_a_gpu_stops_start_up_naming_the_setting(tmp_path):
    pytest.importorskip("torch")
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is installed here: the node may find a GPU")
    except ImportError:
        pass
    result = subprocess.run([sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
                             "--shm-socket", str(tmp_path / "kvstore.sock"), "--set", "dram.slab_bytes=4MiB",
                             "--set", "dram.arena_bytes=16MiB", "--set", "nvme.enabled=false",
                             "--set", "hbm.pool_bytes=4MiB"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "hbm.pool_bytes is set but cupy is not installed" in result.stderr
