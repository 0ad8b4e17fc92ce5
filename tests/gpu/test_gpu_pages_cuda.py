"""On a GPU, against a real node: put_from_gpu and get_to_gpu move pages between the node's registered arena
and CUDA caches of every engine layout byte for byte, with one registration per client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_layout_cases import cases, page_bytes
from kvstore_client import Namespace, kv_layout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_format", sorted(kv_layout.PAGE_FORMATS))
def test_pages_round_trip_between_the_arena_and_cuda_caches(client, page_format):
    from kvstore_client.gpu import GpuPages
    from kvstore_client.gpu_device import CudaDevice

    fmt = kv_layout.PAGE_FORMATS[page_format]
    with GpuPages(client, CudaDevice()) as pages:
        for case, target in zip(cases(device="cuda"), cases(device="cuda", seed=11)):
            ns = Namespace(model=f"cuda-{case.name}-{page_format}", page_bytes=case.shape.page_bytes)
            keys, src, dst = [f"{case.name}-{i}" for i in range(3)], [4, 0, 2], [1, 5, 3]
            assert pages.put_from_gpu(ns, keys, case.cache, fmt, src) == 3
            out = np.zeros((3, ns.page_bytes), dtype=np.uint8)
            assert client.get(ns, keys, out, verify=True) == 3
            assert [row.tobytes() for row in out] == [page_bytes(case.logical(b), fmt) for b in src]
            assert pages.get_to_gpu(ns, keys, target.cache, fmt, dst) == 3
            for s, d in zip(src, dst):
                assert torch.equal(target.logical(d).view(torch.uint8), case.logical(s).view(torch.uint8))
