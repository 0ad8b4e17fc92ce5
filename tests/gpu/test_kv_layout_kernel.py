"""On a GPU, the gather/scatter kernel moves the same bytes as the CPU reference, every layout both ways."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_layout_cases import BLOCKS, cases, page_bytes
from kvstore_client import kv_layout

pytestmark = pytest.mark.gpu

FORMATS = sorted(kv_layout.PAGE_FORMATS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
@pytest.mark.parametrize("page_format", FORMATS)
def test_kernel_gathers_and_scatters_like_a_plain_copy(page_format, dtype):
    import cupy

    from kvstore_client.gpu_device import CudaDevice

    device, fmt = CudaDevice(), kv_layout.PAGE_FORMATS[page_format]
    rng = np.random.default_rng(4)
    for case in cases(device="cuda", dtype=dtype):
        plan = kv_layout.plan(case.shape, fmt, case.cache)
        blocks = rng.permutation(BLOCKS)[:4].astype(np.int64)
        pages = cupy.zeros(len(blocks) * plan.page_bytes + 1, dtype=cupy.uint8)
        for misalign in (0, 1):     # 1: pages at odd addresses take the byte-wide kernel
            addrs = (pages.data.ptr + misalign + np.arange(len(blocks)) * plan.page_bytes).astype(np.uint64)
            device.cache_to_pages(plan, addrs, blocks)
            got = cupy.asnumpy(pages)[misalign:misalign + len(blocks) * plan.page_bytes].tobytes()
            assert got == b"".join(page_bytes(case.logical(int(b)), fmt) for b in blocks), case.name
            fresh = cupy.asarray(rng.integers(0, 256, size=pages.size, dtype=np.uint8))
            pages[:] = fresh
            device.pages_to_cache(plan, addrs, blocks)
            for i, b in enumerate(blocks.tolist()):
                start = misalign + i * plan.page_bytes
                assert page_bytes(case.logical(b), fmt) == cupy.asnumpy(fresh)[start:start + plan.page_bytes].tobytes()
