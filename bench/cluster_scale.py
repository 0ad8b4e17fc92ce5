"""A bigger cluster on one host: 8 nodes and 8 client processes over TCP, a node SIGKILLed, and a kill-restart loop.

    python bench/cluster_scale.py [--nodes 8] [--clients 8] [--seconds 8] [--loop-minutes 30]
                                  [--json bench/results/cluster_scale.json]

A real etcd and the nodes run on this host; every client is KVStoreClient("etcd://...", transport="tcp"), so no
page takes the shared-memory shortcut. Every page's bytes are derived from its key (BLAKE2b of the key, repeated),
and every page a get returns is compared with them byte for byte.

1. Throughput: the same clients against 1 node and against `--nodes`: aggregate put and get GB/s, and the ratio.
   On a host with few cores the nodes and clients share them: the ratio says what fan-out costs here, not what
   separate machines would give.
2. A node lost: after the puts, one node is SIGKILLed. Reported: the pages lost from leading runs (every chain
   cut at its first page whose only copy was there) against what placement predicts, and how long the clients
   took to stop placing pages on it (its lease TTL, then the watch).
3. The loop (`--loop-minutes`): clients put and get random chains while a random node is SIGKILLed every
   `--kill-every-s` and restarted `--down-s` later, empty. Every miss is explained or counted: a page whose
   copies were all on nodes killed since it was put (or just before: a node still in the writer's view got a copy
   that was never written), a page whose place moved to a node that came back (it reads there, empty, until
   written again), or neither ("unexplained", which should be 0); wrong bytes should be 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from pd_handoff import start_etcd  # noqa: E402  (a real etcd on loopback)

TTL_S = 2


def page_of(key: bytes, page_bytes: int) -> np.ndarray:
    seed = np.frombuffer(hashlib.blake2b(key, digest_size=64).digest(), dtype=np.uint8)
    return np.resize(seed, page_bytes)


class Cluster:
    def __init__(self, workdir: str, nodes: int, arena: str):
        self.workdir, self.arena = workdir, arena
        self.etcd, client = start_etcd(workdir)
        self.endpoint = client
        self.url = f"etcd://{client.removeprefix('http://')}/scale"
        self.nodes: dict[str, subprocess.Popen] = {}
        for i in range(nodes):
            self.start(f"node{i}")

    def start(self, node_id: str, deadline: float = 0.0) -> None:
        """Start a node; one started again after a SIGKILL waits until the dead one's lease frees its id."""
        deadline = deadline or time.monotonic() + 60
        ready = os.path.join(self.workdir, f"{node_id}-{time.monotonic_ns()}.json")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0", "--ready-file", ready,
             "--arena-bytes", self.arena, "--set", "shm.enabled=false", "--set", "nvme.enabled=false",
             "--set", "server.log_level=WARNING", "--set", "ops.metrics_address=127.0.0.1:0",
             "--set", f"cluster.endpoints={self.endpoint}", "--set", "cluster.name=scale",
             "--set", f"cluster.node_id={node_id}", "--set", "cluster.ramp_s=0",
             "--set", f"cluster.lease_ttl_s={TTL_S}", "--set", "cluster.etcd_timeout_s=1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not os.path.exists(ready):
            if proc.poll() is not None:   # its id is still held by the killed one's lease: try again
                if time.monotonic() > deadline:
                    raise SystemExit(f"{node_id} did not start")
                time.sleep(0.5)
                return self.start(node_id, deadline)
            time.sleep(0.05)
        self.nodes[node_id] = proc

    def kill(self, node_id: str) -> None:
        self.nodes.pop(node_id).send_signal(signal.SIGKILL)

    def close(self) -> None:
        for proc in self.nodes.values():
            proc.send_signal(signal.SIGKILL)
        self.etcd.send_signal(signal.SIGKILL)


def chains_of(index: int, count: int, pages: int) -> list[list[bytes]]:
    from kvstore_client.keys import encode_keys, prefix_hashes
    rng = random.Random(index)
    return [encode_keys(prefix_hashes([index, c] + [rng.randrange(32000) for _ in range(16 * pages - 2)], 16))
            for c in range(count)]


