"""TCP put and get GB/s through kvstore, next to a raw Python socket, Redis and Mooncake, in the same run.

    python bench/tcp_throughput.py [--json out.json] [--working-set-mib 256] [--batch 64] [--placements split,shared]

For each page size (1 MiB, 4 MiB) a working set of distinct pages is put in batches of
`--batch` pages and got back, three ways, interleaved batch by batch in a rotating order so
they share the machine's noise (ratios are taken per round, then the median):
  - kvstore: KVStoreClient(transport="tcp") against a real kvstore-server (gRPC control,
    the uvloop data plane moving bytes into and out of arena slots);
  - raw: a plain Python socket peer (bench/_raw_peer.py) doing the same exchange (a
    small request, the page received into or sent from one buffer), the same pipelining;
  - redis: redis-server from apt, redis-py with hiredis, one pipeline per batch (SET, then
    GET copied into the same destination buffer);
  - mooncake: Mooncake's Transfer Engine over its TCP transport (bench/_mooncake_te_peer.py),
    one batch_transfer_sync_write/read per batch. It needs a private network namespace, so
    when it is installed (pip install mooncake-transfer-engine-non-cuda; apt install
    libibverbs1 librdmacm1 libnuma1) and we are root, the whole run moves into one first
    (like `unshare -n`, plus a veth pair): every system then shares that namespace's loopback.
Placements (taskset): "split" puts the client on CPU 0 and every server on CPU 1; "shared"
puts client and servers all on CPU 0. Loopback; every socket of a row uses the same
congestion control: "default" is the system's (bbr here) for all; "cubic" sets TCP_CONGESTION
on both ends of kvstore and raw sockets (Redis and Mooncake cannot be told per socket, so they
have no cubic row). A peer that cannot run here is left out with the reason printed.
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

import _mooncake_peer
import _mooncake_te_peer
from _server import ServerProcess
from kvstore_client import KVStoreClient, Namespace, page_buffer
from kvstore_client.tcp_transport import sendmsg_all

HERE = os.path.dirname(os.path.abspath(__file__))
REQUEST_RAW = __import__("struct").Struct("<BII")
RESPONSE_BYTES = 8
GET_WINDOW = 256
SETTLE_S = 0.3      # pause between systems: lets the previous one's frees and acks finish
PLACEMENTS = {"split": (0, "1"), "shared": (0, "0")}   # (client CPU, servers' CPUs)


# -- raw socket ------------------------------------------------------------------------

class RawPeer:
    def __init__(self, nbytes: int, congestion: str, cpus: str):
        self.process = subprocess.Popen(["taskset", "-c", cpus, sys.executable, os.path.join(HERE, "_raw_peer.py"),
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

def redis_unavailable_reason() -> str:
    """Why the Redis peer cannot run here ("" when it can)."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH (apt install redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        return f"redis-py is not installed ({exc})"
    return ""


