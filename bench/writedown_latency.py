"""Latency of a one-page get from DRAM on an idle node, and while write-back saturates LMDB.

    python bench/writedown_latency.py [--json out.json] [--idle-s 8] [--loaded-s 15] [--rounds 4]

A real kvstore-server runs with one NVMe path in a temp dir (its nvme.shards_per_path shards), a small DRAM arena and
controller.write_policy=write_back with high_watermark=0.5. One 64 KiB page is put and
then got back (KVStoreClient.get of one key, the page in DRAM) every `--interval-us`,
timed around the call:
  idle    nothing else runs;
  loaded  a second process puts distinct pages as fast as it can, so DRAM stays above the
          high watermark and the controller writes pages down to LMDB without pause (and
          eviction writes some down itself when the loader outruns it). The window opens
          once pages are being written down, and the pages written down in it are counted
          from the server's stats (NVMe tier bytes_in).
The two phases alternate, `--rounds` windows of each, idle first: the loader is paused between
its puts for an idle window, which opens once write-down has stopped. On a shared host a slow
spell of a few seconds otherwise lands in one phase only: run back to back (one idle phase, then
one loaded), the control's idle p99 came out 0.8-3.6 ms in three runs of one hour, its ratio
0.43-1.77. The table gives p50/p99/p999/max of each phase's samples, all its windows together,
and loaded/idle ratios; the goal is a p99 ratio of 2 or less. The JSON adds a power-of-two
histogram of each phase. A get served from NVMe instead of DRAM would measure promotion, so the
hot page is got all along (it stays the most recently used page) and the window's DRAM and NVMe
hits are printed. `--no-nvme` is the control: the same loader, pages evicted instead of written down.
Write-down's pages/s stand beside what the node's shards alone commit on the same disk, a thread a shard,
in the same transactions and windows (shards_alone): one LMDB shard alone on this host's disk sustained
1,900-2,900 pages of 64 KiB a second once a few GB were written (256 KiB to 1 MiB transactions), where its
first seconds took 3,900-7,300; four at once, 5,000-5,800 in their first seconds.

Placement (taskset): server on CPU 1, measured client on CPU 0, loader on `--loader-cpu`
(default 0, with the measured client, so the server keeps its own core). Sharing that core, the
loader alone raises the client's p99 (the control run's ratio: 1.7-2.0x on a two-core host);
`--loader-nice 10` lets the measured client take the core first, so what is left is the node's
side (the control then 0.5-1.8x in six runs of one hour: below 1 where the loader keeps the core
awake, and the reader wakes sooner than on an idle one). Other work on the machine inflates both
phases and shrinks the ratio: the header shows how busy each CPU was in the second before the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from _server import ServerProcess
from kvstore import config as config_module
from kvstore.tiers import nvme_layout
from kvstore.tiers.nvme import NvmeTier, StoredPage
from kvstore_client import KVStoreClient, Namespace
from kvstore_client.proto import pb

PAGE_BYTES = 64 << 10
PAUSE, RESUME = signal.SIGUSR1, signal.SIGUSR2   # to the loader: stop putting after this put, go on
HOT = Namespace(model="bench-hot", page_bytes=PAGE_BYTES)
LOAD = Namespace(model="bench-load", page_bytes=PAGE_BYTES)


def cpus_busy(seconds: float) -> dict[str, float]:
    """Fraction of each CPU busy over `seconds` (/proc/stat), to show other work on the machine."""
    def ticks() -> dict[str, tuple[int, int]]:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
        return {row[0]: (sum(map(int, row[1:9])), int(row[4]) + int(row[5])) for row in rows}
    first = ticks()
    time.sleep(seconds)
    busy = {}
    for cpu, (total, idle) in ticks().items():
        elapsed = total - first[cpu][0]
        busy[cpu] = 1 - (idle - first[cpu][1]) / elapsed if elapsed else 0.0
    return busy


def sample_gets(client: KVStoreClient, seconds: float, interval_s: float) -> tuple[np.ndarray, int]:
    """Get the hot page every interval for `seconds`; (latencies in µs, misses)."""
    out = np.empty(PAGE_BYTES, dtype=np.uint8)
    latencies, misses = [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter_ns()
        loaded = client.get(HOT, [b"hot"], out)
        latencies.append(time.perf_counter_ns() - started)
        misses += loaded != 1
        time.sleep(interval_s)
    return np.array(latencies, dtype=np.float64) / 1e3, misses


def percentiles(latencies_us: np.ndarray) -> dict:
    p50, p99, p999 = np.percentile(latencies_us, [50, 99, 99.9])
    # counts per power-of-two bucket: {"<=256": n, ...} shows whether the tail is one mode or many
    buckets = np.bincount(np.ceil(np.log2(np.maximum(latencies_us, 1))).astype(int))
    histogram = {f"<={1 << b}": int(n) for b, n in enumerate(buckets) if n}
    return {"samples": int(latencies_us.size), "p50_us": p50, "p99_us": p99, "p999_us": p999,
            "max_us": float(latencies_us.max()), "histogram_us": histogram}


def tier(stats: pb.StatsResponse, which: int) -> pb.TierStats:
    return next(t for t in stats.tiers if t.tier == which)


def counters(client: KVStoreClient) -> dict:
    stats = client.stats()
    dram = tier(stats, pb.DRAM)
    nvme = next((t for t in stats.tiers if t.tier == pb.NVME), pb.TierStats())  # absent with --no-nvme
    return {"dram_used_bytes": dram.used_bytes, "dram_capacity_bytes": dram.capacity_bytes,
            "dram_hits": dram.hits, "nvme_hits": nvme.hits, "dram_evictions": dram.evictions,
            "demotions": dram.demotions, "nvme_bytes_in": nvme.bytes_in,
            "nvme_evictions": nvme.evictions, "write_queue_drops": stats.write_queue_drops,
            "nvme_write_errors": stats.nvme_write_errors}


def run_loader(address: str, batch: int, paused_at_start: bool) -> None:
    """The loader process: put distinct pages in chains of `batch` until SIGTERM (paused from PAUSE to
    RESUME); print what it put, and the seconds it spent putting."""
    stopping, paused = [], threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(PAUSE, lambda *_: paused.set())
    signal.signal(RESUME, lambda *_: paused.clear())
    if paused_at_start:
        paused.set()
    print("ready", flush=True)   # the signals are handled from here on
    pages = np.random.default_rng(2).integers(0, 256, (batch, PAGE_BYTES), dtype=np.uint8)
    put, short, seconds = 0, 0, 0.0
    # It shares the measured client's core: polling for answers (spin_us) it would hold that core from the reader.
    with KVStoreClient(address, timeout_s=60, spin_us=0) as client:
        while not stopping:
            if paused.is_set():   # between puts: it holds no lease while it waits
                time.sleep(0.01)
                continue
            keys = [f"L{put + i}".encode() for i in range(batch)]
            started = time.monotonic()
            stored = client.put(LOAD, keys, pages)
            seconds += time.monotonic() - started
            short += stored < batch
            put += batch
    json.dump({"pages": put, "short_puts": short, "seconds": seconds}, sys.stdout)


def wait_writing_down(client: KVStoreClient, watermark: float, timeout_s: float, nvme: bool,
                      interval_s: float) -> dict:
    """Poll until DRAM is over the watermark and pages are being written down (without NVMe:
    evicted); the counters then. The hot page is got meanwhile, so it stays the most recently
    used page and in DRAM."""
    deadline = time.monotonic() + timeout_s
    first = counters(client)
    while time.monotonic() < deadline:
        sample_gets(client, 0.2, interval_s)
        now = counters(client)
        if (now["dram_used_bytes"] > watermark * now["dram_capacity_bytes"]
                and (now["nvme_bytes_in"] > first["nvme_bytes_in"] if nvme
                     else now["dram_evictions"] > first["dram_evictions"])):
            return now
    raise RuntimeError(f"no write-down within {timeout_s}s: {counters(client)}")


def wait_quiet(client: KVStoreClient, timeout_s: float, interval_s: float) -> None:
    """Poll until nothing is written down or evicted between two polls (the loader paused, the controller
    done with what it had claimed); the hot page is got meanwhile, as in wait_writing_down."""
    deadline = time.monotonic() + timeout_s
    moving = ("nvme_bytes_in", "dram_evictions")
    last = counters(client)
    while time.monotonic() < deadline:
        sample_gets(client, 0.2, interval_s)
        now = counters(client)
        if all(now[key] == last[key] for key in moving):
            return
        last = now
    raise RuntimeError(f"write-down did not stop within {timeout_s}s of pausing the loader: {counters(client)}")


def measure(args: argparse.Namespace, address: str) -> dict:
    """Idle and loaded windows, alternating (`args.rounds` of each, idle first); each phase's samples together."""
    interval_s = args.interval_us / 1e6
    idle_s, loaded_s = args.idle_s / args.rounds, args.loaded_s / args.rounds
    idle, loaded, window = [], [], collections.Counter()
    misses = {"idle": 0, "loaded": 0}
    with KVStoreClient(address, timeout_s=60) as client:
        assert client.put(HOT, [b"hot"], np.full(PAGE_BYTES, 7, dtype=np.uint8)) == 1
        sample_gets(client, 1.0, interval_s)  # warm-up: connections, arena mapping, caches
        loader = subprocess.Popen(
            ["nice", "-n", str(args.loader_nice), "taskset", "-c", str(args.loader_cpu), sys.executable, __file__,
             "--loader", address, "--loader-batch", str(args.loader_batch), "--loader-paused"], stdout=subprocess.PIPE)
        try:
            if loader.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the loader did not start: exit status {loader.wait()}")
            for _ in range(args.rounds):
                latencies, missed = sample_gets(client, idle_s, interval_s)
                idle.append(latencies)
                misses["idle"] += missed
                loader.send_signal(RESUME)
                before = wait_writing_down(client, args.high_watermark, 30, not args.no_nvme, interval_s)
                latencies, missed = sample_gets(client, loaded_s, interval_s)
                after = counters(client)
                loaded.append(latencies)
                misses["loaded"] += missed
                window.update({key: after[key] - before[key] for key in after
                               if key not in ("dram_used_bytes", "dram_capacity_bytes")})
                loader.send_signal(PAUSE)
                wait_quiet(client, 30, interval_s)
        finally:
            loader.send_signal(signal.SIGTERM)
            loader_out, _ = loader.communicate(timeout=60)
    assert loader.returncode == 0, f"loader exited with {loader.returncode}"
    result = {"idle": {**percentiles(np.concatenate(idle)), "misses": misses["idle"]},
              "loaded": {**percentiles(np.concatenate(loaded)), "misses": misses["loaded"]},
              "window": {**window, "pages_written_down": window["nvme_bytes_in"] // PAGE_BYTES,
                         "dram_used_bytes_end": after["dram_used_bytes"],
                         "dram_capacity_bytes": after["dram_capacity_bytes"]},
              "loader": json.loads(loader_out)}
    result["p50_ratio"] = result["loaded"]["p50_us"] / result["idle"]["p50_us"]
    result["p99_ratio"] = result["loaded"]["p99_us"] / result["idle"]["p99_us"]
    return result


