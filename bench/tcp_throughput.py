"""TCP put and get GB/s through kvstore, next to a raw Python socket and Redis, in the same run.

    python bench/tcp_throughput.py [--json out.json] [--working-set-mib 256] [--batch 64]

For each page size (1 MiB, 4 MiB) a working set of distinct pages is put in batches of
`--batch` pages and got back, three ways, interleaved batch by batch in a rotating order so
they share the machine's noise (ratios are taken per round, then the median):
  - kvstore: KVStoreClient(transport="tcp") against a real kvstore-server (gRPC control,
    the uvloop data plane moving bytes into and out of arena slots);
  - raw: a plain Python socket peer (bench/_raw_peer.py) doing the same exchange (a
    small request, the page received into or sent from one buffer), the same pipelining;
  - redis: redis-server from apt, redis-py with hiredis, one pipeline per batch (SET, then
    GET copied into the same destination buffer).
Client on CPU 0, every server on CPU 1 (taskset). Loopback; every socket of a row uses the
same congestion control: "default" is the system's (bbr here) for all three; "cubic" sets
TCP_CONGESTION on both ends of kvstore and raw sockets (Redis cannot be told per socket,
so it has no cubic row). Needs redis-server on PATH (apt install redis-server).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from _server import ServerProcess
from kvstore_client import KVStoreClient, Namespace
from kvstore_client.tcp_transport import sendmsg_all
from shm_throughput import page_aligned

HERE = os.path.dirname(os.path.abspath(__file__))
REQUEST_RAW = __import__("struct").Struct("<BII")
RESPONSE_BYTES = 8
GET_WINDOW = 256
SETTLE_S = 0.3      # pause between systems: lets the previous one's frees and acks finish


# -- raw socket ------------------------------------------------------------------------

class RawPeer:
    def __init__(self, nbytes: int, congestion: str):
        self.process = subprocess.Popen(["taskset", "-c", "1", sys.executable, os.path.join(HERE, "_raw_peer.py"),
                                         str(nbytes), congestion], stdout=subprocess.PIPE, text=True)
        port = int(self.process.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if congestion:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        self.header = bytearray(RESPONSE_BYTES)

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            got += self.sock.recv_into(view[got:])

    def put(self, pages: np.ndarray, first_slot: int) -> None:
        page_bytes = pages.shape[1]
        iov = []
        for i in range(pages.shape[0]):
            iov += [REQUEST_RAW.pack(1, first_slot + i, page_bytes), memoryview(pages[i])]
        sendmsg_all(self.sock, iov)
        for _ in range(pages.shape[0]):
            self._recv_into(memoryview(self.header))

    def get(self, out: np.ndarray, first_slot: int) -> None:
        page_bytes = out.shape[1]
        requests = [REQUEST_RAW.pack(2, first_slot + i, page_bytes) for i in range(out.shape[0])]
        sent = min(len(requests), GET_WINDOW)
        self.sock.sendall(b"".join(requests[:sent]))
        for i in range(out.shape[0]):
            if sent < len(requests) and sent - i <= GET_WINDOW // 2:
                more = min(len(requests), sent + GET_WINDOW // 2)
                self.sock.sendall(b"".join(requests[sent:more]))
                sent = more
            self._recv_into(memoryview(self.header))
            self._recv_into(memoryview(out[i]))

    def stop(self) -> None:
        self.sock.close()
        self.process.kill()
        self.process.wait()


# -- redis -----------------------------------------------------------------------------

class RedisPeer:
    def __init__(self):
        import redis

        if shutil.which("redis-server") is None:
            raise SystemExit("redis-server is not on PATH: apt install redis-server")
        probe = socket.create_server(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        self.tmp = tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-")
        self.process = subprocess.Popen(
            ["taskset", "-c", "1", "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.tmp.name, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL)
        self.client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.parser = type(self.client.connection_pool.get_connection()._parser).__name__

    def put(self, keys: list[bytes], pages: np.ndarray) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, page in zip(keys, pages):
            pipe.set(key, memoryview(page))
        pipe.execute()

    def get(self, keys: list[bytes], out: np.ndarray) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        for i, value in enumerate(pipe.execute()):
            out[i] = np.frombuffer(value, dtype=np.uint8)

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(10)
        self.tmp.cleanup()


# -- runs ------------------------------------------------------------------------------

def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _check(got: int, want: int) -> None:
    assert got == want, (got, want)


def measure(page_bytes: int, working_set: int, batch: int, repeats: int, congestion: str, with_redis: bool) -> dict:
    pages = working_set // page_bytes
    src = page_aligned(pages, page_bytes)
    src[:] = np.random.default_rng(page_bytes).integers(0, 255, (pages, page_bytes), dtype=np.uint8)
    dst = page_aligned(pages, page_bytes)
    dst[:] = 1
    batches = [(s, min(s + batch, pages)) for s in range(0, pages, batch)]
    settings = [f"dram.arena_bytes={working_set + (128 << 20)}", "server.log_level=WARNING"]
    if congestion:
        settings.append(f"tcp.congestion={congestion}")
    server = ServerProcess(*settings, cpus="1")
    raw = RawPeer(working_set, congestion)
    redis_peer = RedisPeer() if with_redis else None
    times: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "kv_put", "kv_get", "redis_put", "redis_get")}
    ns = Namespace(model="bench-tcp", page_bytes=page_bytes)
    try:
        with KVStoreClient(server.address, transport="tcp", tcp_congestion=congestion, timeout_s=30) as client:
            assert client.transport == "tcp"
            for run in range(repeats):
                keys = [f"r{run}-p{page_bytes}-{i}".encode() for i in range(pages)]
                movers = {
                    "raw": (lambda a, b: raw.put(src[a:b], a), lambda a, b: raw.get(dst[a:b], a)),
                    "kv": (lambda a, b: _check(client.put(ns, keys[a:b], src[a:b]), b - a),
                           lambda a, b: _check(client.get(ns, keys[a:b], dst[a:b]), b - a)),
                }
                if redis_peer is not None:
                    movers["redis"] = (lambda a, b: redis_peer.put(keys[a:b], src[a:b]),
                                       lambda a, b: redis_peer.get(keys[a:b], dst[a:b]))
                names = list(movers)
                for op, which in (("put", 0), ("get", 1)):
                    spent = dict.fromkeys(names, 0.0)
                    for number, (a, b) in enumerate(batches):
                        # Batch by batch, in a rotating order: every system sees the same load.
                        for name in names[number % len(names):] + names[:number % len(names)]:
                            started = time.perf_counter()
                            movers[name][which](a, b)
                            spent[name] += time.perf_counter() - started
                            if op == "get":
                                assert np.array_equal(src[a:b:7], dst[a:b:7]), name
                                dst[a:b] = 1
                    for name in names:
                        times[f"{name}_{op}"].append(spent[name])
                for a, _ in batches:
                    client.delete(ns, [keys[a]])
                if redis_peer is not None:
                    redis_peer.client.flushall()
                time.sleep(SETTLE_S)
    finally:
        server.stop()
        raw.stop()
        if redis_peer is not None:
            redis_peer.stop()
    result = {"page_bytes": page_bytes, "pages": pages, "batch_pages": batch,
              "congestion": congestion or "default"}
    for name, samples in times.items():
        if samples:
            result[name + "_gbps"] = src.nbytes / statistics.median(samples) / 1e9
    for op in ("put", "get"):
        # Ratios are taken round by round (the same minutes of the same machine), then the median.
        result[f"{op}_vs_raw"] = statistics.median(r / k for r, k in zip(times[f"raw_{op}"], times[f"kv_{op}"]))
        if times[f"redis_{op}"]:
            result[f"{op}_vs_redis"] = statistics.median(
                r / k for r, k in zip(times[f"redis_{op}"], times[f"kv_{op}"]))
    if redis_peer is not None:
        result["redis_parser"] = redis_peer.parser
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--working-set-mib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-sizes", default=f"{1 << 20},{4 << 20}")
    parser.add_argument("--congestion", default="default,cubic",
                        help="comma list: 'default' (the system's, for all three) and/or a name set per socket")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    system_cc = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    results = []
    for cc in args.congestion.split(","):
        congestion = "" if cc == "default" else cc
        for page_bytes in (int(p) for p in args.page_sizes.split(",")):
            results.append(measure(page_bytes, args.working_set_mib << 20, args.batch, args.repeats, congestion,
                                   with_redis=not congestion))
    print(f"TCP data plane on loopback, working set {args.working_set_mib} MiB, batches of {args.batch} pages, "
          f"client on CPU 0, servers on CPU 1 (taskset), median of {args.repeats}; default congestion = {system_cc}")
    print(f"{'cc':>8} {'page':>6} | {'raw put':>8} {'kv put':>7} {'redis':>6} {'/raw':>5} {'/redis':>6} | "
          f"{'raw get':>8} {'kv get':>7} {'redis':>6} {'/raw':>5} {'/redis':>6}   (GB/s)")
    for r in results:
        cells = []
        for op in ("put", "get"):
            cells.append(f"{r[f'raw_{op}_gbps']:>8.2f} {r[f'kv_{op}_gbps']:>7.2f} "
                         f"{r.get(f'redis_{op}_gbps', float('nan')):>6.2f} {r[f'{op}_vs_raw']:>5.2f} "
                         f"{r.get(f'{op}_vs_redis', float('nan')):>6.2f}")
        cc = r["congestion"] if r["congestion"] != "default" else system_cc
        print(f"{cc:>8} {r['page_bytes'] >> 20:>4}Mi | {cells[0]} | {cells[1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "tcp_throughput", "default_congestion": system_cc, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
