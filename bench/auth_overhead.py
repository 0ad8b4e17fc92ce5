"""What authentication costs: Lookup round trips and TCP put/get GB/s with tokens, and with tokens over
TLS, as ratios to a node without authentication, in the same run.

    python bench/auth_overhead.py [--json bench/results/auth_overhead.json] [--calls 6000] [--working-set-mib 64]

Four real servers run side by side: "none" (no auth.*), "token" (auth.tokens_file; the client sends a
tenant's bearer token on every call and a HELLO with its data ticket on each TCP connection; every
frame's lease is checked against the connection's tenant), "token+tls" (the same, gRPC over TLS with a
P-256 certificate), "tls+tcp" (the same, and the TCP data plane over TLS too: tcp.tls_cert). The client alternates blocks of calls between them, so drift on a shared machine
hits all alike; ratios are per round, then the median. Client on CPU 0, servers on CPU 1 (taskset).
- Lookup: one gRPC Lookup of 32 keys (a miss), median and p99 round trip.
- TCP: 1 MiB pages of a working set put then got in batches of 16 over the TCP data plane (gRPC
  control). The data plane is plaintext except in "tls+tcp" (Python's ssl, OpenSSL's AES-GCM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from _server import ServerProcess  # noqa: E402
from _timing import call_times  # noqa: E402
from identities import Certificates, Tokens  # noqa: E402
from kvstore_client import KVStoreClient, Namespace  # noqa: E402
from kvstore_client.proto import pb  # noqa: E402

BLOCK = 300
PAGE = 1 << 20
BATCH = 16


def lookup_block(client: KVStoreClient, ns_id: int, calls: int) -> list[float]:
    request = pb.LookupRequest(namespace_id=ns_id, keys=[f"miss{i:04d}".encode() for i in range(32)])
    return call_times(client._grpc, "Lookup", request, calls)


def tcp_round(client: KVStoreClient, ns: Namespace, data: np.ndarray, round_: int) -> tuple[float, float]:
    keys = [f"r{round_}-{i}" for i in range(len(data))]
    out = np.empty_like(data)
    started = time.perf_counter()
    for start in range(0, len(data), BATCH):
        assert client.put(ns, keys[start:start + BATCH], data[start:start + BATCH]) == min(BATCH, len(data) - start)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    for start in range(0, len(data), BATCH):
        assert client.get(ns, keys[start:start + BATCH], out[start:start + BATCH]) == min(BATCH, len(data) - start)
    get_s = time.perf_counter() - started
    client.clear(ns)
    return data.nbytes / put_s / 1e9, data.nbytes / get_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--calls", type=int, default=6000, help="Lookups per configuration")
    parser.add_argument("--working-set-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="TCP put/get rounds per configuration")
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    tmp = tempfile.TemporaryDirectory(prefix="kvstore-auth-bench-")
    from pathlib import Path
    tokens, certs = Tokens(Path(tmp.name)), Certificates(Path(tmp.name))
    arena = f"dram.arena_bytes={max(128, 2 * args.working_set_mib)}MiB"
    common = (arena, "dram.slab_bytes=4MiB", "shm.enabled=false")
    token = (f"auth.tokens_file={tokens.path}",)
    tls = (f"auth.tls_cert={certs.server_cert}", f"auth.tls_key={certs.server_key}")
    tcp_tls = (f"tcp.tls_cert={certs.server_cert}", f"tcp.tls_key={certs.server_key}")
    servers = {"none": ServerProcess(*common, cpus="1"), "token": ServerProcess(*common, *token, cpus="1"),
               "token+tls": ServerProcess(*common, *token, *tls, cpus="1"),
               "tls+tcp": ServerProcess(*common, *token, *tls, *tcp_tls, cpus="1")}
    credentials = {"none": {}, "token": {"token": tokens.alice},
                   "token+tls": {"token": tokens.alice, "tls_ca": certs.ca},
                   "tls+tcp": {"token": tokens.alice, "tls_ca": certs.ca}}
    ns = Namespace(model="auth-bench", page_bytes=PAGE)
    data = np.random.default_rng(0).integers(0, 256, (args.working_set_mib, PAGE), dtype=np.uint8)
    try:
        clients = {name: KVStoreClient(server.address, control="grpc", transport="tcp", timeout_s=30,
                                       **credentials[name]) for name, server in servers.items()}
        ns_ids = {name: client._namespace_id(ns) for name, client in clients.items()}
        for name, client in clients.items():   # warm-up: connections, arena pages touched once
            lookup_block(client, ns_ids[name], 200)
            tcp_round(client, ns, data, -1)
        lookups: dict[str, list[float]] = {name: [] for name in clients}
        for block in range(args.calls // BLOCK):
            order = list(clients)[block % len(clients):] + list(clients)[:block % len(clients)]
            for name in order:
                lookups[name] += lookup_block(clients[name], ns_ids[name], BLOCK)
        tcp: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
        for round_ in range(args.rounds):
            order = list(clients)[round_ % len(clients):] + list(clients)[:round_ % len(clients)]
            for name in order:
                tcp[name].append(tcp_round(clients[name], ns, data, round_))
        for client in clients.values():
            client.close()
    finally:
        for server in servers.values():
            server.stop()
    results = {"cpu": "client on CPU 0, servers on CPU 1 (taskset)", "lookup_keys": 32, "page_bytes": PAGE,
               "working_set_bytes": data.nbytes, "batch_pages": BATCH, "configs": {}}
    base_median = statistics.median(lookups["none"])
    for name in clients:
        ordered = sorted(lookups[name])
        put = [p for p, _ in tcp[name]]
        get = [g for _, g in tcp[name]]
        row = {"lookup_median_us": statistics.median(ordered) * 1e6, "lookup_p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
               "lookup_ratio_to_none": statistics.median(ordered) / base_median,
               "tcp_put_gbps": statistics.median(put), "tcp_get_gbps": statistics.median(get),
               "tcp_put_ratio_to_none": statistics.median([p / b for p, (b, _) in zip(put, tcp["none"])]),
               "tcp_get_ratio_to_none": statistics.median([g / b for g, (_, b) in zip(get, tcp["none"])])}
        results["configs"][name] = row
    print(f"{'config':<10} {'lookup p50 us':>14} {'p99 us':>8} {'x none':>7} {'put GB/s':>9} {'x none':>7} "
          f"{'get GB/s':>9} {'x none':>7}")
    for name, row in results["configs"].items():
        print(f"{name:<10} {row['lookup_median_us']:>14.0f} {row['lookup_p99_us']:>8.0f} {row['lookup_ratio_to_none']:>7.2f} "
              f"{row['tcp_put_gbps']:>9.2f} {row['tcp_put_ratio_to_none']:>7.2f} {row['tcp_get_gbps']:>9.2f} "
              f"{row['tcp_get_ratio_to_none']:>7.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
