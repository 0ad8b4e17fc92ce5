"""The GPU data path on one GPU: correctness first, then GB/s next to the physical limits, in one run.

    python bench/gpu_check.py [--json bench/results/gpu_check.json] [--pages 256] [--repeats 10]

Checks (each reported as ok or the first difference):
  - every engine cache layout x every page format: random pages in the DRAM arena (a memfd mapped
    and registered with CUDA, as the SDK does) -> the engine's CUDA cache (the gather kernel) ->
    other arena slots (the scatter kernel); the bytes must come back equal;
  - CUDA IPC: an HBM pool (kvstore.tiers.hbm.CudaPool, as a node allocates it) filled here is read
    by a second process through its IPC handle; it must read the same bytes.
Speeds (GB/s of page bytes; median of --repeats after a warm-up; CUDA events):
  - arena -> GPU: the gather kernel reading the registered arena, and cudaMemcpy from the registered
    arena, each as a ratio of a plain pinned H2D copy (cudaHostAlloc buffer) of the same bytes;
  - HBM tier over IPC: the second process's reads of the pool (cudaMemcpy, and the gather kernel
    into an engine cache), as a ratio of a device-to-device copy of the same bytes between its own
    buffers;
  - the gather kernel from device pages vs a contiguous device-to-device copy of the same bytes.
  - the HBM tier on a node (skip it with --no-tier): a kvstore-server started here with an HBM pool on
    the GPU; this process, an engine on its host, puts --pages pages from a CUDA cache, reads them
    --repeats + 1 times from the arena (GpuPages.get_to_gpu: one gather from the registered arena; the
    node's hbm.promote_hits is set to that count), waits for the node to copy them into its pool, then
    reads them from the pool over CUDA IPC; every read's blocks are compared with the put ones, byte for
    byte. Figures: each read's page bytes per second of the whole call (Acquire, copy, Release), the
    arena reads (median) as a ratio of pinned H2D and the pool reads (median) as a ratio of a
    device-to-device copy of the same bytes in this process, and the node's HBM Stats.
Targets (issue): arena -> GPU >= 0.9 of pinned H2D; IPC reads >= 0.9 of D2D; kernel >= 0.8 of contiguous.

Without a GPU (no cupy, or no device) it prints why and exits 2. Needs cupy and torch with CUDA;
the SDK imports its generated protobuf modules, so the protobuf runtime must be at least the version
in clients/python/kvstore_client/proto/kvstore_pb2.py (carry a wheel where the image's is older).
Working set: --pages pages of a Llama-3-8B-like layer stack (32 layers, 8 KV heads, head dim 128,
fp16, 16 tokens a page: 2 MiB a page; 512 MiB at the default 256 pages), arena 2x that. CPU
placement: not pinned (the copies are the GPU's DMA engines and SMs; the CPU only launches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "clients" / "python")]

LAYERS, HEADS, DIM, TOKENS = 32, 8, 128, 16


def gpu_missing() -> str:
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # CUDARuntimeError without a driver
        return f"no usable CUDA device ({exc})"
    return "" if count else "no CUDA device is visible"


def timed_gbs(nbytes: int, action: Callable[[], None], repeats: int) -> float:
    import cupy

    action()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    seconds = []
    for _ in range(repeats):
        start.record()
        action()
        stop.record()
        stop.synchronize()
        seconds.append(cupy.cuda.get_elapsed_time(start, stop) / 1000)
    return nbytes / statistics.median(seconds) / 1e9


def engine_caches(blocks: int) -> dict[str, Any]:
    """Each engine's CUDA cache at benchmark size, built from the tensors the engine allocates."""
    import torch

    from kvstore_client import kv_layout

    dev, dt = "cuda", torch.float16
    rows = blocks * TOKENS + TOKENS
    return {
        "sglang_mha_nhd": lambda: kv_layout.sglang_mha([torch.empty(rows, HEADS, DIM, dtype=dt, device=dev) for _ in range(LAYERS)],
                                                       [torch.empty(rows, HEADS, DIM, dtype=dt, device=dev) for _ in range(LAYERS)], TOKENS),
        "sglang_mha_hnd": lambda: kv_layout.sglang_mha([torch.empty(blocks, HEADS, TOKENS, DIM, dtype=dt, device=dev) for _ in range(LAYERS)],
                                                       [torch.empty(blocks, HEADS, TOKENS, DIM, dtype=dt, device=dev) for _ in range(LAYERS)], TOKENS),
        "vllm_nhd": lambda: kv_layout.vllm([torch.empty(blocks, TOKENS, HEADS, 2 * DIM, dtype=dt, device=dev).transpose(1, 2)
                                            for _ in range(LAYERS)]),
        "vllm_hnd": lambda: kv_layout.vllm([torch.empty(blocks, HEADS, TOKENS, 2 * DIM, dtype=dt, device=dev) for _ in range(LAYERS)]),
        "vllm_2bnhd": lambda: kv_layout.vllm([torch.empty(2, blocks, TOKENS, HEADS, DIM, dtype=dt, device=dev) for _ in range(LAYERS)]),
    }


