"""Aggregate get and put throughput of a kvstore cluster: 1 node vs 3 nodes, same clients, same run.

    python bench/cluster_throughput.py [--clients 3] [--seconds 8] [--json bench/results/cluster_throughput.json]

A real etcd and N nodes (1, then 3) on this host; `--clients` processes each use a
KVStoreCluster (shared memory: same host) to put `--chains` chains of `--pages` pages of
`--page-bytes`, then get random chains for `--seconds`. Reported: aggregate put and get GB/s
for each N and the 3/1 ratio. On a machine with few cores this is CPU-bound (clients and
nodes share the cores), so the ratio says what the cluster's fan-out costs here, not what
three machines would give. No CPU pinning.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from pd_handoff import start_cluster  # noqa: E402  (a real etcd and N nodes)


def client(url: str, index: int, args, go, out) -> None:
    import numpy as np
    from kvstore_client.cluster import KVStoreCluster
    from kvstore_client.keys import Namespace, prefix_hashes

    ns = Namespace(model="throughput", page_bytes=args.page_bytes, page_tokens=16)
    rng = random.Random(index)
    chains = [prefix_hashes([index, c] + [rng.randrange(32000) for _ in range(16 * args.pages - 2)], 16)
              for c in range(args.chains)]
    data = np.random.default_rng(index).integers(0, 255, (args.pages, args.page_bytes), dtype=np.uint8)
    with KVStoreCluster(url) as cluster:
        go.wait()
        started = time.perf_counter()
        put_pages = sum(cluster.put(ns, keys, data) for keys in chains)
        put_s = time.perf_counter() - started
        buffer = np.empty_like(data)
        got_pages, started = 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            got_pages += cluster.get(ns, rng.choice(chains), buffer)
        get_s = time.perf_counter() - started
    out.put((put_pages * args.page_bytes, put_s, got_pages * args.page_bytes, get_s))


def measure(nodes: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstore-cluster-bench-") as workdir:
        procs, url = start_cluster(workdir, nodes, args.arena)
        try:
            ctx = mp.get_context("spawn")
            go, out = ctx.Event(), ctx.Queue()
            workers = [ctx.Process(target=client, args=(url, i, args, go, out)) for i in range(args.clients)]
            for w in workers:
                w.start()
            time.sleep(args.warmup_s)
            go.set()
            results = [out.get(timeout=600) for _ in workers]
            for w in workers:
                w.join()
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(30)
    put_bytes = sum(r[0] for r in results)
    get_bytes = sum(r[2] for r in results)
    return {"nodes": nodes, "put_gbps": put_bytes / max(r[1] for r in results) / 1e9,
            "get_gbps": get_bytes / max(r[3] for r in results) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--chains", type=int, default=24)
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--page-bytes", type=int, default=256 << 10)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--arena", default="1GiB")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--json", default="bench/results/cluster_throughput.json")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; {args.clients} client processes, {args.chains} chains x {args.pages} pages x "
          f"{args.page_bytes >> 10} KiB each (working set {args.clients * args.chains * args.pages * args.page_bytes >> 20} MiB)")
    rows = [measure(n, args) for n in (1, 3)]
    for r in rows:
        print(f"{r['nodes']} node(s): put {r['put_gbps']:6.2f} GB/s  get {r['get_gbps']:6.2f} GB/s")
    ratio = {"put": rows[1]["put_gbps"] / rows[0]["put_gbps"], "get": rows[1]["get_gbps"] / rows[0]["get_gbps"]}
    print(f"3 nodes / 1 node: put {ratio['put']:.2f}  get {ratio['get']:.2f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "runs": rows, "ratio_3_over_1": ratio, "cpus": os.cpu_count()}, f, indent=2)


if __name__ == "__main__":
    main()
