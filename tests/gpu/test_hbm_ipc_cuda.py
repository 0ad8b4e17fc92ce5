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

    server = start_server({"hbm.pool_bytes": POOL})
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