def page_shape() -> Any:
    from kvstore_client import kv_layout

    return kv_layout.PageShape(kv=2, layers=LAYERS, tokens=TOKENS, heads=HEADS, dim=DIM, dtype_bytes=2)


def check_and_measure(pages: int, repeats: int) -> dict[str, Any]:
    import cupy
    import numpy as np

    from kvstore.tiers.dram import Arena
    from kvstore.tiers.hbm import CudaPool
    from kvstore_client import kv_layout
    from kvstore_client.arena import ArenaMapping
    from kvstore_client.gpu_device import CudaDevice

    shape = page_shape()
    page_bytes, total = shape.page_bytes, pages * shape.page_bytes
    device = CudaDevice()
    arena = Arena(2 * total + (1 << 20), prefault=True)
    mapping = ArenaMapping(os.dup(arena.fd))
    base = device.register_host(mapping.base, mapping.nbytes)
    result: dict[str, Any] = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                              "page_bytes": page_bytes, "pages": pages, "working_set_bytes": total,
                              "repeats": repeats, "checks": {}, "gbs": {}, "ratios": {}}
    rng = np.random.default_rng(0)
    arena_bytes = np.frombuffer(mapping.view, dtype=np.uint8)
    arena_bytes[:2 * total] = rng.integers(0, 256, size=2 * total, dtype=np.uint8)
    src = (base + np.arange(pages, dtype=np.uint64) * page_bytes).astype(np.uint64)          # first half
    dst = (base + total + np.arange(pages, dtype=np.uint64) * page_bytes).astype(np.uint64)  # second half
    blocks = rng.permutation(pages).astype(np.int64)

    # Correctness: arena -> GPU -> arena through every cache layout and page format.
    gather_plans = {}
    for cache_name, make in engine_caches(pages).items():
        cache = make()
        for fmt_name, fmt in kv_layout.PAGE_FORMATS.items():
            plan = kv_layout.plan(shape, fmt, cache)
            arena_bytes[total:2 * total] = 0
            device.pages_to_cache(plan, src, blocks)
            device.cache_to_pages(plan, dst, blocks)
            same = bool(np.array_equal(arena_bytes[:total], arena_bytes[total:2 * total]))
            result["checks"][f"arena_gpu_arena/{cache_name}/{fmt_name}"] = "ok" if same else "bytes differ"
            gather_plans[(cache_name, fmt_name)] = (plan, cache)

    # arena -> GPU: the gather kernel from the registered arena vs cudaMemcpy from it vs pinned H2D.
    plan, _ = gather_plans[("vllm_nhd", "sglang_page_first")]
    flat = cupy.empty(total, dtype=cupy.uint8)
    pinned = cupy.cuda.alloc_pinned_memory(total)
    h2d = cupy.cuda.runtime.memcpyAsync
    stream = cupy.cuda.get_current_stream().ptr
    result["gbs"]["pinned_h2d"] = timed_gbs(total, lambda: h2d(flat.data.ptr, pinned.ptr, total, 1, stream), repeats)
    result["gbs"]["arena_registered_memcpy"] = timed_gbs(
        total, lambda: h2d(flat.data.ptr, int(src[0]), total, 1, stream), repeats)
    for (cache_name, fmt_name), (p, _) in gather_plans.items():
        if fmt_name in ("sglang_page_first", "vllm_block", "lmcache"):
            result["gbs"][f"arena_kernel/{cache_name}/{fmt_name}"] = timed_gbs(
                total, lambda p=p: device.pages_to_cache(p, src, blocks), repeats)

    # The kernel from device pages vs a contiguous device-to-device copy of the same bytes.
    device_pages = cupy.empty(total, dtype=cupy.uint8)
    device_pages[:] = cupy.asarray(arena_bytes[:total])
    on_device = (device_pages.data.ptr + np.arange(pages, dtype=np.uint64) * page_bytes).astype(np.uint64)
    result["gbs"]["d2d_contiguous"] = timed_gbs(total, lambda: h2d(flat.data.ptr, device_pages.data.ptr, total, 3, stream),
                                                repeats)
    for (cache_name, fmt_name), (p, _) in gather_plans.items():
        if fmt_name in ("sglang_page_first", "vllm_block", "lmcache"):
            result["gbs"][f"device_kernel/{cache_name}/{fmt_name}"] = timed_gbs(
                total, lambda p=p: device.pages_to_cache(p, on_device, blocks), repeats)

    # HBM pool over CUDA IPC, read by a second process.
    pool = CudaPool(0, total)
    cupy.cuda.runtime.memcpy(pool.address, device_pages.data.ptr, total, 3)
    expected = int(cupy.asnumpy(device_pages[:1 << 20]).astype(np.uint64).sum())
    child = subprocess.run([sys.executable, __file__, "--ipc-child", pool.ipc_handle.hex(), "--pages", str(pages),
                            "--repeats", str(repeats), "--expect-sum", str(expected)],
                           capture_output=True, text=True, timeout=300)
    if child.returncode != 0:
        result["checks"]["ipc_second_process"] = f"failed: {child.stderr.strip()[-2000:]}"
    else:
        ipc = json.loads(child.stdout.strip().splitlines()[-1])
        result["checks"]["ipc_second_process"] = ipc.pop("check")
        result["gbs"].update(ipc)
    pool.close()
    device.unregister_host(mapping.base)

    gbs = result["gbs"]
    for name, value in gbs.items():
        if name.startswith("arena_"):
            result["ratios"][f"{name} / pinned_h2d"] = value / gbs["pinned_h2d"]
        elif name.startswith("device_kernel"):
            result["ratios"][f"{name} / d2d_contiguous"] = value / gbs["d2d_contiguous"]
        elif name.startswith(("ipc_kernel", "ipc_memcpy")):
            result["ratios"][f"{name} / ipc_child_d2d"] = value / gbs["ipc_child_d2d"]
    return result


