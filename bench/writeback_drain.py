"""Write-back of one long chain: seconds until a chain put in one call is all on NVMe, beside one LMDB shard alone.

    python bench/writeback_drain.py [--json out.json] [--pages 32768] [--page-kib 4] [--repeats 3]

A real kvstore-server (one NVMe path in a temp dir under /var/tmp, controller.write_policy=write_back,
high_watermark 0.3, an arena twice the chain's bytes, so DRAM is above the watermark and never short)
takes one chain of `--pages` pages, put in batches of 1,024 pages, each continuing the last: one prompt
of a long context. The clock starts before the first put and stops once the node's NVMe tier has taken
in every page (Stats, NVMe bytes_in, polled every 20 ms); the node's CPU seconds (user + system, from
/proc) are read then. Nothing else asks the node to write pages down: DRAM never runs short, so only the
controller's write-back passes move them. The bound beside it: the same pages (headers and bytes)
written straight into an LMDB shard of their own in the same transactions (controller.write_txn_bytes),
one after another. Client on CPU 0, server on CPU 1 (taskset); repeats alternate, medians reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from _server import ServerProcess
from full_cache_put import node_cpu_seconds
from kvstore.config import ControllerConfig
from kvstore.tiers.nvme import NvmeTier, StoredPage
from kvstore_client import KVStoreClient, Namespace
from kvstore_client.proto import pb

PUT_PAGES = 1024
SLAB_BYTES = 4 << 20


def node_drain(pages: int, page_bytes: int, src: np.ndarray, run: int) -> dict:
    directory = tempfile.mkdtemp(prefix="kvstore-drain-", dir="/var/tmp")
    arena = -(-2 * pages * page_bytes // SLAB_BYTES) * SLAB_BYTES   # the chain fills about half: above the watermark
    server = ServerProcess(f"dram.arena_bytes={arena}", f"dram.slab_bytes={SLAB_BYTES}",
                           "nvme.enabled=true", f"nvme.paths={directory}", "nvme.map_bytes=8GiB",
                           "controller.write_policy=write_back", "controller.high_watermark=0.3", cpus="1")
    try:
        with KVStoreClient(server.address) as client:
            ns = Namespace(model="drain", page_bytes=page_bytes)
            keys = [f"r{run}-{i}" for i in range(pages)]

            def on_nvme() -> int:
                nvme = next((t for t in client.stats().tiers if t.tier == pb.NVME), pb.TierStats())
                return nvme.bytes_in // page_bytes

            started = time.perf_counter()
            for start in range(0, pages, PUT_PAGES):
                stop = min(start + PUT_PAGES, pages)
                assert client.put(ns, keys[start:stop], src[start:stop],
                                  parent=keys[start - 1] if start else None) == stop - start
            put_s = time.perf_counter() - started
            while on_nvme() < pages and time.perf_counter() - started < 600:
                time.sleep(0.02)
            drained_s = time.perf_counter() - started
            written = on_nvme()
            cpu_s = node_cpu_seconds(server.process.pid)
    finally:
        server.stop()
        shutil.rmtree(directory)
    return {"put_s": put_s, "drained_s": drained_s, "pages_on_nvme": written, "node_cpu_s": cpu_s}


def shard_alone(pages: int, page_bytes: int, src: np.ndarray) -> float:
    """Seconds to write the chain's pages into one LMDB shard of their own, in write_txn_bytes transactions."""
    directory = tempfile.mkdtemp(prefix="kvstore-drain-alone-", dir="/var/tmp")
    tier = NvmeTier((directory,), 8 << 30)
    per_txn = max(1, ControllerConfig().write_txn_bytes // page_bytes)
    try:
        started = time.perf_counter()
        for start in range(0, pages, per_txn):
            tier.write(0, [(StoredPage(1, f"a-{i}".encode(), f"a-{i - 1}".encode() if i else b"", page_bytes, i),
                            memoryview(src[i])) for i in range(start, min(start + per_txn, pages))])
        return time.perf_counter() - started
    finally:
        tier.close()
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=32768)
    parser.add_argument("--page-kib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if args.pages * (args.page_kib << 10) < 2 * SLAB_BYTES:   # else slabs round the arena up past the watermark
        parser.error(f"the chain must be at least {2 * SLAB_BYTES >> 20} MiB: raise --pages or --page-kib")
    os.sched_setaffinity(0, {0})
    page_bytes = args.page_kib << 10
    src = np.random.default_rng(0).integers(0, 255, (args.pages, page_bytes), dtype=np.uint8)
    runs, alone = [], []
    for run in range(args.repeats):
        runs.append(node_drain(args.pages, page_bytes, src, run))
        alone.append(shard_alone(args.pages, page_bytes, src))
        print(f"run {run}: put {runs[-1]['put_s']:.2f} s, all on NVMe after {runs[-1]['drained_s']:.2f} s "
              f"({runs[-1]['pages_on_nvme']} pages), node CPU {runs[-1]['node_cpu_s']:.1f} s; "
              f"one shard alone {alone[-1]:.2f} s", flush=True)
    result = {"bench": "writeback_drain", "pages": args.pages, "page_bytes": page_bytes,
              "drained_s": statistics.median(r["drained_s"] for r in runs),
              "node_cpu_s": statistics.median(r["node_cpu_s"] for r in runs),
              "shard_alone_s": statistics.median(alone), "runs": runs, "shard_alone_runs_s": alone}
    print(f"{args.pages} pages of {args.page_kib} KiB in one chain: on NVMe {result['drained_s']:.2f} s after the "
          f"first put (median of {args.repeats}), node CPU {result['node_cpu_s']:.1f} s; "
          f"one LMDB shard alone {result['shard_alone_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