class RedisPeer:
    def __init__(self, cpus: str):
        import redis

        probe = socket.create_server(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        self.tmp = tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-")
        self.process = subprocess.Popen(
            ["taskset", "-c", cpus, "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
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


def measure(page_bytes: int, working_set: int, batch: int, repeats: int, congestion: str, placement: str,
            with_redis: bool, with_mooncake: bool) -> dict:
    client_cpu, server_cpus = PLACEMENTS[placement]
    os.sched_setaffinity(0, {client_cpu})
    pages = working_set // page_bytes
    src = page_buffer(pages, page_bytes)
    src[:] = np.random.default_rng(page_bytes).integers(0, 255, (pages, page_bytes), dtype=np.uint8)
    dst = page_buffer(pages, page_bytes)
    dst[:] = 1
    batches = [(s, min(s + batch, pages)) for s in range(0, pages, batch)]
    settings = [f"dram.arena_bytes={working_set + (128 << 20)}", "server.log_level=WARNING"]
    if congestion:
        settings.append(f"tcp.congestion={congestion}")
    server = ServerProcess(*settings, cpus=server_cpus)
    raw = RawPeer(working_set, congestion, server_cpus)
    redis_peer = RedisPeer(server_cpus) if with_redis else None
    mooncake = _mooncake_te_peer.TransferEnginePeer(working_set, server_cpus) if with_mooncake else None
    if mooncake is not None:
        mooncake.register(src, dst)
    times: dict[str, list[float]] = {f"{name}_{op}": [] for name in ("raw", "kv", "redis", "mooncake")
                                     for op in ("put", "get")}
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
                if mooncake is not None:
                    movers["mooncake"] = (lambda a, b: mooncake.put(src[a:b], a), lambda a, b: mooncake.get(dst[a:b], a))
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
        if mooncake is not None:
            mooncake.stop()
    result = {"page_bytes": page_bytes, "pages": pages, "batch_pages": batch,
              "congestion": congestion or "default", "placement": placement}
    for name, samples in times.items():
        if samples:
            result[name + "_gbps"] = src.nbytes / statistics.median(samples) / 1e9
    for op in ("put", "get"):
        # Ratios are taken round by round (the same minutes of the same machine), then the median.
        result[f"{op}_vs_raw"] = statistics.median(r / k for r, k in zip(times[f"raw_{op}"], times[f"kv_{op}"]))
        for peer in ("redis", "mooncake"):
            if times[f"{peer}_{op}"]:
                result[f"{op}_vs_{peer}"] = statistics.median(
                    r / k for r, k in zip(times[f"{peer}_{op}"], times[f"kv_{op}"]))
    if redis_peer is not None:
        result["redis_parser"] = redis_peer.parser
    return result


def print_rows(results: list[dict], system_cc: str) -> None:
    """measure()'s results as a table: a row per placement, congestion control and page size."""
    print(f"{'place':>6} {'cc':>6} {'page':>5} | {'raw':>5} {'kv':>5} {'redis':>5} {'mc':>5} {'/raw':>5} {'/mc':>5} | "
          f"{'raw':>5} {'kv':>5} {'redis':>5} {'mc':>5} {'/raw':>5} {'/mc':>5}   (put | get, GB/s; /x = kv over x)")
    nan = float("nan")
    for r in results:
        cells = []
        for op in ("put", "get"):
            cells.append(f"{r[f'raw_{op}_gbps']:>5.2f} {r[f'kv_{op}_gbps']:>5.2f} {r.get(f'redis_{op}_gbps', nan):>5.2f} "
                         f"{r.get(f'mooncake_{op}_gbps', nan):>5.2f} {r[f'{op}_vs_raw']:>5.2f} "
                         f"{r.get(f'{op}_vs_mooncake', nan):>5.2f}")
        cc = r["congestion"] if r["congestion"] != "default" else system_cc
        print(f"{r['placement']:>6} {cc:>6} {r['page_bytes'] >> 20:>3}Mi | {cells[0]} | {cells[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--working-set-mib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--page-sizes", default=f"{1 << 20},{4 << 20}")
    parser.add_argument("--congestion", default="default,cubic",
                        help="comma list: 'default' (the system's, for all) and/or a name set per socket")
    parser.add_argument("--placements", default="split,shared", help=f"comma list of {sorted(PLACEMENTS)}")
    parser.add_argument("--peers", default="redis,mooncake", help="comma list of the optional peers to run")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    peers = set(filter(None, args.peers.split(",")))
    absent = {}
    if "redis" in peers and (reason := redis_unavailable_reason()):
        absent["redis"] = reason
    if "mooncake" in peers and (reason := _mooncake_te_peer.unavailable_reason()):
        absent["mooncake"] = reason
    with_redis, with_mooncake = "redis" in peers - absent.keys(), "mooncake" in peers - absent.keys()
    if with_mooncake:
        _mooncake_peer.private_network()   # before any server starts: they all share this namespace
    system_cc = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    results = []
    for placement in args.placements.split(","):
        for cc in args.congestion.split(","):
            congestion = "" if cc == "default" else cc
            for page_bytes in (int(p) for p in args.page_sizes.split(",")):
                results.append(measure(page_bytes, args.working_set_mib << 20, args.batch, args.repeats, congestion,
                                       placement, with_redis=with_redis and not congestion,
                                       with_mooncake=with_mooncake and not congestion))
    print(f"TCP data plane on loopback{' (private network namespace)' if with_mooncake else ''}, working set "
          f"{args.working_set_mib} MiB, batches of {args.batch} pages, median of {args.repeats}; "
          f"default congestion = {system_cc}; placements: split = client on CPU 0, servers on CPU 1; "
          "shared = all on CPU 0 (taskset)")
    for peer, reason in absent.items():
        print(f"no {peer} column: {reason}")
    print_rows(results, system_cc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "tcp_throughput", "default_congestion": system_cc, "absent": absent,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
