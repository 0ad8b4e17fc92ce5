"""Shared-memory put/get GB/s for an authenticated local tenant and for the unauthenticated default, on two
source trees side by side (before/after a change), and the cost of moving a slab between tenants.

    python bench/tenant_shm.py --tree before=/path/to/old/checkout --tree after=. [--json out.json]
           [--working-set-mib 256] [--page-mib 1] [--batch 32] [--rounds 3]

Each round runs, for every tree and both identities, a worker process with that tree first on
PYTHONPATH; the worker starts that tree's kvstore-server (CPU 1, taskset), and its client (CPU 0)
puts a working set of distinct pages in batches, gets them back, and times a plain memcpy of the
same pages in the same process. Rounds alternate trees and identities, so drift on a shared
machine hits all alike; the table gives medians, each GB/s as a ratio of that worker's memcpy,
and as a ratio of the first tree's default identity in the same round.
- "default": no auth.*: the one trusted tenant "", a whole-arena memfd.
- "tenant": auth.tokens_file and auth.local_uids mapping this uid to tenant alice. A tree that
  refuses a tenant the arena's fd moves her pages over TCP; the transport used is reported.
The working set is put and deleted once before timing, so the slabs it needs are already the
tenant's: the timed figures are steady state, and a slab's first move is measured on its own.
Slab moves: an Arena of the "after" tree (in the worker) moves a slab between two tenants and
back, timing punch + allocate + map (MAP_POPULATE) per move.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(identity: str, working_set: int, page_bytes: int, batch: int) -> dict:
    sys.path.insert(0, HERE)
    sys.path.insert(1, os.path.join(os.path.dirname(HERE), "tests"))
    import numpy as np
    from _server import ServerProcess
    from identities import Tokens
    from kvstore_client import KVStoreClient, Namespace

    os.sched_setaffinity(0, {0})
    arena = f"dram.arena_bytes={working_set + (64 << 20)}"
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Tokens(__import__("pathlib").Path(tmp))
        settings = [arena, "dram.slab_bytes=16MiB"]
        token = None
        if identity == "tenant":
            settings += [f"auth.tokens_file={tokens.path}", f"auth.local_uids={os.getuid()}:alice"]
            token = tokens.alice
        server = ServerProcess(*settings, cpus="1")
        try:
            pages = working_set // page_bytes
            raw = np.empty(2 * pages * page_bytes + 8192, dtype=np.uint8)
            start = -raw.ctypes.data % 4096
            src = raw[start:start + pages * page_bytes].reshape(pages, page_bytes)
            dst = raw[start + pages * page_bytes:start + 2 * pages * page_bytes].reshape(pages, page_bytes)
            src[:] = np.random.default_rng(1).integers(0, 255, src.shape, dtype=np.uint8)
            dst[:] = 1
            began = time.perf_counter()
            for i in range(pages):
                ctypes.memmove(dst[i].ctypes.data, src[i].ctypes.data, page_bytes)
            memcpy = src.nbytes / (time.perf_counter() - began) / 1e9
            ns = Namespace(model="bench", page_bytes=page_bytes)
            keys = [f"p{i}".encode() for i in range(pages)]
            with KVStoreClient(server.address, token=token, timeout_s=60) as client:
                # Warm: the namespace open and every slab the working set needs given to this tenant (a
                # slab moves to a tenant once; the slab-move figure below is that first-fill cost).
                for at in range(0, pages, batch):
                    client.put(ns, keys[at:at + batch], src[at:at + batch])
                for at in range(0, pages, batch):   # each batch is one chain: its first key takes it all
                    client.delete(ns, keys[at:at + 1])
                began = time.perf_counter()
                for at in range(0, pages, batch):
                    assert client.put(ns, keys[at:at + batch], src[at:at + batch]) == len(keys[at:at + batch])
                put = src.nbytes / (time.perf_counter() - began) / 1e9
                began = time.perf_counter()
                for at in range(0, pages, batch):
                    assert client.get(ns, keys[at:at + batch], dst[at:at + batch]) == len(keys[at:at + batch])
                get = src.nbytes / (time.perf_counter() - began) / 1e9
                assert np.array_equal(src, dst)
                transport = client.transport
        finally:
            server.stop()
    return {"transport": transport, "memcpy_gbps": memcpy, "put_gbps": put, "get_gbps": get}


def slab_moves(slab_bytes: int, moves: int) -> dict:
    """Arena.place between two tenants, timed whole, next to its parts done by hand on a spare slab:
    the punch, posix_fallocate, and the MAP_FIXED|MAP_POPULATE mapping."""
    from kvstore.tiers import dram
    arena = dram.Arena(4 * slab_bytes, slab_bytes, tenants_apart=True)
    try:
        times, punch, allocate, populate = [], [], [], []
        base, owner = slab_bytes, ""   # slab 1, moved by hand between the same two tenants
        for i in range(moves):
            began = time.perf_counter()
            assert arena.place(0, "a" if i % 2 == 0 else "b")
            times.append(time.perf_counter() - began)
            new = "b" if owner == "a" else "a"
            began = time.perf_counter()
            dram._punch(arena.fd_of(owner), base, slab_bytes)
            punch.append(time.perf_counter() - began)
            began = time.perf_counter()
            os.posix_fallocate(arena.fd_of(new), base, slab_bytes)
            allocate.append(time.perf_counter() - began)
            began = time.perf_counter()
            dram._map_fixed(arena.address + base, slab_bytes, arena.fd_of(new), base, True)
            populate.append(time.perf_counter() - began)
            owner = new
    finally:
        arena.close()
    ms = lambda values: statistics.median(values) * 1e3   # noqa: E731
    return {"slab_bytes": slab_bytes, "moves": moves, "move_ms_median": ms(times),
            "move_gbps": slab_bytes / statistics.median(times) / 1e9,
            "punch_ms": ms(punch), "fallocate_ms": ms(allocate), "map_populate_ms": ms(populate)}


def run_worker(tree: str, *args: str) -> dict:
    tree = os.path.abspath(tree)
    inherited = os.environ.get("PYTHONPATH", "")   # e.g. a kvstore_native build both trees share
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree}/clients/python" + (f":{inherited}" if inherited else "")}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"worker {args} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="name=path of a source tree")
    parser.add_argument("--working-set-mib", type=int, default=256)
    parser.add_argument("--page-mib", type=float, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slab-mib", type=int, default=64)
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--slab-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    working_set, page_bytes = args.working_set_mib << 20, int(args.page_mib * (1 << 20))
    if args.worker:
        print(json.dumps(worker(args.worker, working_set, page_bytes, args.batch)))
        return
    if args.slab_worker:
        print(json.dumps(slab_moves(args.slab_mib << 20, 16)))
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    runs: dict[tuple[str, str], list[dict]] = {}
    common = ["--working-set-mib", str(args.working_set_mib), "--page-mib", str(args.page_mib),
              "--batch", str(args.batch)]
    for _ in range(args.rounds):
        for identity in ("default", "tenant"):
            for name, path in trees.items():
                runs.setdefault((name, identity), []).append(run_worker(path, "--tree", "x", *common,
                                                                        "--worker", identity))
    rows = []
    first = next(iter(runs))   # the first tree's default: each round's figures are also given as ratios of its
    for (name, identity), results in runs.items():
        row = {"tree": name, "identity": identity, "transport": results[0]["transport"]}
        for what in ("memcpy_gbps", "put_gbps", "get_gbps"):
            row[what] = statistics.median(r[what] for r in results)
        row["put_ratio"] = statistics.median(r["put_gbps"] / r["memcpy_gbps"] for r in results)
        row["get_ratio"] = statistics.median(r["get_gbps"] / r["memcpy_gbps"] for r in results)
        for what in ("put", "get"):   # ratio to the first tree's default in the same round (drift cancels)
            row[f"{what}_vs_first"] = statistics.median(
                r[f"{what}_gbps"] / b[f"{what}_gbps"] for r, b in zip(results, runs[first]))
        rows.append(row)
    moves = run_worker(trees.get("after", next(iter(trees.values()))), "--tree", "x", "--slab-mib",
                       str(args.slab_mib), "--slab-worker")
    print(f"working set {args.working_set_mib} MiB of {args.page_mib:g} MiB pages, batches of {args.batch}, "
          f"client CPU 0, server CPU 1, median of {args.rounds} rounds")
    print(f"ratios: /mc to the worker's own memcpy; /{first[0]} to {first[0]} {first[1]} of the same round")
    print(f"{'tree':>8} {'identity':>8} {'plane':>5} {'memcpy':>7} {'put GB/s':>9} {'put/mc':>7} {'put/' + first[0]:>11} "
          f"{'get GB/s':>9} {'get/mc':>7} {'get/' + first[0]:>11}")
    for r in rows:
        print(f"{r['tree']:>8} {r['identity']:>8} {r['transport']:>5} {r['memcpy_gbps']:>7.2f} {r['put_gbps']:>9.2f} "
              f"{r['put_ratio']:>7.2f} {r['put_vs_first']:>11.2f} {r['get_gbps']:>9.2f} {r['get_ratio']:>7.2f} "
              f"{r['get_vs_first']:>11.2f}")
    print(f"slab move ({moves['slab_bytes'] >> 20} MiB: punch + allocate + map): "
          f"{moves['move_ms_median']:.1f} ms median ({moves['move_gbps']:.2f} GB/s); by hand: punch "
          f"{moves['punch_ms']:.1f} ms, posix_fallocate {moves['fallocate_ms']:.1f} ms, "
          f"mmap MAP_POPULATE {moves['map_populate_ms']:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "tenant_shm", "rows": rows, "slab_move": moves}, f, indent=2)


if __name__ == "__main__":
    main()