def shards_alone(args: argparse.Namespace, directory: str | None) -> dict:
    """What the node's NVMe shards commit on this disk with no node around them: 64 KiB pages of random keys
    written through NvmeTier (the node's own write path) into one path laid out as the node lays it out
    (nvme.shards_per_path), in the node's transactions (controller.write_txn_bytes), a thread a shard as
    write-down writes them, on the server's CPU, in windows timed like the loaded ones (the idle ones between,
    so the disk drains as it did). Fresh shards in the same file system: write-down's physical bound."""
    settings = config_module.load(environ={}, overrides=args.set)
    txn_pages = max(1, settings.controller.write_txn_bytes // PAGE_BYTES)
    per_path = settings.nvme.shards_per_path
    page, pages, seconds = memoryview(np.random.default_rng(3).bytes(PAGE_BYTES)), [0] * per_path, 0.0
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {args.server_cpu})   # the writer threads inherit it

    def write_until(tier: NvmeTier, shard: int, end: float) -> None:
        while time.perf_counter() < end:
            tier.write(shard, [(StoredPage(1, os.urandom(16).hex().encode(), b"", PAGE_BYTES, 0), page)
                               for _ in range(txn_pages)])
            pages[shard] += txn_pages

    try:
        with tempfile.TemporaryDirectory(prefix="kvstore-shards-alone-", dir=directory) as path:
            tier = NvmeTier(nvme_layout.shard_directories((path,), per_path), (args.map_gib << 30) // per_path,
                            io_threads=1)
            try:
                for _ in range(args.rounds):
                    time.sleep(args.idle_s / args.rounds)
                    started = time.perf_counter()
                    writers = [threading.Thread(target=write_until,
                                                args=(tier, shard, started + args.loaded_s / args.rounds))
                               for shard in range(per_path)]
                    for writer in writers:
                        writer.start()
                    for writer in writers:
                        writer.join()
                    seconds += time.perf_counter() - started
            finally:
                tier.close()
    finally:
        os.sched_setaffinity(0, allowed)
    return {"pages_per_s": sum(pages) / seconds, "txn_pages": txn_pages, "shards": per_path, "pages": sum(pages)}


