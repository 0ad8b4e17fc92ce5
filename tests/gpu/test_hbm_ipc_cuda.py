"""On a GPU: a node with [hbm] exports its pool over CUDA IPC, and a client process opens it once and
loads pages from it into a CUDA cache with the same kernel as from the arena."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_layout_cases import cases, page_bytes
from kvstore_client import KVStoreClient, kv_layout
from kvstore_client.proto import pb

pytestmark = pytest.mark.gpu

POOL = 64 << 20


def test_pages_in_the_nodes_hbm_pool_load_over_cuda_ipc(start_server):
    import cupy

    from kvstore_client.gpu import GpuPages
    from kvstore_client.gpu_device import CudaDevice

    server = start_server({"hbm.pool_bytes": POOL, "dram.arena_bytes": "256MiB"})
    with KVStoreClient(server.address, timeout_s=10) as client:
        region = client._conn.hello.hbm
        assert region.nbytes == POOL and len(region.ipc_handle) == 64
        case, target = cases(device="cuda")[0], cases(device="cuda", seed=8)[0]
        fmt = kv_layout.PAGE_FORMATS["sglang_page_first"]
        plan = kv_layout.plan(target.shape, fmt, target.cache)
        page = np.frombuffer(page_bytes(case.logical(3), fmt), dtype=np.uint8)
        device = CudaDevice()
        pages = GpuPages(client, device)
        with pages._lock:
            base = pages._hbm_base(region)
            cupy.cuda.runtime.memcpy(base + 4096, page.ctypes.data, page.nbytes, 1)
            answer = pb.AcquireResponse(hit_pages=1, offsets=[0], hbm_offsets=[4096], page_bytes=plan.page_bytes)
            addrs = pages._page_addresses(client._conn, answer, 1)
            assert pages._hbm_base(region) == base     # opened once
        device.pages_to_cache(plan, addrs, np.array([2]))
        assert torch.equal(target.logical(2).view(torch.uint8), case.logical(3).view(torch.uint8))
        pages.close()


def test_pages_a_gpu_engine_reads_twice_come_into_the_pool_and_load_from_it(start_server):
    """The tier end to end on a GPU: the node copies the pages into its CUDA pool, the next get_to_gpu reads them
    from there over IPC, and the blocks hold the bytes put."""
    import time

    from kvstore_client import Namespace
    from kvstore_client.gpu import GpuPages

    server = start_server({"hbm.pool_bytes": POOL, "dram.arena_bytes": "256MiB", "hbm.promote_hits": 2})
    case, fmt = cases(device="cuda")[0], kv_layout.PAGE_FORMATS["sglang_page_first"]
    ns = Namespace(model="hbm-cuda-tier", page_bytes=case.shape.page_bytes)
    keys = [f"t{i}" for i in range(4)]
    with KVStoreClient(server.address, timeout_s=10) as client:
        pages = GpuPages(client)
        assert pages.put_from_gpu(ns, keys, case.cache, fmt, [0, 1, 2, 3]) == 4
        for _ in range(2):
            target = cases(device="cuda", seed=8)[0]
            assert pages.get_to_gpu(ns, keys, target.cache, fmt, [3, 2, 1, 0]) == 4
        assert pages._hbm is None                   # both reads came from the arena
        deadline = time.monotonic() + 20
        while client.residency(ns, keys=keys).tier_pages()["hbm"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.residency(ns, keys=keys).tier_pages()["hbm"] == 4
        target = cases(device="cuda", seed=9)[0]
        assert pages.get_to_gpu(ns, keys, target.cache, fmt, [3, 2, 1, 0]) == 4
        assert pages._hbm is not None               # this one opened the pool
        for stored, loaded in ((0, 3), (1, 2), (2, 1), (3, 0)):
            assert torch.equal(target.logical(loaded).view(torch.uint8), case.logical(stored).view(torch.uint8))
        pages.close()
