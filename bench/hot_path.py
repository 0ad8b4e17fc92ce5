"""The hot paths side by side in one process and one run: memmove, kvstore put/get, Mooncake Store's
shared-memory zero-copy path, long-prompt lookups and prefix hashing.

    python bench/hot_path.py [--working-set-mib 1024] [--json bench/results/hot_path.json]
    make bench-hot-path      (installs the Mooncake peer first: pip mooncake-transfer-engine-non-cuda,
                              apt libibverbs1 librdmacm1 libnuma1)

Placement: this process (the client, and Mooncake's dummy client) runs on --client-cpu (0); the
kvstore node, and Mooncake's master and real client, on --server-cpu (1) (sched_setaffinity /
taskset). Mooncake copies pages in its real client, from and into a pool its dummy client registered;
kvstore's goal rows put from and get into shared page buffers (kvstore_client.shared_page_buffer), whose
pages the client and the node copy at once, and its "any buffer" columns do the same from and into
page_buffer()s, which the client copies alone: on a host where one core is busier than the other, run both
placements. Each page size moves a working set of distinct pages (default 1 GiB, larger than every cache)
from one buffer into the store, then back into another; memmove copies the same pages between two
page-aligned buffers. Each kvstore call is its own chain of `batch` pages (4 KiB: 1024, 64 KiB and 1 MiB: 128,
4 MiB: 32); Mooncake gets the same batches. Medians of --repeats, each repeat memmove, kvstore and
Mooncake one after another, so each ratio's figures are taken within seconds of each other. The
whole run happens in a private network namespace when Mooncake runs (its servers bind every
interface); without mooncake-transfer-engine-non-cuda it says why and runs the rest.

Lookups: one SDK call for 1k, 8k and 32k present pages (4 KiB, 16 tokens each: a 32k-page chain
is a 512k-token prompt), by keys and by tokens (hashed in the SDK), median and min of
--lookup-repeats; beside each, a one-key lookup measured in the same moment: the round trip and
the SDK's fixed cost, the floor a long lookup cannot go below on this host under this load.
`--skip throughput,hashing` runs the lookups alone. Each part starts once the page cache's dirty
pages are on disk (os.sync; the time it took is printed): 2 GiB of them pending (a file written just
before) doubled a long lookup's time.

TCP (bench/tcp_throughput.py's rows, default congestion control, no Redis): 1 and 4 MiB pages put and
got over KVStoreClient(transport="tcp") beside a raw Python socket doing the same exchange and Mooncake's
Transfer Engine over TCP, interleaved batch by batch, in both placements (split: client on CPU 0, servers on
CPU 1; shared: all on CPU 0). Write-down (bench/writedown_latency.py, shortened: --writedown-idle-s,
--writedown-loaded-s, in four idle and four loaded windows, alternating): a one-page get's p99 while
write-back saturates the node's LMDB shards, over its idle p99, with the node alone on CPU 1, and the pages written
down a second meanwhile; then its control run (the same loader, nothing written down), whose ratio is what
the loader alone, on the reader's core, does to the reader.

Last, each goal is printed beside this run's figure, met or short: 1-4 MiB put and get >= 0.9 of memmove and
>= 1.15x Mooncake, 64 KiB >= 0.7 of memmove, 4 KiB >= 500k pages/s each way, a 128k-token lookup <= 1 ms by
keys and <= 2 ms by tokens, TCP put and get >= 0.9 of the raw socket in each placement and >= 1.5x Mooncake's
Transfer Engine, a reader's p99 under write-down <= 2x idle with >= 3,366 pages of 64 KiB written down a
second.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import numpy as np

import _mooncake_peer
import _mooncake_te_peer
import tcp_throughput
import writedown_latency
from _server import ServerProcess
from kvstore_client import KVStoreClient, Namespace, keys as kv_keys, native, page_buffer, shared_page_buffer

PAGE_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
BATCH_PAGES = {4 << 10: 1024, 64 << 10: 128, 1 << 20: 128, 4 << 20: 32}
LOOKUP_PAGES = (1024, 8192, 32768)
PAGE_TOKENS = 16
TCP_PAGE_SIZES = (1 << 20, 4 << 20)
TCP_WORKING_SET = 256 << 20
TCP_BATCH_PAGES = 64
WRITEDOWN_PAGES_PER_S = 3366   # 64 KiB pages a second, before write-down's transactions were cut to 256 KiB


def memmove_gbps(src: int, dst: int, nbytes: int, page_bytes: int) -> float:
    started = time.perf_counter()
    for offset in range(0, nbytes, page_bytes):
        ctypes.memmove(dst + offset, src + offset, page_bytes)
    return nbytes / (time.perf_counter() - started) / 1e9


def kvstore_round(client: KVStoreClient, src: np.ndarray, dst: np.ndarray, page_bytes: int, run: int) -> tuple:
    pages, batch = src.nbytes // page_bytes, BATCH_PAGES[page_bytes]
    ns = Namespace(model="hot-path", page_bytes=page_bytes)
    source, out = src.reshape(pages, page_bytes), dst.reshape(pages, page_bytes)
    keys = [f"r{run}-{i}" for i in range(pages)]
    started = time.perf_counter()
    for start in range(0, pages, batch):
        assert client.put(ns, keys[start:start + batch], source[start:start + batch]) == min(batch, pages - start)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    for start in range(0, pages, batch):
        assert client.get(ns, keys[start:start + batch], out[start:start + batch]) == min(batch, pages - start)
    get_s = time.perf_counter() - started
    assert np.array_equal(source[::max(1, pages // 7)], out[::max(1, pages // 7)])
    for start in range(0, pages, batch):
        client.delete(ns, keys[start:start + 1])
    return src.nbytes / put_s / 1e9, src.nbytes / get_s / 1e9, pages / put_s, pages / get_s


def mooncake_round(peer, src: int, dst: int, nbytes: int, page_bytes: int, run: int) -> tuple:
    pages, batch = nbytes // page_bytes, BATCH_PAGES[page_bytes]
    keys = [f"r{run}-p{page_bytes}-{i}" for i in range(pages)]
    stored = loaded = 0
    started = time.perf_counter()
    for start in range(0, pages, batch):
        part = range(start, min(start + batch, pages))
        stored += peer.put(keys[start:start + batch], [src + i * page_bytes for i in part], page_bytes)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    for start in range(0, pages, batch):
        part = range(start, min(start + batch, pages))
        loaded += peer.get(keys[start:start + batch], [dst + i * page_bytes for i in part], page_bytes)
    get_s = time.perf_counter() - started
    peer.remove(keys)
    return nbytes / put_s / 1e9, nbytes / get_s / 1e9, pages - stored, pages - loaded


def throughput(args, page_sizes: list[int], mooncake_reason: str) -> list[dict]:
    """Each repeat of each page size runs memmove, kvstore and Mooncake back to back, so every ratio compares
    figures taken within seconds of each other: on a shared host, a slow minute between a kvstore phase and
    a Mooncake phase moved put/mc by a fifth either way."""
    working_set = args.working_set_mib << 20
    src, dst = page_buffer(1, working_set)[0], page_buffer(1, working_set)[0]
    src[:] = np.random.default_rng(0).integers(0, 255, working_set, dtype=np.uint8)
    dst[:] = 1   # faulted in before timing
    shared_src, shared_dst = shared_page_buffer(1, working_set)[0], shared_page_buffer(1, working_set)[0]
    shared_src[:], shared_dst[:] = src, 1
    rows = {p: {"page_bytes": p, "pages": working_set // p, "batch_pages": BATCH_PAGES[p]} for p in page_sizes}
    server = ServerProcess(f"dram.arena_bytes={working_set + (256 << 20)}", "dram.slab_bytes=4MiB",
                           cpus=args.server_cpu)
    peer = None
    try:
        if not mooncake_reason:
            peer = _mooncake_peer.MooncakePeer(segment_bytes=working_set + (working_set >> 1) + (256 << 20),
                                               pool_bytes=2 * working_set + (64 << 20), cpus=args.server_cpu)
            pool_src, pool_dst = peer.pool_buffer(working_set), peer.pool_buffer(working_set)
            ctypes.memmove(pool_src, src.ctypes.data, working_set)   # the same pages, where Mooncake reads them
            ctypes.memset(pool_dst, 1, working_set)
        with KVStoreClient(server.address) as client:
            for p in page_sizes:
                figures: dict[str, list[float]] = {}
                failed = 0
                for run in range(args.repeats):
                    taken = {"memmove_gbps": memmove_gbps(src.ctypes.data, dst.ctypes.data, working_set, p)}
                    taken.update(zip(("put_gbps", "get_gbps", "put_pages_per_s", "get_pages_per_s"),
                                     kvstore_round(client, shared_src, shared_dst, p, run)))
                    taken.update(zip(("any_put_gbps", "any_get_gbps"),
                                     kvstore_round(client, src, dst, p, run + args.repeats)))
                    if peer is not None:
                        put, get, put_failed, get_failed = mooncake_round(peer, pool_src, pool_dst, working_set, p, run)
                        taken.update(mooncake_put_gbps=put, mooncake_get_gbps=get)
                        failed += put_failed + get_failed
                    for name, figure in taken.items():
                        figures.setdefault(name, []).append(figure)
                rows[p].update({name: statistics.median(values) for name, values in figures.items()})
                if peer is not None:
                    rows[p]["mooncake_failed_pages"] = failed
    finally:
        server.stop()
        if peer is not None:
            peer.stop()
    return list(rows.values())


def lookups(args) -> list[dict]:
    """Latency of one SDK lookup of n pages, all present, by keys and by tokens (hashed in the SDK)."""
    most = max(LOOKUP_PAGES)
    tokens = np.random.default_rng(1).integers(0, 128_000, most * PAGE_TOKENS).astype(np.uint32)
    ns = Namespace(model="lookup", page_bytes=4096, page_tokens=PAGE_TOKENS)
    keys = kv_keys.prefix_hashes(tokens, PAGE_TOKENS)
    server = ServerProcess(f"dram.arena_bytes={most * 4096 + (64 << 20)}", cpus=args.server_cpu)
    rows = []
    try:
        with KVStoreClient(server.address) as client:
            page = np.zeros((1024, 4096), dtype=np.uint8)
            for start in range(0, most, 1024):
                parent = keys[start - 1] if start else None
                assert client.put(ns, keys[start:start + 1024], page, parent=parent) == 1024
            for n in LOOKUP_PAGES:
                # the floor: one page, the round trip and the SDK's fixed cost, in the same moment's load
                row = {"pages": n, **_lookup_times("one_key", lambda: client.lookup(ns, keys=keys[:1]), 1, args)}
                row.update(_lookup_times("keys", lambda: client.lookup(ns, keys=keys[:n]), n, args))
                row.update(_lookup_times("tokens", lambda: client.lookup(ns, tokens=tokens[:n * PAGE_TOKENS]), n, args))
                rows.append(row)
    finally:
        server.stop()
    return rows


def settled(report: dict, part: str, run):
    """run() once the page cache's dirty pages are on disk (os.sync): with 2 GiB of them pending (a 3 GB file
    written just before) a lookup of 8k pages took 1.7 ms instead of 0.7, and a one-key one 0.14 instead of
    0.07. How long the sync took goes into the report."""
    started = time.monotonic()
    os.sync()
    report["settle_s"][part] = round(time.monotonic() - started, 3)
    return run()


def _lookup_times(how: str, call, pages: int, args) -> dict:
    times = []
    for _ in range(args.lookup_repeats):
        started = time.perf_counter()
        assert call() == pages
        times.append(time.perf_counter() - started)
    return {f"{how}_ms_median": statistics.median(times) * 1e3, f"{how}_ms_min": min(times) * 1e3}


def hashing(args) -> dict:
    """prefix_hashes of a 128k-token prompt (16-token pages), Mtok/s, best of --lookup-repeats."""
    tokens = np.random.default_rng(2).integers(0, 128_000, 131072).astype(np.uint32)
    cases = {"native_numpy_uint32": (kv_keys.prefix_hashes, tokens),
             "native_numpy_int64": (kv_keys.prefix_hashes, tokens.astype(np.int64)),
             "native_list": (kv_keys.prefix_hashes, tokens.tolist()),
             "python_numpy_uint32": (kv_keys.prefix_hashes_python, tokens)}
    if not native.available():
        cases = {"python_numpy_uint32": cases["python_numpy_uint32"]}
    result = {}
    for name, (chain, data) in cases.items():
        best = min(_timed(chain, data) for _ in range(args.lookup_repeats // 3 or 1))
        result[name + "_mtok_s"] = len(tokens) / best / 1e6
    return result


def tcp_rows(args, mooncake_reason: str) -> list[dict]:
    """tcp_throughput.measure for each placement and TCP page size (the system's congestion control, no Redis);
    Mooncake's Transfer Engine beside kvstore where it runs (in this process's private network namespace)."""
    rows = [tcp_throughput.measure(page_bytes, TCP_WORKING_SET, TCP_BATCH_PAGES, args.repeats, "", placement,
                                   with_redis=False, with_mooncake=not mooncake_reason)
            for placement in tcp_throughput.PLACEMENTS for page_bytes in TCP_PAGE_SIZES]
    os.sched_setaffinity(0, {args.client_cpu})
    return rows


def writedown(args) -> dict:
    """writedown_latency's idle and loaded phases, shortened; the node on its own core. Then its control run
    (--no-nvme: the same loader, pages evicted, nothing written down): the reader shares its core with the
    loader, and the control shows what that alone does to its p99, beside what write-down does."""
    runs = {}
    for name, extra in (("writedown", []), ("control", ["--no-nvme"])):
        options = writedown_latency.make_parser().parse_args(
            ["--idle-s", str(args.writedown_idle_s), "--loaded-s", str(args.writedown_loaded_s),
             "--client-cpu", str(args.client_cpu), "--loader-cpu", str(args.client_cpu), *extra])
        result, placement = writedown_latency.run(options)
        os.sched_setaffinity(0, {args.client_cpu})
        runs[name] = {**result, "placement": placement}
    return {**runs["writedown"], "control": runs["control"]}


def _timed(chain, data) -> float:
    started = time.perf_counter()
    chain(data, PAGE_TOKENS)
    return time.perf_counter() - started


def print_tables(report: dict) -> None:
    if report["settle_s"]:
        print("\ndirty pages written back (os.sync) before each part, seconds it took: " +
              ", ".join(f"{part} {seconds:.2f}" for part, seconds in report["settle_s"].items()))
    if report["throughput"]:
        print_throughput(report)
    if report["lookup"]:
        print(f"\nlookup of n present pages in one SDK call (ms, median / min of {report['lookup_repeats']})")
        for r in report["lookup"]:
            print(f"{r['pages']:>7} pages   by keys {r['keys_ms_median']:7.2f} / {r['keys_ms_min']:6.2f}   "
                  f"by tokens {r['tokens_ms_median']:7.2f} / {r['tokens_ms_min']:6.2f}   "
                  f"one key (floor) {r['one_key_ms_median']:5.2f} / {r['one_key_ms_min']:5.2f}")
    if report["prefix_hashes"]:
        print("\nprefix_hashes of 128k tokens, 16-token pages (Mtok/s, best): " +
              ", ".join(f"{k.removesuffix('_mtok_s')} {v:.1f}" for k, v in report["prefix_hashes"].items()))
    if report["tcp"]:
        print_tcp(report)
    if report["writedown"]:
        w = report["writedown"]
        placed = w["placement"]
        print(f"\nwrite-down: one-page 64 KiB get, node on CPU {placed['server_cpu']}, reader and loader (nice "
              f"{placed['loader_nice']}) on CPU {placed['client_cpu']}; p99 idle {w['idle']['p99_us']:.0f} µs, "
              f"under write-down {w['loaded']['p99_us']:.0f} µs ({w['p99_ratio']:.2f}x); "
              f"{w['pages_written_down_per_s']:.0f} pages written down a second; CPUs busy in the second before: " +
              ", ".join(f"{cpu} {busy:.0%}" for cpu, busy in placed["cpus_busy_before"].items()))
        if w.get("shards_alone"):
            alone = w["shards_alone"]
            print(f"the node's {alone['shards']} LMDB shards alone on this disk, the same transactions and windows: "
                  f"{alone['pages_per_s']:.0f} pages/s (write-down reached {alone['written_down_share']:.2f} of it)")
        if w.get("control"):
            c = w["control"]
            print(f"control, the same loader with nothing written down (pages evicted): p99 idle "
                  f"{c['idle']['p99_us']:.0f} µs, loaded {c['loaded']['p99_us']:.0f} µs ({c['p99_ratio']:.2f}x)")


def print_throughput(report: dict) -> None:
    print(f"\nhot path, working set {report['working_set_mib']} MiB of distinct pages, {report['placement']}, "
          f"median of {report['repeats']}; kvstore_native: {report['native']}; Mooncake: {report['mooncake']}")
    head = (f"{'page':>7} {'memmove':>8} {'put':>6} {'put/mm':>7} {'get':>6} {'get/mm':>7} "
            f"{'mc put':>7} {'mc get':>7} {'put/mc':>7} {'get/mc':>7} {'put pg/s':>9} {'get pg/s':>9} "
            f"{'any put':>8} {'any get':>8}")
    print(head + "   (GB/s unless said; put/get from and into shared page buffers, 'any' from and into "
                 "page_buffer()s)")
    for r in report["throughput"]:
        mm = r["memmove_gbps"]
        mc_put, mc_get = r.get("mooncake_put_gbps"), r.get("mooncake_get_gbps")
        mc = (f"{mc_put:>7.2f} {mc_get:>7.2f} {r['put_gbps'] / mc_put:>7.2f} {r['get_gbps'] / mc_get:>7.2f}"
              if mc_put else f"{'-':>7} {'-':>7} {'-':>7} {'-':>7}")
        print(f"{r['page_bytes'] >> 10:>5}Ki {mm:>8.2f} {r['put_gbps']:>6.2f} {r['put_gbps'] / mm:>7.2f} "
              f"{r['get_gbps']:>6.2f} {r['get_gbps'] / mm:>7.2f} {mc} {r['put_pages_per_s']:>9.0f} "
              f"{r['get_pages_per_s']:>9.0f} {r['any_put_gbps']:>8.2f} {r['any_get_gbps']:>8.2f}")


def print_tcp(report: dict) -> None:
    print(f"\nTCP on loopback, {TCP_WORKING_SET >> 20} MiB working set, batches of {TCP_BATCH_PAGES} pages, "
          f"default congestion control, no Redis; split: client CPU 0, servers CPU 1; shared: all on CPU 0; "
          f"Mooncake: {report['tcp_mooncake']}")
    tcp_throughput.print_rows(report["tcp"], open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip())

def targets(report: dict) -> list[dict]:
    """Each goal of the read and write paths beside this run's figure: (what, figure, goal, met)."""
    rows: list[dict] = []

    def goal(what: str, figure: float, bound: float, at_least: bool = True) -> None:
        figure = float(figure)   # numpy's floats compare to numpy's bools, which json cannot write
        rows.append({"what": what, "figure": figure, "goal": bound, "at_least": at_least,
                     "met": figure >= bound if at_least else figure <= bound})

    for r in report["throughput"]:
        size, mm = r["page_bytes"], r["memmove_gbps"]
        for op in ("put", "get"):
            if size >= 1 << 20:
                goal(f"{size >> 10} KiB {op} / memmove", r[f"{op}_gbps"] / mm, 0.9)
                if r.get(f"mooncake_{op}_gbps"):
                    goal(f"{size >> 10} KiB {op} / Mooncake", r[f"{op}_gbps"] / r[f"mooncake_{op}_gbps"], 1.15)
            elif size == 64 << 10:
                goal(f"64 KiB {op} / memmove", r[f"{op}_gbps"] / mm, 0.7)
            elif size == 4 << 10:
                goal(f"4 KiB {op}s, pages/s", r[f"{op}_pages_per_s"], 500_000)
    for r in report["lookup"]:
        if r["pages"] == 8192:   # 128k tokens of 16-token pages
            goal("lookup of 128k tokens by keys, ms (median)", r["keys_ms_median"], 1.0, at_least=False)
            goal("lookup of 128k tokens by tokens, ms (median)", r["tokens_ms_median"], 2.0, at_least=False)
    for r in report["tcp"]:
        for op in ("put", "get"):
            where = f"TCP {r['page_bytes'] >> 20} MiB {op}, {r['placement']}"
            goal(f"{where} / raw socket", r[f"{op}_vs_raw"], 0.9)
            if f"{op}_vs_mooncake" in r:
                goal(f"{where} / Mooncake TE", r[f"{op}_vs_mooncake"], 1.5)
    if report["writedown"]:
        goal("get p99 under write-down / idle", report["writedown"]["p99_ratio"], 2.0, at_least=False)
        goal("64 KiB pages written down a second", report["writedown"]["pages_written_down_per_s"],
             WRITEDOWN_PAGES_PER_S)
    return rows