def ipc_child(handle_hex: str, pages: int, repeats: int, expect_sum: int) -> dict[str, Any]:
    """In a second process: open the pool once, check its bytes, time reads from it."""
    import cupy
    import numpy as np

    from kvstore_client import kv_layout
    from kvstore_client.gpu_device import CudaDevice

    shape = page_shape()
    total = pages * shape.page_bytes
    device = CudaDevice()
    base = device.open_ipc(bytes.fromhex(handle_hex))
    head = cupy.empty(1 << 20, dtype=cupy.uint8)
    cupy.cuda.runtime.memcpy(head.data.ptr, base, 1 << 20, 3)
    check = "ok" if int(cupy.asnumpy(head).astype(np.uint64).sum()) == expect_sum else "bytes differ"
    flat, local = cupy.empty(total, dtype=cupy.uint8), cupy.zeros(total, dtype=cupy.uint8)
    stream, copy = cupy.cuda.get_current_stream().ptr, cupy.cuda.runtime.memcpyAsync
    out = {"check": check,
           "ipc_child_d2d": timed_gbs(total, lambda: copy(flat.data.ptr, local.data.ptr, total, 3, stream), repeats),
           "ipc_memcpy_from_pool": timed_gbs(total, lambda: copy(flat.data.ptr, base, total, 3, stream), repeats)}
    addrs = (base + np.arange(pages, dtype=np.uint64) * shape.page_bytes).astype(np.uint64)
    blocks = np.random.default_rng(1).permutation(pages).astype(np.int64)
    for cache_name in ("sglang_mha_nhd", "vllm_nhd"):
        cache = engine_caches(pages)[cache_name]()
        plan = kv_layout.plan(shape, kv_layout.PAGE_FORMATS["sglang_page_first"], cache)
        out[f"ipc_kernel/{cache_name}/sglang_page_first"] = timed_gbs(
            total, lambda plan=plan: device.pages_to_cache(plan, addrs, blocks), repeats)
    device.close_ipc(base)
    return out