def _at_least_one(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least one window of each")
    return int(text)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=8.0)
    parser.add_argument("--loaded-s", type=float, default=15.0)
    parser.add_argument("--rounds", type=_at_least_one, default=4, help="idle and loaded windows of each, alternating")
    parser.add_argument("--interval-us", type=int, default=500, help="pause between measured gets")
    parser.add_argument("--arena-mib", type=int, default=256)
    parser.add_argument("--high-watermark", type=float, default=0.5)
    parser.add_argument("--map-gib", type=int, default=16, help="nvme.map_bytes of the one path")
    parser.add_argument("--nvme-dir", help="where the shard goes (default: a temp dir)")
    parser.add_argument("--no-nvme", action="store_true",
                        help="control run: the same loader, but DRAM only (pages evicted, nothing written down), "
                             "to tell the cost of the loader's puts from that of write-down")
    parser.add_argument("--loader-batch", type=int, default=64, help="pages per loader put (one chain)")
    parser.add_argument("--client-cpu", type=int, default=0)
    parser.add_argument("--server-cpu", type=int, default=1)
    parser.add_argument("--loader-cpu", type=int, default=0)
    parser.add_argument("--loader-nice", type=int, default=0,
                        help="niceness of the loader process (it shares the measured client's CPU by default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a node setting more (kvstore-server --set), e.g. controller.write_txn_bytes=1MiB")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--loader", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--loader-paused", action="store_true", help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> tuple[dict, dict]:
    """A node with one NVMe path, measured (measure()); (the result, where each process ran). This process
    moves to --client-cpu."""
    os.sched_setaffinity(0, {args.client_cpu})
    busy_before = cpus_busy(1.0)  # other work on these two cores inflates both phases: rerun when quiet
    with tempfile.TemporaryDirectory(prefix="kvstore-writedown-", dir=args.nvme_dir) as shard:
        settings = [f"dram.arena_bytes={args.arena_mib}MiB", "dram.slab_bytes=16MiB",
                    f"nvme.enabled={str(not args.no_nvme).lower()}",
                    f"nvme.paths={shard}", f"nvme.map_bytes={args.map_gib}GiB",
                    "controller.write_policy=write_back", f"controller.high_watermark={args.high_watermark}",
                    *args.set]
        server = ServerProcess(*settings, cpus=str(args.server_cpu))
        try:
            result = measure(args, server.address)
        finally:
            server.stop()
    placement = {"server_cpu": args.server_cpu, "client_cpu": args.client_cpu, "loader_cpu": args.loader_cpu,
                 "loader_nice": args.loader_nice,
                 "cpus_online": os.cpu_count(), "cpus_busy_before": busy_before}
    result["pages_written_down_per_s"] = result["window"]["pages_written_down"] / args.loaded_s
    if not args.no_nvme:
        alone = result["shards_alone"] = shards_alone(args, args.nvme_dir)
        alone["written_down_share"] = result["pages_written_down_per_s"] / alone["pages_per_s"]
    return result, placement