def wait_members(pool, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len([m for m in pool.members() if m.state == "serving"]) != count:
        if time.monotonic() > deadline:
            raise SystemExit(f"the cluster never had {count} serving members")
        time.sleep(0.05)


def throughput_client(url: str, index: int, args, nodes: int, go, out) -> None:
    from kvstore_client import KVStoreClient, Namespace
    ns = Namespace(model="scale", page_bytes=args.page_bytes, page_tokens=16)
    chains = chains_of(index, args.chains, args.pages)
    data = [np.stack([page_of(k, args.page_bytes) for k in keys]) for keys in chains]
    with KVStoreClient(url, transport="tcp", timeout_s=10) as pool:
        wait_members(pool, nodes)
        go.wait()
        started = time.perf_counter()
        put = sum(pool.put(ns, keys, pages) for keys, pages in zip(chains, data))
        put_s = time.perf_counter() - started
        out_buf, rng, got, wrong = np.empty_like(data[0]), random.Random(index), 0, 0
        started = time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            i = rng.randrange(len(chains))
            loaded = pool.get(ns, chains[i], out_buf)
            wrong += int(np.count_nonzero(out_buf[:loaded] != data[i][:loaded]))
            got += loaded
        out.put((put * args.page_bytes, put_s, got * args.page_bytes, time.perf_counter() - started, wrong))


def throughput(nodes: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstore-scale-") as workdir:
        cluster = Cluster(workdir, nodes, args.arena)
        try:
            ctx = mp.get_context("spawn")
            go, out = ctx.Event(), ctx.Queue()
            workers = [ctx.Process(target=throughput_client, args=(cluster.url, i, args, nodes, go, out))
                       for i in range(args.clients)]
            for w in workers:
                w.start()
            time.sleep(args.warmup_s)
            go.set()
            results = [out.get(timeout=900) for _ in workers]
            for w in workers:
                w.join()
        finally:
            cluster.close()
    return {"nodes": nodes, "put_gbps": sum(r[0] for r in results) / max(r[1] for r in results) / 1e9,
            "get_gbps": sum(r[2] for r in results) / max(r[3] for r in results) / 1e9,
            "wrong_bytes": sum(r[4] for r in results)}


def node_lost(args) -> dict:
    """Put every client's chains, SIGKILL one node, count what the leading runs lost against placement."""
    from kvstore_client import KVStoreClient, Namespace
    from kvstore_client.placement import place, placeable
    ns = Namespace(model="scale-kill", page_bytes=args.page_bytes, page_tokens=16)
    with tempfile.TemporaryDirectory(prefix="kvstore-scale-kill-") as workdir:
        cluster = Cluster(workdir, args.nodes, args.arena)
        try:
            with KVStoreClient(cluster.url, transport="tcp", timeout_s=10) as pool:
                wait_members(pool, args.nodes)
                chains = [keys for i in range(args.clients) for keys in chains_of(1000 + i, args.chains, args.pages)]
                for keys in chains:
                    stored = pool.put(ns, keys, np.stack([page_of(k, args.page_bytes) for k in keys]))
                    assert stored == len(keys), stored
                weights = placeable(pool.members(), time.time())
                victim = "node3"
                predicted = []
                for keys in chains:
                    owners = place(keys, weights, pool.replicas, pool.replicated_pages, chain_start=True)
                    predicted.append(next((i for i, o in enumerate(owners) if set(o) == {victim}), len(keys)))
                killed_at = time.monotonic()
                cluster.kill(victim)
                while victim in {m.node_id for m in pool.members()}:
                    time.sleep(0.01)
                left_view_s = time.monotonic() - killed_at
                out, kept, wrong = np.empty((args.pages, args.page_bytes), np.uint8), [], 0
                for keys in chains:
                    loaded = pool.get(ns, keys, out)
                    if loaded:
                        expected = np.stack([page_of(k, args.page_bytes) for k in keys[:loaded]])
                        wrong += int(np.count_nonzero(out[:loaded] != expected))
                    kept.append(loaded)
        finally:
            cluster.close()
    total = len(chains) * args.pages
    return {"victim": victim, "pages": total, "lost_fraction": 1 - sum(kept) / total,
            "predicted_lost_fraction": 1 - sum(predicted) / total, "chains_not_as_predicted":
            sum(k != p for k, p in zip(kept, predicted)), "left_view_s": left_view_s, "lease_ttl_s": TTL_S,
            "wrong_bytes": wrong}


def dram_evictions(url: str) -> int:
    """DRAM pages the nodes alive now evicted (a restarted node counts from its restart)."""
    from kvstore_client import KVStoreClient
    from kvstore_client.proto import pb
    with KVStoreClient(url, transport="tcp", timeout_s=10) as pool:
        return sum(t.evictions for t in pool.stats().tiers if t.tier == pb.DRAM)


def loop_client(url: str, index: int, args, stop, killed, out) -> None:
    """Put and get random chains until `stop`; every miss explained by the kills (`killed`: node -> kill times)."""
    from kvstore_client import KVStoreClient, Namespace
    from kvstore_client.placement import place, placeable
    ns = Namespace(model="scale-loop", page_bytes=args.page_bytes, page_tokens=16)
    rng = random.Random(index)
    chains = chains_of(index * 1000 + 7, args.loop_chains, args.pages)   # a fixed set: it fits, nothing is evicted
    stored: dict[int, tuple[list[tuple[str, ...]], float]] = {}   # chain -> its pages' nodes and time, at its put
    counts = {"puts": 0, "gets": 0, "pages_read": 0, "wrong_bytes": 0, "missed_killed": 0, "missed_moved": 0,
              "missed_unexplained": 0, "errors": 0, "node_calls_unanswered": {}}
    out_buf = np.empty((args.pages, args.page_bytes), np.uint8)
    logging.getLogger("kvstore_client.cluster").addHandler(_Unanswered(counts["node_calls_unanswered"]))
    logging.getLogger("kvstore_client.cluster").setLevel(logging.INFO)
    with KVStoreClient(url, transport="tcp", timeout_s=5) as pool:
        while not stop.is_set():
            i = rng.randrange(len(chains))
            keys = chains[i]
            try:
                if i not in stored or rng.random() < 0.2:
                    owners = place(keys, placeable(pool.members(), time.time()), pool.replicas,
                                   pool.replicated_pages, chain_start=True)
                    put_at = time.time()
                    if pool.put(ns, keys, np.stack([page_of(k, args.page_bytes) for k in keys])) == len(keys):
                        stored[i] = (owners, put_at)   # each page is now on each of its nodes
                    counts["puts"] += 1
                    continue
                owners, put_at = stored[i]
                loaded = pool.get(ns, keys, out_buf)
                counts["gets"] += 1
                counts["pages_read"] += loaded
                expected = np.stack([page_of(k, args.page_bytes) for k in keys[:loaded]]) if loaded else None
                if loaded:
                    counts["wrong_bytes"] += int(np.count_nonzero(out_buf[:loaded] != expected))
                if loaded < len(keys):
                    # Killed since the put, or so shortly before it that the writer still placed a copy there
                    # (the node was in its view; that copy was never written, and the others may be gone since).
                    since = put_at - args.down_s - 2 * TTL_S
                    gone = {node for node, times in killed.items() if any(t > since for t in times)}
                    now_owners = place(keys[loaded:loaded + 1], placeable(pool.members(), time.time()), 1, 0,
                                       chain_start=False)[0]
                    if set(owners[loaded]) <= gone:
                        counts["missed_killed"] += 1
                    elif now_owners and now_owners[0] not in owners[loaded]:
                        counts["missed_moved"] += 1
                    else:
                        counts["missed_unexplained"] += 1
            except Exception:   # a call on a node that just died: counted, the loop goes on
                counts["errors"] += 1
    out.put(counts)


class _Unanswered(logging.Handler):
    """Counts the node calls a cluster call read as misses, by why (the node lost, or the deadline passed)."""

    def __init__(self, counts: dict):
        super().__init__()
        self.counts = counts

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("a node did not answer"):
            kind = str(record.args[0])
            self.counts[kind] = self.counts.get(kind, 0) + 1


def kill_loop(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstore-scale-loop-") as workdir:
        cluster = Cluster(workdir, args.nodes, args.arena)
        ctx = mp.get_context("spawn")
        manager = ctx.Manager()
        killed = manager.dict()
        stop, out = ctx.Event(), ctx.Queue()
        workers = [ctx.Process(target=loop_client, args=(cluster.url, i, args, stop, killed, out))
                   for i in range(args.clients)]
        rng, kills = random.Random(7), 0
        try:
            for w in workers:
                w.start()
            ends = time.monotonic() + args.loop_minutes * 60
            while time.monotonic() < ends:
                time.sleep(args.kill_every_s)
                victim = rng.choice(sorted(cluster.nodes))
                killed[victim] = [*killed.get(victim, []), time.time()]
                cluster.kill(victim)
                kills += 1
                time.sleep(args.down_s)
                cluster.start(victim)
            stop.set()
            results = [out.get(timeout=120) for _ in workers]
            for w in workers:
                w.join(30)
            evictions = dram_evictions(cluster.url)
        finally:
            cluster.close()
            manager.shutdown()
    total = {key: sum(r[key] for r in results) for key in results[0] if key != "node_calls_unanswered"}
    unanswered: dict = {}
    for r in results:
        for kind, n in r["node_calls_unanswered"].items():
            unanswered[kind] = unanswered.get(kind, 0) + n
    return {"minutes": args.loop_minutes, "kills": kills, **total, "node_calls_unanswered": unanswered,
            "evictions": evictions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--pages", type=int, default=48)
    parser.add_argument("--page-bytes", type=int, default=64 << 10)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--arena", default="512MiB")
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--loop-minutes", type=float, default=30.0)
    parser.add_argument("--loop-chains", type=int, default=40, help="chains each client keeps putting and getting")
    parser.add_argument("--kill-every-s", type=float, default=20.0)
    parser.add_argument("--down-s", type=float, default=5.0)
    parser.add_argument("--json", default="bench/results/cluster_scale.json")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs shared by etcd, {args.nodes} nodes and {args.clients} client processes (not "
          f"pinned); TCP only; pages of {args.page_bytes >> 10} KiB, chains of {args.pages}")
    report: dict = {"args": vars(args), "cpus": os.cpu_count()}
    rows = [throughput(n, args) for n in (1, args.nodes)]
    for r in rows:
        print(f"{r['nodes']} node(s): put {r['put_gbps']:6.2f} GB/s  get {r['get_gbps']:6.2f} GB/s  "
              f"wrong bytes {r['wrong_bytes']}")
    report["throughput"] = rows
    report["ratio"] = {way: rows[1][f"{way}_gbps"] / rows[0][f"{way}_gbps"] for way in ("put", "get")}
    print(f"{args.nodes} nodes / 1 node: put {report['ratio']['put']:.2f}  get {report['ratio']['get']:.2f}")
    lost = report["node_lost"] = node_lost(args)
    print(f"{lost['victim']} SIGKILLed: {100 * lost['lost_fraction']:.1f}% of leading pages lost (placement predicts "
          f"{100 * lost['predicted_lost_fraction']:.1f}%, {lost['chains_not_as_predicted']} chains otherwise); "
          f"out of the clients' view after {lost['left_view_s']:.2f} s (lease TTL {TTL_S} s); "
          f"wrong bytes {lost['wrong_bytes']}")
    if args.loop_minutes > 0:
        loop = report["kill_loop"] = kill_loop(args)
        print(f"kill-restart loop, {loop['minutes']:g} min, {loop['kills']} kills: {loop['gets']} gets "
              f"({loop['pages_read']} pages), {loop['puts']} puts, wrong bytes {loop['wrong_bytes']}; misses: "
              f"{loop['missed_killed']} on killed nodes, {loop['missed_moved']} moved to a node that came back, "
              f"{loop['missed_unexplained']} unexplained; {loop['errors']} calls failed; node calls read as misses: "
              f"{loop['node_calls_unanswered']}; DRAM evictions {loop['evictions']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
