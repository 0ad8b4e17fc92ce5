"""Prefill-to-decode handoff through a kvstore cluster, 8k- and 32k-token prompts, next to Mooncake's
Transfer Engine moving the same bytes over TCP, in the same run.

    python bench/pd_handoff.py [--json bench/results/pd_handoff.json] [--tokens 8192,32768] [--repeats 5]

Handoff: runs examples/pd_handoff.py (read it for the setup: a real etcd, two nodes, a prefill
and a decode process, decode over TCP) for each prompt length and both modes:
  overlap  decode loads each page as soon as it is committed (get with wait_ms);
  after    decode starts loading when prefill reports its last page (transfer after prefill).
The figure is the time from prefill's last page to decode holding every page.

Transfer: the same pages (count and size as the handoff's) already stored, then loaded by the
decode side over TCP, median of `--repeats` after one warm-up load, two ways:
  kvstore   KVStoreCluster(transport="tcp").get of the chain from the same two-node cluster setup;
  mooncake  Mooncake's Transfer Engine over its TCP transport (bench/_mooncake_te_peer.py): a
            target process holds the pages in one registered buffer (the prefill side), this
            process reads them into its registered buffer with one batch_transfer_sync_read of
            page-sized pieces. It needs pip install mooncake-transfer-engine-non-cuda and root:
            the engine refuses to start without a non-loopback address, so the whole run moves
            first into a private network namespace (like `unshare -n`, plus a veth pair, as
            bench/tcp_throughput.py does) and every process of the run, etcd and kvstore's nodes
            included, shares its loopback. Where it cannot run, the reason is printed.
Placement is not pinned: prefill, decode, both nodes and Mooncake's target compete for the
machine's cores (stated in the output with their count).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import _mooncake_peer
import _mooncake_te_peer

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "pd_handoff.py")


def load_example():
    """examples/pd_handoff.py as a module (its start_cluster), under a name that is not this file's."""
    spec = importlib.util.spec_from_file_location("pd_handoff_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(load, repeats: int) -> float:
    """Median seconds of `repeats` loads, after one warm-up load (connections, handshakes)."""
    load()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        load()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def kvstore_transfer(example, pages: np.ndarray, nodes: int, arena: str, repeats: int) -> float:
    from kvstore_client.cluster import KVStoreCluster
    from kvstore_client.keys import Namespace, prefix_hashes

    count, page_bytes = pages.shape
    ns = Namespace(model=f"pd-transfer-{count}", page_bytes=page_bytes)
    keys = prefix_hashes(list(range(count * 64)), page_tokens=64)
    out = np.empty_like(pages)
    with tempfile.TemporaryDirectory(prefix="kvstore-pd-transfer-") as workdir:
        procs, url = example.start_cluster(workdir, nodes, arena)
        try:
            with KVStoreCluster(url) as writer, KVStoreCluster(url, transport="tcp") as reader:
                for client in (writer, reader):
                    deadline = time.monotonic() + 30
                    while len([m for m in client.members() if m.state == "serving"]) < nodes:
                        if time.monotonic() > deadline:
                            raise SystemExit("the transfer cluster's nodes never all joined")
                        time.sleep(0.05)
                if writer.put(ns, keys, pages) != count:
                    raise SystemExit("the transfer cluster did not store every page")

                def load() -> None:
                    out.fill(0)
                    if reader.get(ns, keys, out) != count or not np.array_equal(out, pages):
                        raise SystemExit("kvstore loaded pages that differ from those stored")

                return timed(load, repeats)
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(30)


def mooncake_transfer(pages: np.ndarray, repeats: int) -> float:
    out = np.empty_like(pages)
    peer = _mooncake_te_peer.TransferEnginePeer(pages.nbytes, cpus=f"0-{os.cpu_count() - 1}")
    try:
        peer.register(pages, out)
        peer.put(pages, 0)                  # the target (prefill side) holds the pages

        def load() -> None:
            out.fill(0)
            peer.get(out, 0)
            if not np.array_equal(out, pages):
                raise SystemExit("Mooncake's Transfer Engine read pages that differ from those written")

        return timed(load, repeats)
    finally:
        peer.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "pd_handoff.json"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    absent = _mooncake_te_peer.unavailable_reason()
    if not absent:
        _mooncake_peer.private_network()    # before etcd and the nodes start: they all share this namespace
    handoff = subprocess.run([sys.executable, EXAMPLE, "--tokens", args.tokens, "--runs", "overlap,after",
                              "--json", args.json])
    with open(args.json) as f:
        report = json.load(f)
    example = load_example()
    settings = report["args"]
    transfers = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        run = next(r for r in report["runs"] if r["tokens"] == tokens)
        pages = np.random.default_rng(tokens).integers(0, 256, (run["pages"], run["bytes"] // run["pages"]),
                                                       dtype=np.uint8)
        row = {"tokens": tokens, "pages": run["pages"], "bytes": run["bytes"],
               "kvstore_s": kvstore_transfer(example, pages, settings["nodes"], settings["arena"], args.repeats)}
        if not absent:
            row["mooncake_s"] = mooncake_transfer(pages, args.repeats)
        transfers.append(row)
    print(f"\nthe same pages, stored, loaded by the decode side over TCP (median of {args.repeats}; loopback"
          f"{' in a private network namespace' if not absent else ''}; not pinned, {os.cpu_count()} cores shared)")
    if absent:
        print(f"no mooncake column: {absent}")
    for row in transfers:
        line = (f"{row['tokens']:>6} tokens  {row['pages']:>4} pages ({row['bytes'] / 2**20:6.1f} MiB)  "
                f"kvstore {row['kvstore_s'] * 1000:7.1f} ms ({row['bytes'] / row['kvstore_s'] / 1e9:5.2f} GB/s)")
        if "mooncake_s" in row:
            line += (f"  mooncake TE {row['mooncake_s'] * 1000:7.1f} ms "
                     f"({row['bytes'] / row['mooncake_s'] / 1e9:5.2f} GB/s)  "
                     f"kvstore/mooncake time {row['kvstore_s'] / row['mooncake_s']:4.2f}")
        print(line)
    report.update({"bench": "pd_handoff", "cores": os.cpu_count(), "private_network": not absent,
                   "mooncake_absent": absent, "transfer_repeats": args.repeats, "transfer": transfers})
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    return handoff.returncode


if __name__ == "__main__":
    sys.exit(main())
