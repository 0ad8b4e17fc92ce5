"""get_to_gpu / put_from_gpu against a real node, with the CPU behind the device seam: pages move between
the node's arena and caches in every engine layout byte for byte; the arena is registered once per
client and again only after a node restart; bad calls are refused before any lease is taken."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch

from kv_layout_cases import BLOCKS, cases, page_bytes
from kvstore_client import KVStoreClient, Namespace, errors, kv_layout
from kvstore_client.gpu import GpuPages
from kvstore_client.gpu_device import HostDevice

FORMATS = sorted(kv_layout.PAGE_FORMATS)
CASES = cases()


def _namespace(case, page_format: str) -> Namespace:
    return Namespace(model=f"gpu-{case.name}", page_bytes=case.shape.page_bytes, page_tokens=case.shape.tokens,
                     layout=page_format)


def _fresh_like(case_name: str, seed: int):
    """A second cache of the same layout, other random contents."""
    return next(c for c in cases(seed=seed) if c.name == case_name)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_put_from_cache_then_get_into_another_cache_round_trips(client, case):
    page_format = FORMATS[CASES.index(case) % len(FORMATS)]
    fmt, ns = kv_layout.PAGE_FORMATS[page_format], _namespace(case, page_format)
    keys = [f"{case.name}-{i}" for i in range(4)]
    src_blocks, dst_blocks = [3, 0, 5, 1], [2, 4, 0, 5]
    device = HostDevice()
    with GpuPages(client, device) as pages:
        assert pages.put_from_gpu(ns, keys, case.cache, page_format, src_blocks) == 4
        # What the node holds is each block in the page format, as a plain host get reads it.
        out = np.zeros((4, ns.page_bytes), dtype=np.uint8)
        assert client.get(ns, keys, out, verify=True) == 4
        for i, block in enumerate(src_blocks):
            assert out[i].tobytes() == page_bytes(case.logical(block), fmt)
        target = _fresh_like(case.name, seed=99)
        untouched = {b: target.logical(b).clone() for b in range(BLOCKS) if b not in dst_blocks}
        assert pages.get_to_gpu(ns, keys, target.cache, page_format, dst_blocks) == 4
        for src, dst in zip(src_blocks, dst_blocks):
            assert torch.equal(target.logical(dst).view(torch.uint8), case.logical(src).view(torch.uint8))
        for b, before in untouched.items():
            assert torch.equal(target.logical(b).view(torch.uint8), before.view(torch.uint8))
    assert device.register_calls == 1 and not device.registered


def test_get_stops_at_the_first_miss_and_a_put_counts_what_is_stored(client):
    case = CASES[0]
    ns, keys = _namespace(case, "lmcache"), [f"m{i}" for i in range(5)]
    with GpuPages(client, HostDevice()) as pages:
        assert pages.put_from_gpu(ns, keys[:2], case.cache, "lmcache", [0, 1]) == 2
        # Already stored pages count as stored and are not copied again; the chain goes on from them.
        assert pages.put_from_gpu(ns, keys[:3], case.cache, "lmcache", [0, 1, 2]) == 3
        target = _fresh_like(case.name, seed=7)
        before = target.logical(4).clone()
        assert pages.get_to_gpu(ns, keys, target.cache, "lmcache", [5, 1, 2, 3, 4]) == 3
        assert torch.equal(target.logical(4).view(torch.uint8), before.view(torch.uint8))
        assert pages.get_to_gpu(ns, ["absent"], target.cache, "lmcache", [0]) == 0


def test_bad_calls_are_refused_with_what_to_fix(client, start_server):
    case = CASES[0]
    ns = _namespace(case, "lmcache")
    with GpuPages(client, HostDevice()) as pages:
        with pytest.raises(errors.PageSizeMismatch, match="namespace's pages"):
            pages.get_to_gpu(Namespace(model="x", page_bytes=4096), ["a"], case.cache, "lmcache", [0])
        with pytest.raises(errors.InvalidArgument, match="block ids for"):
            pages.get_to_gpu(ns, ["a", "b"], case.cache, "lmcache", [0])
        with pytest.raises(errors.InvalidArgument, match="block ids must be in"):
            pages.put_from_gpu(ns, ["a"], case.cache, "lmcache", [case.cache.blocks])
        with pytest.raises(errors.InvalidArgument, match="layout must be"):
            pages.put_from_gpu(ns, ["a"], case.cache, "nhd", [0])
        assert client.lookup(ns, ["a"]) == 0
    with KVStoreClient(start_server().address, transport="tcp") as remote:
        with pytest.raises(errors.InvalidArgument, match="must run on the node's host"):
            GpuPages(remote, HostDevice()).get_to_gpu(ns, ["a"], case.cache, "lmcache", [0])


def test_the_arena_is_registered_once_and_again_after_the_node_restarts(start_server):
    case = CASES[1]
    ns = _namespace(case, "sglang_page_first")
    first = start_server()
    device = HostDevice()
    with KVStoreClient(first.address, timeout_s=10) as client, GpuPages(client, device) as pages:
        for i in range(3):
            assert pages.put_from_gpu(ns, [f"r{i}"], case.cache, "sglang_page_first", [i]) == 1
        assert device.register_calls == 1
        old_base = next(iter(device.registered))
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        second = start_server({"server.grpc_address": first.address, "shm.socket_path": first.socket_path})
        assert second.address == first.address
        assert pages.put_from_gpu(ns, ["after"], case.cache, "sglang_page_first", [4]) == 1
        assert device.register_calls == 2 and list(device.registered) != [old_base] and len(device.registered) == 1
        target = _fresh_like(case.name, seed=5)
        assert pages.get_to_gpu(ns, ["after"], target.cache, "sglang_page_first", [0]) == 1
        assert torch.equal(target.logical(0).view(torch.uint8), case.logical(4).view(torch.uint8))
    assert not device.registered


def test_without_cupy_the_default_device_says_what_is_missing(client):
    try:
        import cupy  # noqa: F401
        pytest.skip("cupy is installed here")
    except ImportError:
        pass
    with pytest.raises(errors.InvalidArgument, match="need cupy"):
        GpuPages(client)
