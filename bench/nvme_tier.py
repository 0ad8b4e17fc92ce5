"""NVMe tier: cold promotion GB/s next to a direct read of the same disk, and start-up time against page count.

    python bench/nvme_tier.py [--json out.json] [--working-set-mib 1024] [--rebuild-pages 100000,1000000]

Promotion: pages are put through a real kvstore-server (write-through to one LMDB shard),
the server is stopped, the shard's files are dropped from the page cache
(posix_fadvise DONTNEED), the server restarts with an empty DRAM tier, and a client gets
every page in batches of 128 (policy wait_complete: each page is read from disk straight
into a DRAM slot, verified, then copied to the client). The baseline, interleaved with it
`--repeats` times (medians reported): a file of the same size in the same directory,
dropped from the page cache the same way, read sequentially (buffered, and O_DIRECT) in
4 MiB reads.

Rebuild: shards of N small pages (chains of 64, 1 KiB each) are written directly, and a
server is started on them; the table gives its own "recovery complete" time and pages/s.
Client on CPU 0, server on CPU 1 (taskset).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import statistics
import tempfile
import time

import numpy as np

from _server import ServerProcess
from kvstore.tiers.nvme import NvmeTier, StoredPage
from kvstore_client import KVStoreClient, Namespace, namespace_id

READ_CHUNK = 4 << 20


def drop_cache(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def direct_read_gbps(path: str, nbytes: int, o_direct: bool) -> float:
    drop_cache(os.path.dirname(path))
    buf = mmap.mmap(-1, READ_CHUNK)  # page-aligned, as O_DIRECT requires
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if o_direct else 0))
    started = time.perf_counter()
    try:
        done = 0
        while done < nbytes:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    return done / (time.perf_counter() - started) / 1e9


def promotion(workdir: str, working_set: int, page_bytes: int, repeats: int) -> dict:
    shard = os.path.join(workdir, f"shard-{page_bytes}")
    settings = [f"dram.arena_bytes={working_set + (256 << 20)}", "nvme.enabled=true", f"nvme.paths={shard}",
                f"nvme.map_bytes={2 * working_set + (256 << 20)}", "controller.write_batch_pages=16"]
    pages = working_set // page_bytes
    ns = Namespace(model="bench-nvme", page_bytes=page_bytes)
    keys = [f"p{i}".encode() for i in range(pages)]
    data = np.random.default_rng(1).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    server = ServerProcess(*settings, cpus="1")
    try:
        with KVStoreClient(server.address, timeout_s=60) as client:
            for start in range(0, pages, 128):
                assert client.put(ns, keys[start:start + 128], data[start:start + 128]) == len(keys[start:start + 128])
            while client.stats().tiers[1].pages < pages:
                time.sleep(0.2)
    finally:
        server.stop()
    baseline = os.path.join(workdir, "baseline.bin")
    with open(baseline, "wb") as f:
        f.write(data.tobytes())
    out = np.ones_like(data)
    cold, buffered, direct = [], [], []
    for _ in range(repeats):  # interleaved: this disk is shared and its speed drifts
        drop_cache(shard)
        server = ServerProcess(*settings, cpus="1")
        try:
            with KVStoreClient(server.address, timeout_s=120) as client:
                started = time.perf_counter()
                for start in range(0, pages, 128):
                    batch = keys[start:start + 128]
                    assert client.get(ns, batch, out[start:start + 128]) == len(batch)
                cold.append(working_set / (time.perf_counter() - started) / 1e9)
        finally:
            server.stop()
        buffered.append(direct_read_gbps(baseline, working_set, o_direct=False))
        direct.append(direct_read_gbps(baseline, working_set, o_direct=True))
    os.unlink(baseline)
    assert np.array_equal(out[::97], data[::97])
    cold_gbps, buffered_gbps, direct_gbps = (statistics.median(v) for v in (cold, buffered, direct))
    return {"page_bytes": page_bytes, "pages": pages, "repeats": repeats, "cold_get_gbps": cold_gbps,
            "disk_read_buffered_gbps": buffered_gbps, "disk_read_o_direct_gbps": direct_gbps,
            "ratio_vs_buffered": cold_gbps / buffered_gbps, "ratio_vs_o_direct": cold_gbps / direct_gbps,
            "runs": {"cold_get": cold, "buffered": buffered, "o_direct": direct}}


def rebuild(workdir: str, page_count: int) -> dict:
    shard = os.path.join(workdir, f"rebuild-{page_count}")
    page_bytes = 1024
    ns = Namespace(model="bench-rebuild", page_bytes=page_bytes)
    ns_id = namespace_id(ns)
    tier = NvmeTier((shard,), map_bytes=page_count * 3 * 1024 + (256 << 20))
    tier.save_namespace(ns_id, ns.__dict__)
    payload = memoryview(bytes(page_bytes))
    batch = []
    for i in range(page_count):
        chain, pos = divmod(i, 64)
        parent = f"c{chain}-{pos - 1}".encode() if pos else b""
        batch.append((StoredPage(ns_id, f"c{chain}-{pos}".encode(), parent, page_bytes, 0), payload))
        if len(batch) == 20000:
            tier.write(0, batch)
            batch = []
    if batch:
        tier.write(0, batch)
    tier.close()
    started = time.perf_counter()
    server = ServerProcess("nvme.enabled=true", f"nvme.paths={shard}", f"nvme.map_bytes={page_count * 3 * 1024 + (256 << 20)}",
                           "dram.arena_bytes=64MiB", "dram.slab_bytes=4MiB", "server.log_level=INFO", cpus="1",
                           log_path=os.path.join(workdir, f"rebuild-{page_count}.log"))
    ready_s = time.perf_counter() - started
    server.stop()
    with open(os.path.join(workdir, f"rebuild-{page_count}.log")) as f:
        match = re.search(r"recovery complete pages=(\d+) duration_ms=([\d.]+)", f.read())
    pages, duration_ms = int(match.group(1)), float(match.group(2))
    assert pages == page_count, (pages, page_count)
    return {"pages": pages, "rebuild_s": duration_ms / 1e3, "pages_per_s": pages / (duration_ms / 1e3),
            "start_to_ready_s": ready_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--working-set-mib", type=int, default=1024)
    parser.add_argument("--page-sizes", default=str(1 << 20))
    parser.add_argument("--rebuild-pages", default="100000,1000000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the shards go (default: a temp dir under ./bench)")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(base, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base, prefix="nvme-") as workdir:
        promotions = [promotion(workdir, args.working_set_mib << 20, int(p), args.repeats)
                      for p in args.page_sizes.split(",") if p]
        rebuilds = [rebuild(workdir, int(n)) for n in args.rebuild_pages.split(",") if n]
    print(f"NVMe tier, shards under {base}; client on CPU 0, server on CPU 1")
    print(f"{'page':>8} {'cold get GB/s':>14} {'disk buffered':>14} {'disk O_DIRECT':>14} {'ratio (buf)':>12} {'ratio (direct)':>15}")
    for r in promotions:
        print(f"{r['page_bytes'] >> 10:>6}Ki {r['cold_get_gbps']:>14.2f} {r['disk_read_buffered_gbps']:>14.2f} "
              f"{r['disk_read_o_direct_gbps']:>14.2f} {r['ratio_vs_buffered']:>12.2f} {r['ratio_vs_o_direct']:>15.2f}")
    print(f"{'pages':>10} {'rebuild s':>10} {'pages/s':>10} {'start->ready s':>15}")
    for r in rebuilds:
        print(f"{r['pages']:>10} {r['rebuild_s']:>10.2f} {r['pages_per_s']:>10.0f} {r['start_to_ready_s']:>15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "nvme_tier", "promotion": promotions, "rebuild": rebuilds}, f, indent=2)


if __name__ == "__main__":
    main()