def print_targets(rows: list[dict]) -> None:
    print("\ngoals (this run's figure beside each)")
    for row in rows:
        bound = f"{'>=' if row['at_least'] else '<='} {row['goal']:g}"
        print(f"  {row['what']:48s} {row['figure']:>10.2f}   goal {bound:>10}   {'met' if row['met'] else 'short'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--working-set-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookup-repeats", type=int, default=30)
    parser.add_argument("--page-sizes", default=",".join(str(p) for p in PAGE_SIZES))
    parser.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake peer")
    parser.add_argument("--client-cpu", type=int, default=0)
    parser.add_argument("--server-cpu", default="1", help="taskset CPU list of the servers")
    parser.add_argument("--skip", default="",
                        help="comma-separated parts not to run: hashing,lookup,throughput,tcp,writedown")
    parser.add_argument("--writedown-idle-s", type=float, default=6.0)
    parser.add_argument("--writedown-loaded-s", type=float, default=10.0)
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    unknown = set(page_sizes) - set(BATCH_PAGES)
    if unknown:
        parser.error(f"page sizes must be among {sorted(BATCH_PAGES)}, not {sorted(unknown)}")
    os.sched_setaffinity(0, {args.client_cpu})
    reason = "skipped (--no-mooncake)" if args.no_mooncake else _mooncake_peer.unavailable_reason()
    if not reason:
        _mooncake_peer.private_network()
    print(f"Mooncake peer: {'runs (dummy client over shared memory, MC_STORE_MEMCPY=1)' if not reason else reason}")
    report = {"bench": "hot_path", "working_set_mib": args.working_set_mib, "repeats": args.repeats,
              "lookup_repeats": args.lookup_repeats, "native": native.available() or native.missing_reason,
              "mooncake": reason or "dummy client, shared memory",
              "placement": f"client on CPU {args.client_cpu}, kvstore node and Mooncake servers on CPU {args.server_cpu}"}
    skip = set(args.skip.split(",")) - {""}
    report["settle_s"] = {}
    report["prefix_hashes"] = hashing(args) if "hashing" not in skip else {}
    report["lookup"] = settled(report, "lookup", lambda: lookups(args)) if "lookup" not in skip else []
    report["throughput"] = settled(report, "throughput", lambda: throughput(args, page_sizes, reason)) \
        if "throughput" not in skip else []
    te_reason = reason or _mooncake_te_peer.unavailable_reason()
    report["tcp_mooncake"] = te_reason or "Transfer Engine, TCP transport"
    report["tcp"] = settled(report, "tcp", lambda: tcp_rows(args, te_reason)) if "tcp" not in skip else []
    report["writedown"] = settled(report, "writedown", lambda: writedown(args)) if "writedown" not in skip else {}
    print_tables(report)
    report["targets"] = targets(report)
    print_targets(report["targets"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
