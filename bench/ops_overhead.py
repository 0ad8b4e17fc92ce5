"""What the operations layer costs the request path: local-channel round trips with metrics
on and off, and the time one Prometheus scrape holds a node with many namespaces.

    python bench/ops_overhead.py [--json out.json] [--calls 20000]

Two real servers run side by side, one with ops.metrics_address="" (no RPC histogram, no
endpoint) and one with metrics on; the client alternates blocks of calls between them so
drift on a shared machine hits both alike. Client on CPU 0, servers on CPU 1 (taskset).
Reported: median and p99 round trip per configuration and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request

from _server import ServerProcess
from _timing import call_times
from kvstore_client import KVStoreClient, Namespace
from kvstore_client.proto import pb

BLOCK = 500


def round_trips(client: KVStoreClient, request: pb.LookupRequest, calls: int) -> list[float]:
    return call_times(client._local, "Lookup", request, calls)


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"median_us": statistics.median(ordered) * 1e6, "p99_us": ordered[int(len(ordered) * 0.99)] * 1e6}


def scrape_ms(server: ServerProcess, namespaces: int) -> float:
    with open(os.path.join(server.tmp.name, "ready.json")) as f:
        port = json.load(f)["metrics_port"]
    with KVStoreClient(server.address) as client:
        for i in range(namespaces):
            client._namespace_id(Namespace(model=f"scrape-{i}", page_bytes=4096))
    times = []
    for _ in range(20):
        started = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            response.read()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--namespaces", type=int, default=1000)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    servers = {"metrics_off": ServerProcess("dram.arena_bytes=256MiB", "ops.metrics_address=", cpus="1"),
               "metrics_on": ServerProcess("dram.arena_bytes=256MiB", cpus="1")}
    try:
        ns = Namespace(model="overhead", page_bytes=4096)
        clients = {name: KVStoreClient(s.address) for name, s in servers.items()}
        requests = {name: pb.LookupRequest(namespace_id=c._namespace_id(ns), keys=[b"k"]) for name, c in clients.items()}
        samples: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(args.calls // BLOCK):
            for name, client in clients.items():
                samples[name] += round_trips(client, requests[name], BLOCK)
        for client in clients.values():
            client.close()
        result = {name: summary(s) for name, s in samples.items()}
        result["median_ratio_on_vs_off"] = result["metrics_on"]["median_us"] / result["metrics_off"]["median_us"]
        result["scrape_ms_median"] = scrape_ms(servers["metrics_on"], args.namespaces)
        result["scrape_namespaces"] = args.namespaces
        result["calls_per_config"] = len(samples["metrics_on"])
    finally:
        for server in servers.values():
            server.stop()
    print(f"{'config':<12} {'median us':>10} {'p99 us':>10}")
    for name in servers:
        print(f"{name:<12} {result[name]['median_us']:>10.1f} {result[name]['p99_us']:>10.1f}")
    print(f"metrics on / off (median): {result['median_ratio_on_vs_off']:.3f}")
    print(f"one scrape with {args.namespaces} namespaces: {result['scrape_ms_median']:.1f} ms (median of 20)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
