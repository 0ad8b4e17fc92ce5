"""A long soak of one node: clients of two tenants put and get chains of mixed page sizes, with
write-back to NVMe, while the node is restarted every few minutes (SIGTERM and SIGKILL in turn).

    python bench/soak.py --minutes 120 --restart-minutes 10 --clients 8

Every page's bytes derive from its key, so a get is checked byte for byte against what any
client could have stored under that key: `wrong_bytes` must stay 0. Misses are allowed (eviction,
DRAM-only pages lost to a SIGKILL). At the end every namespace is cleared and the node's DRAM
must hold 0 bytes. The node's RSS, fds and threads are sampled at the end of each restart cycle
(the same point of each node's life), the clients' (long-lived processes) every sample; the
summary gives their spread over the second half of the run. Writes bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstore_client import KVStoreClient, Namespace, errors, prefix_hashes

PAGE_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10)
PAGE_TOKENS = 16
COUNTERS = ("puts", "pages_put", "gets", "pages_got", "pages_missed", "wrong_bytes", "puts_refused_full",
            "node_errors", "other_errors")


def page_of(key: str, page_bytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.frombuffer(np.random.default_rng(seed).bytes(page_bytes), dtype=np.uint8)


def chain_tokens(tenant: str, chain: int, pages: int) -> list[int]:
    rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(f"{tenant}/{chain}".encode(), digest_size=8)
                                               .digest(), "little"))
    return rng.integers(0, 128_000, pages * PAGE_TOKENS).tolist()


def namespace_of(page_bytes: int) -> Namespace:
    return Namespace(model=f"soak-{page_bytes}", page_bytes=page_bytes, page_tokens=PAGE_TOKENS)


def client_main(index: int, address: str, token: str, tenant: str, transport: str, counters, stop,
                ops_per_s: float) -> None:
    """One engine: puts chains (a shared pool of chain ids, so clients of a tenant overlap) and
    reads random ones back, checking every loaded page against the bytes its key derives."""
    rng = random.Random(index)
    client = KVStoreClient(address, token=token, transport=transport, timeout_s=10)
    base = index * len(COUNTERS)

    def count(name: str, n: int = 1) -> None:
        counters[base + COUNTERS.index(name)] += n

    recent: list[tuple[int, int, int]] = []   # (page bytes, chain, pages) this client stored lately
    while not stop.is_set():
        started = time.monotonic()
        putting = rng.random() < 0.5 or not recent
        if putting or rng.random() < 0.3:   # a chain of any client of this tenant, or a new one
            page_bytes = rng.choice(PAGE_SIZES)
            chain, pages = rng.randrange(2000), rng.randint(1, max(2, (4 << 20) // page_bytes))
        else:                               # one this client stored: a hit unless evicted or lost
            page_bytes, chain, pages = rng.choice(recent)
        ns = namespace_of(page_bytes)
        keys = prefix_hashes(chain_tokens(tenant, chain, pages), PAGE_TOKENS)
        data = np.stack([page_of(key, page_bytes) for key in keys])
        try:
            if putting:
                count("pages_put", int(client.put(ns, keys, data)))
                count("puts")
                recent = [*recent[-63:], (page_bytes, chain, pages)]
            else:
                out = np.zeros_like(data)
                loaded = client.get(ns, keys, out)
                count("gets")
                count("pages_got", loaded)
                count("pages_missed", len(keys) - loaded)
                count("wrong_bytes", int(np.count_nonzero(out[:loaded] != data[:loaded])))
        except errors.CapacityExhausted:
            count("puts_refused_full")  # DRAM full of pages write-back has not written down yet: back-pressure
        except errors.KVStoreError:
            count("node_errors")       # the node restarting: Unavailable, or a lease it forgot
            time.sleep(0.2)
        except Exception:              # anything else is a finding: counted and shown in the summary
            count("other_errors")
            time.sleep(0.2)
        time.sleep(max(0.0, 1 / ops_per_s - (time.monotonic() - started)))
    client.close()


def process_facts(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_mib": round(rss_kb / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


class Node:
    def __init__(self, workdir: Path, port: int, tokens_file: Path, cpus: str):
        self.workdir, self.port = workdir, port
        self.args = [sys.executable, "-m", "kvstore.server", "--grpc-address", f"127.0.0.1:{port}",
                     "--shm-socket", str(workdir / "kvstore.sock"), "--ready-file", str(workdir / "ready.json")]
        settings = {"dram.arena_bytes": "256MiB", "dram.slab_bytes": "4MiB", "server.log_level": "WARNING",
                    "nvme.paths": f"{workdir / 'nvme-0'},{workdir / 'nvme-1'}", "nvme.map_bytes": "512MiB",
                    "controller.write_policy": "write_back", "controller.high_watermark": "0.7",
                    "auth.tokens_file": str(tokens_file), "ops.metrics_address": "127.0.0.1:0"}
        for key, value in settings.items():
            self.args += ["--set", f"{key}={value}"]
        if cpus:
            self.args = ["taskset", "-c", cpus, *self.args]
        self.log = open(workdir / "node.log", "ab")
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        (self.workdir / "ready.json").unlink(missing_ok=True)
        self.process = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not (self.workdir / "ready.json").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the node did not start: see {self.workdir / 'node.log'}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        # taskset execs the server, so the child's pid is the server's.
        return self.process.pid

    def stop(self, kill: bool) -> int:
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        return self.process.wait(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spread(values: list[float]) -> float:
    return round((max(values) - min(values)) / max(min(values), 1e-9), 4) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=120)
    parser.add_argument("--restart-minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--ops-per-s", type=float, default=4.0, help="calls per second per client")
    parser.add_argument("--node-cpus", default="", help="taskset the node (e.g. 1)")
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--json", default="bench/results/soak.json")
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="kvstore-soak-")
    workdir = Path(tmp.name)
    tokens = {tenant: hashlib.sha256(f"{tenant}-{os.getpid()}".encode()).hexdigest() for tenant in ("alice", "bob")}
    tokens_file = workdir / "tokens"
    tokens_file.write_text("".join(f"{hashlib.sha256(t.encode()).hexdigest()} {tenant} tenant\n"
                                   for tenant, t in tokens.items()))
    node = Node(workdir, free_port(), tokens_file, args.node_cpus)
    node.start()
    try:
        run(args, node, tokens)
    finally:
        if node.process.poll() is None:
            node.stop(kill=True)
        tmp.cleanup()


def run(args: argparse.Namespace, node: Node, tokens: dict[str, str]) -> None:
    address = f"127.0.0.1:{node.port}"

    counters = mp.Array("q", args.clients * len(COUNTERS), lock=False)
    stop = mp.Event()
    clients = []
    for i in range(args.clients):
        tenant = ("alice", "bob")[i % 2]
        transport = ("auto", "tcp")[(i // 2) % 2]      # shared memory and TCP data planes, both tenants
        clients.append(mp.Process(target=client_main, daemon=True,
                                  args=(i, address, tokens[tenant], tenant, transport, counters, stop, args.ops_per_s)))
    for c in clients:
        c.start()

    def totals() -> dict:
        return {name: sum(counters[i * len(COUNTERS) + k] for i in range(args.clients))
                for k, name in enumerate(COUNTERS)}

    started = time.monotonic()
    end = started + args.minutes * 60
    next_restart = started + args.restart_minutes * 60
    samples, cycles, restarts = [], [], 0
    while time.monotonic() < end:
        time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
        now = time.monotonic()
        alive = [c for c in clients if c.is_alive()]
        if len(alive) < len(clients):
            raise SystemExit(f"{len(clients) - len(alive)} client(s) died: see their traceback above")
        clients_facts = [process_facts(c.pid) for c in alive]
        samples.append({"minute": round((now - started) / 60, 2), "node": process_facts(node.pid),
                        "clients_rss_mib": round(sum(f["rss_mib"] for f in clients_facts), 1),
                        "clients_fds": sum(f["fds"] for f in clients_facts),
                        "clients_threads": sum(f["threads"] for f in clients_facts), **totals()})
        print(json.dumps(samples[-1]), flush=True)
        if now >= next_restart and now < end - 30:
            cycles.append({"minute": samples[-1]["minute"], **process_facts(node.pid)})
            kill = restarts % 2 == 1
            code = node.stop(kill)
            restarts += 1
            node.start()
            print(f"# restart {restarts}: {'SIGKILL' if kill else 'SIGTERM'} (exit {code}), serving again",
                  flush=True)
            next_restart = now + args.restart_minutes * 60
    cycles.append({"minute": round((time.monotonic() - started) / 60, 2), **process_facts(node.pid)})
    stop.set()
    for c in clients:
        c.join(30)

    cleared, dram_after = {}, {}
    for tenant, token in tokens.items():
        with KVStoreClient(address, token=token) as client:
            cleared[tenant] = sum(client.clear(namespace_of(size), timeout_s=600) for size in PAGE_SIZES)
            deadline = time.monotonic() + 60
            while True:
                mine = {t.tenant: t for t in client.stats().tenants}.get(tenant)
                dram_after[tenant] = mine.dram_bytes if mine else 0
                if not dram_after[tenant] or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    node.stop(kill=False)

    half = args.minutes / 2
    late_cycles = [c for c in cycles if c["minute"] >= half]
    late = [s for s in samples if s["minute"] >= half]
    summary = {
        "minutes": args.minutes, "restart_minutes": args.restart_minutes, "clients": args.clients,
        "restarts": restarts, **totals(), "pages_cleared": cleared, "dram_bytes_after_clear": dram_after,
        "node_rss_spread_second_half": spread([c["rss_mib"] for c in late_cycles]),
        "node_fds_second_half": sorted({c["fds"] for c in late_cycles}),
        "node_threads_second_half": sorted({c["threads"] for c in late_cycles}),
        "clients_rss_spread_second_half": spread([s["clients_rss_mib"] for s in late]),
        "clients_fds_second_half": sorted({s["clients_fds"] for s in late}),
        "clients_threads_second_half": sorted({s["clients_threads"] for s in late}),
    }
    print(json.dumps(summary, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"summary": summary, "cycles": cycles, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