def main() -> None:
    args = make_parser().parse_args()
    if args.loader:
        run_loader(args.loader, args.loader_batch, args.loader_paused)
        return
    result, placement = run(args)
    busy_before = placement["cpus_busy_before"]
    config = {"page_bytes": PAGE_BYTES, "arena_mib": args.arena_mib, "high_watermark": args.high_watermark,
              "map_gib": args.map_gib, "nvme": not args.no_nvme, "loader_batch_pages": args.loader_batch,
              "interval_us": args.interval_us,
              "idle_s": args.idle_s, "loaded_s": args.loaded_s, "rounds": args.rounds}
    window, loader = result["window"], result["loader"]
    print(f"one-page get (64 KiB, in DRAM), write_back with high_watermark {args.high_watermark}, "
          f"DRAM {args.arena_mib} MiB, {'no NVMe (control run)' if args.no_nvme else 'one NVMe path'}; "
          f"{args.rounds} idle and {args.rounds} loaded windows alternating; server on CPU {args.server_cpu}, "
          f"measured client on CPU {args.client_cpu}, loader on CPU {args.loader_cpu}; "
          "CPUs busy in the second before: " + ", ".join(f"{cpu} {busy:.0%}" for cpu, busy in busy_before.items()))
    print(f"{'':>8} {'samples':>8} {'p50 µs':>9} {'p99 µs':>9} {'p999 µs':>9} {'max µs':>9} {'misses':>7}")
    for name in ("idle", "loaded"):
        r = result[name]
        print(f"{name:>8} {r['samples']:>8} {r['p50_us']:>9.0f} {r['p99_us']:>9.0f} {r['p999_us']:>9.0f} "
              f"{r['max_us']:>9.0f} {r['misses']:>7}")
    print(f"loaded/idle: p50 {result['p50_ratio']:.2f}x, p99 {result['p99_ratio']:.2f}x (goal: p99 <= 2x)")
    print(f"loaded window: {window['pages_written_down']} pages written down "
          f"({result['pages_written_down_per_s']:.0f}/s), {window['dram_evictions']} DRAM evictions, "
          f"{window['nvme_evictions']} NVMe evictions, {window['write_queue_drops']} write-queue drops; "
          f"loader put {loader['pages']} pages in {loader['seconds']:.1f} s")
    if "shards_alone" in result:
        alone = result["shards_alone"]
        print(f"the node's {alone['shards']} LMDB shards alone on this disk ({alone['txn_pages']} pages a transaction, "
              "a thread a shard, the same windows): "
              f"{alone['pages_per_s']:.0f} pages/s; write-down reached {alone['written_down_share']:.2f} of it")
    print(f"measured gets in the window served from DRAM: {window['dram_hits']} "
          f"(from NVMe: {window['nvme_hits']}, misses: {result['loaded']['misses']}, "
          f"samples: {result['loaded']['samples']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "writedown_latency", "placement": placement, "config": config, **result}, f, indent=2)


if __name__ == "__main__":
    main()
