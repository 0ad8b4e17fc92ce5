"""Puts of 4 KiB pages into a full cache against puts into one with room, in the same run.

    python bench/full_cache_put.py [--working-set-mib 512] [--rounds 3] [--json bench/results/full_cache_put.json]

A cache in production is full nearly all the time, so every Reserve evicts. Two nodes run side by
side: one whose arena holds the working set (no Reserve evicts), one whose arena is half of it
(every Reserve after the first half evicts least recently used pages). Each round puts a fresh
working set of distinct pages (batches of --batch pages, one chain each) into one node and then the
other; the node with room deletes them after the round (untimed), the full one deletes nothing, so
it stays full. Reported per node: pages/s, and the node's CPU
seconds per page (from /proc, user + system), medians over --rounds after a warm-up round; the
speed goal is the ratio full/room, which is 1 when eviction costs nothing.

Placement: this process (the client) on --client-cpu (0), both nodes on --server-cpu (1).
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

PAGE_BYTES = 4096


def node_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def put_round(client: KVStoreClient, pid: int, pages: np.ndarray, batch: int, prefix: str,
              delete: bool) -> tuple[float, float]:
    """Pages/s and node CPU microseconds per page of one working set's puts (then deleted, untimed, if asked)."""
    namespace = Namespace(model="full-cache-put", page_bytes=PAGE_BYTES)
    keys = [f"{prefix}-{i}" for i in range(len(pages))]
    cpu_before, started = node_cpu_seconds(pid), time.perf_counter()
    for start in range(0, len(pages), batch):
        client.put(namespace, keys[start:start + batch], pages[start:start + batch])
    elapsed, cpu = time.perf_counter() - started, node_cpu_seconds(pid) - cpu_before
    if delete:
        for start in range(0, len(pages), batch):
            client.delete(namespace, keys[start:start + batch])
    return len(pages) / elapsed, cpu / len(pages) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--working-set-mib", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-cpu", type=int, default=0)
    parser.add_argument("--server-cpu", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.client_cpu})
    working_set = args.working_set_mib << 20
    pages = np.random.default_rng(0).integers(0, 255, working_set, dtype=np.uint8).reshape(-1, PAGE_BYTES)
    arenas = {"room": working_set + (256 << 20), "full": working_set // 2}
    nodes = {name: ServerProcess(f"dram.arena_bytes={arena}", "dram.slab_bytes=4MiB", cpus=str(args.server_cpu))
             for name, arena in arenas.items()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in nodes}
    try:
        clients = {name: KVStoreClient(node.address) for name, node in nodes.items()}
        for round_ in range(args.rounds + 1):
            for name, node in nodes.items():
                got = put_round(clients[name], node.process.pid, pages, args.batch, f"r{round_}", name == "room")
                if round_:   # the first round fills the full node: a warm-up
                    samples[name].append(got)
        for client in clients.values():
            client.close()
    finally:
        for node in nodes.values():
            node.stop()
    result = {"working_set_bytes": working_set, "page_bytes": PAGE_BYTES, "batch_pages": args.batch,
              "client_cpu": args.client_cpu, "server_cpu": args.server_cpu, "arena_bytes": arenas}
    for name, rows in samples.items():
        result[name] = {"pages_per_s": statistics.median(r[0] for r in rows),
                        "node_cpu_us_per_page": statistics.median(r[1] for r in rows)}
    result["full_over_room_pages_per_s"] = result["full"]["pages_per_s"] / result["room"]["pages_per_s"]
    for name in nodes:
        print(f"{name:>4}: arena {arenas[name] >> 20} MiB  {result[name]['pages_per_s']:9.0f} pages/s  "
              f"node {result[name]['node_cpu_us_per_page']:.2f} us/page")
    print(f"full/room pages/s: {result['full_over_room_pages_per_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