def tier_check(pages: int, repeats: int, result: dict[str, Any]) -> dict[str, Any]:
    """The HBM tier end to end: a node with a pool on this GPU, this process reading through it (see above)."""
    import tempfile

    import cupy
    import numpy as np
    import torch

    from kvstore_client import KVStoreClient, Namespace, kv_layout
    from kvstore_client.gpu import GpuPages
    from kvstore_client.proto import pb

    shape = page_shape()
    total = pages * shape.page_bytes
    out: dict[str, Any] = {"checks": {}, "gbs": {}, "ratios": {}}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-node-"))
    ready = work / "ready.json"
    reads = max(repeats, 1) + 1
    arena = max(4 * total, 256 << 20)
    with open(work / "node.log", "wb") as node_log:
        node = subprocess.Popen(
            [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0", "--shm-socket",
             str(work / "kvstore.sock"), "--ready-file", str(ready), "--set", f"dram.arena_bytes={arena}",
             "--set", f"hbm.pool_bytes={arena // 2}", "--set", "nvme.enabled=false",
             "--set", f"hbm.promote_hits={reads}"], stdout=node_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if node.poll() is not None or time.monotonic() > deadline:
                out["checks"]["tier_node_started"] = "failed: " + (work / "node.log").read_text()[-2000:]
                return out
            time.sleep(0.05)
        address = json.loads(ready.read_text())["grpc_address"]
        fmt = kv_layout.PAGE_FORMATS["sglang_page_first"]
        generator = torch.Generator(device="cuda").manual_seed(7)
        put_from = [torch.randint(-32768, 32767, (pages, TOKENS, HEADS, 2 * DIM), dtype=torch.int16, device="cuda",
                                  generator=generator).view(torch.float16) for _ in range(LAYERS)]
        load_into = [torch.zeros_like(t) for t in put_from]
        source = kv_layout.vllm([t.transpose(1, 2) for t in put_from])
        target = kv_layout.vllm([t.transpose(1, 2) for t in load_into])
        blocks = [int(b) for b in np.random.default_rng(3).permutation(pages)]
        keys = [f"tier-page-{i}" for i in range(pages)]
        ns = Namespace(model="gpu-check-tier", page_bytes=shape.page_bytes)
        index = torch.tensor(blocks, device="cuda")

        def loaded_right() -> bool:
            return all(torch.equal(into.view(torch.int16)[index], put.view(torch.int16))
                       for into, put in zip(load_into, put_from))

        def timed_read() -> float:
            for t in load_into:
                t.zero_()
            torch.cuda.synchronize()
            started = time.perf_counter()
            assert gpu.get_to_gpu(ns, keys, target, fmt, blocks) == pages
            return time.perf_counter() - started

        with KVStoreClient(address, timeout_s=60) as client:
            gpu = GpuPages(client)
            out["checks"]["tier_put"] = "ok" if gpu.put_from_gpu(ns, keys, source, fmt, list(range(pages))) == pages \
                else "not every page was stored"
            # a warm-up and `repeats` timed reads from the arena; the last of them brings the pages into the pool
            arena_s = [timed_read() for _ in range(reads)][1:]
            out["checks"]["tier_arena_read_bytes"] = "ok" if loaded_right() else "bytes differ"
            waited = time.monotonic()
            while (client.residency(ns, keys=keys).tier_pages()["hbm"] < pages
                   and time.monotonic() < waited + 120):
                time.sleep(0.05)
            in_hbm = client.residency(ns, keys=keys).tier_pages()["hbm"]
            out["tier_promotion_s"] = round(time.monotonic() - waited, 3)
            out["checks"]["tier_pages_in_hbm"] = "ok" if in_hbm == pages else f"{in_hbm} of {pages} in HBM"
            hbm_s = [timed_read() for _ in range(max(repeats, 3))]
            out["checks"]["tier_hbm_read_bytes"] = "ok" if loaded_right() else "bytes differ"
            out["checks"]["tier_read_through_ipc"] = "ok" if gpu._hbm is not None else "the pool was never opened"
            hbm = next(t for t in client.stats().tiers if t.tier == pb.HBM)
            out["tier_hbm_stats"] = {"pages": hbm.pages, "used_bytes": hbm.used_bytes, "hits": hbm.hits,
                                     "promotions": hbm.promotions, "capacity_bytes": hbm.capacity_bytes}
            gpu.close()
        flat, other = cupy.empty(total, dtype=cupy.uint8), cupy.zeros(total, dtype=cupy.uint8)
        stream = cupy.cuda.get_current_stream().ptr
        d2d = timed_gbs(total, lambda: cupy.cuda.runtime.memcpyAsync(flat.data.ptr, other.data.ptr, total, 3, stream),
                        repeats)
        gbs = out["gbs"]
        gbs["tier_arena_get_to_gpu"] = total / statistics.median(arena_s) / 1e9
        gbs["tier_hbm_get_to_gpu"] = total / statistics.median(hbm_s) / 1e9
        gbs["tier_d2d_contiguous"] = d2d
        out["ratios"]["tier_arena_get_to_gpu / pinned_h2d"] = gbs["tier_arena_get_to_gpu"] / result["gbs"]["pinned_h2d"]
        out["ratios"]["tier_hbm_get_to_gpu / tier_d2d_contiguous"] = gbs["tier_hbm_get_to_gpu"] / d2d
        out["ratios"]["tier_hbm_get_to_gpu / tier_arena_get_to_gpu"] = (gbs["tier_hbm_get_to_gpu"]
                                                                        / gbs["tier_arena_get_to_gpu"])
    finally:
        node.terminate()
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "gpu_check.json"))
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ipc-child", default="")
    parser.add_argument("--expect-sum", type=int, default=0)
    parser.add_argument("--no-tier", action="store_true", help="skip the HBM tier on a node")
    args = parser.parse_args()
    missing = gpu_missing()
    if missing:
        print(f"gpu_check: no GPU to check: {missing}. Nothing was measured.", file=sys.stderr)
        return 2
    if args.ipc_child:
        print(json.dumps(ipc_child(args.ipc_child, args.pages, args.repeats, args.expect_sum)))
        return 0
    started = time.monotonic()
    result = check_and_measure(args.pages, args.repeats)
    if not args.no_tier:
        tier = tier_check(args.pages, args.repeats, result)
        for part in ("checks", "gbs", "ratios"):
            result[part].update(tier.pop(part))
        result.update(tier)
    result["seconds"] = round(time.monotonic() - started, 1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    failed = [name for name, state in result["checks"].items() if state != "ok"]
    print(f"{result['device']}: {len(result['checks']) - len(failed)}/{len(result['checks'])} checks ok "
          f"({args.pages} pages of {result['page_bytes']} bytes, {result['seconds']} s)")
    for name in failed:
        print(f"  FAILED {name}: {result['checks'][name]}")
    for name, value in result["gbs"].items():
        print(f"  {name:60s} {value:8.1f} GB/s")
    for name, value in result["ratios"].items():
        print(f"  {name:80s} {value:6.2f}")
    print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
