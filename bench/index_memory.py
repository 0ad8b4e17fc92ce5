"""Server memory per indexed page, and lookup latency, with the C page index and the Python one.

    python bench/index_memory.py [--pages 1000000,3000000] [--python-pages 1000000] [--json PATH]
    (make bench-hot-path runs it after bench/hot_path.py)

Memory: a real node (`python -m kvstore.server`, NVMe off, the DRAM arena sized to hold every page)
takes 4 KiB pages through the public SDK, 1024 pages a put, each put continuing the chain of the
one before for 8 puts (a 128k-token prompt at 16 tokens a page), then a new chain. The figure is
the growth of the node's RssAnon (/proc/PID/status: its heap, not the arena, which is a memfd and
counts as RssShmem) from after the first put to each checkpoint, divided by the pages added since:
everything the node keeps per committed page (index, allocator, quota ledger, Python objects), not
only the index. Keys are 64-character hex strings (SGLang's prefix hashes) or 32 raw bytes
(--key-kind). The Python index runs to --python-pages only (it needs about 4x the memory).

Lookups: one SDK `lookup(keys=...)` of 1k, 8k and 32k present pages of one chain, median and
minimum of --lookup-repeats, same node settings but for the index.

Placement: the client runs on --client-cpu, the node on --server-cpu (taskset).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from _server import ServerProcess
from kvstore_client import KVStoreClient, Namespace

BATCH_PAGES = 1024
CHAIN_BATCHES = 8
PAGE_BYTES = 4096
LOOKUP_PAGES = (1024, 8192, 32768)


def rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc status")


def make_keys(rng: np.random.Generator, kind: str, count: int) -> list:
    raw = rng.bytes(32 * count)
    if kind == "raw32":
        return [raw[i:i + 32] for i in range(0, 32 * count, 32)]
    text = raw.hex()
    return [text[i:i + 64] for i in range(0, 64 * count, 64)]


def memory_run(args, native: bool, pages: int, checkpoints: list[int]) -> dict:
    arena = (pages + 2 * BATCH_PAGES) * PAGE_BYTES + (256 << 20)
    server = ServerProcess(f"dram.arena_bytes={arena}", f"server.native_index={str(native).lower()}",
                           cpus=args.server_cpu)
    rng = np.random.default_rng(7)
    ns = Namespace(model="index-memory", page_bytes=PAGE_BYTES)
    page = np.zeros((BATCH_PAGES, PAGE_BYTES), dtype=np.uint8)
    rows, base, parent = [], None, None
    try:
        with KVStoreClient(server.address) as client:
            started = time.perf_counter()
            for batch in range(-(-pages // BATCH_PAGES)):
                keys = make_keys(rng, args.key_kind, BATCH_PAGES)
                stored = client.put(ns, keys, page, parent=parent if batch % CHAIN_BATCHES else None)
                assert stored == BATCH_PAGES, stored
                parent = keys[-1]
                done = (batch + 1) * BATCH_PAGES
                if batch == 0:
                    base = rss_anon_bytes(server.process.pid)
                elif checkpoints and done >= checkpoints[0]:
                    checkpoints.pop(0)
                    grown = rss_anon_bytes(server.process.pid) - base
                    rows.append({"pages": done, "rss_anon_growth_bytes": grown,
                                 "bytes_per_page": grown / (done - BATCH_PAGES),
                                 "put_pages_per_s": done / (time.perf_counter() - started)})
                    print(f"  {'native' if native else 'python'} index, {done:>9} pages: "
                          f"{rows[-1]['bytes_per_page']:.1f} bytes/page", flush=True)
    finally:
        server.stop()
    return {"index": "native" if native else "python", "key_kind": args.key_kind, "checkpoints": rows}


def lookup_run(args, native: bool) -> list[dict]:
    most = max(LOOKUP_PAGES)
    rng = np.random.default_rng(3)
    keys = make_keys(rng, args.key_kind, most)
    ns = Namespace(model="index-lookup", page_bytes=PAGE_BYTES)
    server = ServerProcess(f"dram.arena_bytes={most * PAGE_BYTES + (128 << 20)}",
                           f"server.native_index={str(native).lower()}", cpus=args.server_cpu)
    rows = []
    try:
        with KVStoreClient(server.address) as client:
            page = np.zeros((BATCH_PAGES, PAGE_BYTES), dtype=np.uint8)
            for start in range(0, most, BATCH_PAGES):
                parent = keys[start - 1] if start else None
                assert client.put(ns, keys[start:start + BATCH_PAGES], page, parent=parent) == BATCH_PAGES
            for n in LOOKUP_PAGES:
                times = []
                for _ in range(args.lookup_repeats):
                    started = time.perf_counter()
                    assert client.lookup(ns, keys=keys[:n]) == n
                    times.append(time.perf_counter() - started)
                rows.append({"index": "native" if native else "python", "pages": n,
                             "ms_median": statistics.median(times) * 1e3, "ms_min": min(times) * 1e3})
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="1000000,3000000",
                        help="checkpoints of the native run; the last is its size")
    parser.add_argument("--python-pages", type=int, default=1_000_000, help="size of the Python index's run; 0: skip")
    parser.add_argument("--key-kind", choices=("hex64", "raw32"), default="hex64")
    parser.add_argument("--lookup-repeats", type=int, default=30)
    parser.add_argument("--client-cpu", type=int, default=0)
    parser.add_argument("--server-cpu", default="1")
    parser.add_argument("--skip", default="", help="comma-separated parts not to run: memory,lookup")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.client_cpu})
    skip = set(args.skip.split(",")) - {""}
    checkpoints = sorted(int(p) for p in args.pages.split(","))
    report = {"bench": "index_memory", "page_bytes": PAGE_BYTES, "key_kind": args.key_kind,
              "batch_pages": BATCH_PAGES, "chain_pages": BATCH_PAGES * CHAIN_BATCHES,
              "placement": f"client on CPU {args.client_cpu}, node on CPU {args.server_cpu}",
              "memory": [], "lookup": []}
    if "memory" not in skip:
        print(f"memory per page ({args.key_kind} keys, 4 KiB pages; RssAnon growth of the node):")
        report["memory"].append(memory_run(args, True, checkpoints[-1], list(checkpoints)))
        if args.python_pages:
            python_checkpoints = [p for p in checkpoints if p < args.python_pages] + [args.python_pages]
            report["memory"].append(memory_run(args, False, args.python_pages, python_checkpoints))
    if "lookup" not in skip:
        for native in (True, False):
            report["lookup"] += lookup_run(args, native)
        print("lookup latency, one SDK call by keys (ms, median / min):")
        for row in report["lookup"]:
            print(f"  {row['index']:>6} {row['pages']:>6} pages: {row['ms_median']:.2f} / {row['ms_min']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
