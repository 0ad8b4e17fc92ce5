"""Put and get GB/s through a real kvstore-server over shared memory, next to plain memcpy.

    python bench/shm_throughput.py [--json out.json] [--working-set-mib 1024] [--batch 128]

For each page size, a working set of distinct pages (default 1 GiB, larger than every
cache) is put in batches of `--batch` pages, then got back; a plain memcpy of the same
pages between two buffers of the same size runs in the same process, in the same run,
and the table reports each figure as a ratio of it. Client and server are pinned to
different cores (taskset): client on CPU 0, server on CPU 1.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import numpy as np

from _server import ServerProcess
from kvstore_client import KVStoreClient, Namespace, page_buffer

PAGE_SIZES = (64 << 10, 1 << 20, 4 << 20)


def _keys(run: int, page_bytes: int, pages: int) -> list[bytes]:
    return [f"r{run}-p{page_bytes}-{i}".encode() for i in range(pages)]


def memcpy_gbps(src: np.ndarray, dst: np.ndarray) -> float:
    page_bytes = src.shape[1]
    s, d = src.ctypes.data, dst.ctypes.data
    started = time.perf_counter()
    for i in range(src.shape[0]):
        ctypes.memmove(d + i * page_bytes, s + i * page_bytes, page_bytes)
    return src.nbytes / (time.perf_counter() - started) / 1e9


def measure(client: KVStoreClient, page_bytes: int, working_set: int, batch: int, repeats: int) -> dict:
    pages = working_set // page_bytes
    src = page_buffer(pages, page_bytes)
    src[:] = np.random.default_rng(page_bytes).integers(0, 255, (pages, page_bytes), dtype=np.uint8)
    dst = page_buffer(pages, page_bytes)
    dst[:] = 1  # faulted in before timing
    ns = Namespace(model="bench", page_bytes=page_bytes)
    memcpy, put, get = [], [], []
    for run in range(repeats):
        memcpy.append(memcpy_gbps(src, dst))
        keys = _keys(run, page_bytes, pages)
        started = time.perf_counter()
        for start in range(0, pages, batch):
            # each batch is its own chain: a new prompt's pages
            stored = client.put(ns, keys[start:start + batch], src[start:start + batch])
            assert stored == len(keys[start:start + batch]), stored
        put.append(src.nbytes / (time.perf_counter() - started) / 1e9)
        started = time.perf_counter()
        for start in range(0, pages, batch):
            loaded = client.get(ns, keys[start:start + batch], dst[start:start + batch])
            assert loaded == len(keys[start:start + batch]), loaded
        get.append(src.nbytes / (time.perf_counter() - started) / 1e9)
        assert np.array_equal(src[::max(1, pages // 7)], dst[::max(1, pages // 7)])
        for start in range(0, pages, batch):
            client.delete(ns, keys[start:start + 1])
    result = {"page_bytes": page_bytes, "pages": pages, "batch_pages": batch,
              "memcpy_gbps": statistics.median(memcpy), "put_gbps": statistics.median(put),
              "get_gbps": statistics.median(get)}
    result["put_ratio"] = result["put_gbps"] / result["memcpy_gbps"]
    result["get_ratio"] = result["get_gbps"] / result["memcpy_gbps"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--working-set-mib", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-sizes", default=",".join(str(p) for p in PAGE_SIZES))
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    working_set = args.working_set_mib << 20
    os.sched_setaffinity(0, {0})
    server = ServerProcess(f"dram.arena_bytes={working_set + (256 << 20)}", cpus="1")
    results = []
    try:
        with KVStoreClient(server.address) as client:
            for page_bytes in (int(p) for p in args.page_sizes.split(",")):
                results.append(measure(client, page_bytes, working_set, args.batch, args.repeats))
    finally:
        server.stop()
    print(f"shared-memory data plane, working set {args.working_set_mib} MiB, batches of {args.batch} pages, "
          f"client on CPU 0, server on CPU 1, median of {args.repeats}")
    print(f"{'page':>8} {'memcpy GB/s':>12} {'put GB/s':>9} {'put/memcpy':>11} {'get GB/s':>9} {'get/memcpy':>11}")
    for r in results:
        print(f"{r['page_bytes'] >> 10:>6}Ki {r['memcpy_gbps']:>12.2f} {r['put_gbps']:>9.2f} {r['put_ratio']:>11.2f} "
              f"{r['get_gbps']:>9.2f} {r['get_ratio']:>11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "shm_throughput", "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
