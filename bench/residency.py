"""The residency query across a cluster: one SDK call for a 128k-token prompt over 3 nodes and 2 engines.

    python bench/residency.py [--tokens 131072] [--page-tokens 16] [--calls 100] [--json bench/results/residency.json]

A real etcd and three nodes on this host (DRAM only); the prompt's pages (4 KiB each) are put through the
cluster client, so each node holds its share. Two engines publish their KV events with vLLM's own
ZmqEventPublisher, event classes and prefix-cache hashing (sha256_cbor): e1 holds the whole prompt in its GPU
and is followed by node0, e2 the first half and is followed by node1. Timed: KVStoreCluster.residency by
token ids (hashed in the SDK) and by keys, with both engines named, and, in the same moment, a cluster lookup
of the same prompt and a one-page residency (the floor: a round trip to each node). Control messages go over
each node's local socket (a router on the nodes' host) and, in a second client, over gRPC (transport="tcp",
a router elsewhere). Processes are not pinned: etcd, the nodes and this client share the host's CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from pd_handoff import start_etcd  # noqa: E402  (a real etcd on loopback)

PAGE_BYTES = 4096


def start_node(workdir: str, etcd: str, node_id: str, follows: dict[str, tuple[str, str]]) -> subprocess.Popen:
    ready = os.path.join(workdir, f"{node_id}.json")
    args = [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0", "--ready-file", ready,
            "--shm-socket", os.path.join(workdir, f"{node_id}.sock"), "--arena-bytes", "96MiB",
            "--set", "nvme.enabled=false", "--set", "server.log_level=WARNING",
            "--set", "ops.metrics_address=127.0.0.1:0", "--set", f"cluster.endpoints={etcd}",
            "--set", "cluster.name=residency", "--set", f"cluster.node_id={node_id}", "--set", "cluster.ramp_s=0"]
    if follows:
        args += ["--set", "events.engine_ids=" + ",".join(follows),
                 "--set", "events.endpoints=" + ",".join(pub for pub, _ in follows.values()),
                 "--set", "events.replay_endpoints=" + ",".join(replay for _, replay in follows.values())]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise SystemExit(f"{node_id} did not start")
        time.sleep(0.05)
    return proc


class Engine:
    """vLLM's publisher and hashing for one engine's prefix cache (no GPU needed to publish)."""

    def __init__(self, workdir: str, name: str):
        from vllm.distributed.kv_events import ZmqEventPublisher
        self.endpoint, self.replay = f"ipc://{workdir}/{name}-pub", f"ipc://{workdir}/{name}-replay"
        self.publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=self.endpoint, replay_endpoint=self.replay,
                                           buffer_steps=100)

    def prefill(self, tokens: list[int], block: int) -> None:
        from vllm.distributed.kv_events import BlockStored, KVEventBatch
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils
        hashes, parent = [], None
        for start in range(0, len(tokens) - block + 1, block):
            parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start:start + block])
            hashes.append(kv_cache_utils.maybe_convert_block_hash(parent))
        self.publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:len(hashes) * block], block_size=block,
            lora_id=None, medium="GPU", lora_name=None)]))

    def close(self) -> None:
        self.publisher.shutdown()


def timed(call, calls: int) -> dict:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e3)
    return {"median_ms": round(statistics.median(samples), 3), "p90_ms": round(sorted(samples)[int(0.9 * calls)], 3),
            "min_ms": round(min(samples), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128 << 10)
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--json")
    args = parser.parse_args()

    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils

    from kvstore_client import KVStoreClient, Namespace
    from kvstore_client.keys import prefix_hashes

    kv_cache_utils.init_none_hash(sha256_cbor)
    block = args.page_tokens
    pages = args.tokens // block
    tokens = np.random.default_rng(3).integers(0, 32000, args.tokens).tolist()
    ns = Namespace(model="residency-bench", page_bytes=PAGE_BYTES, page_tokens=block)
    report: dict = {"tokens": args.tokens, "pages": pages, "nodes": 3, "engines": 2, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as workdir:
        etcd, endpoint = start_etcd(workdir)
        engines = {name: Engine(workdir, name) for name in ("e1", "e2")}
        nodes = [start_node(workdir, endpoint, "node0", {"e1": (engines["e1"].endpoint, engines["e1"].replay)}),
                 start_node(workdir, endpoint, "node1", {"e2": (engines["e2"].endpoint, engines["e2"].replay)}),
                 start_node(workdir, endpoint, "node2", {})]
        url = f"etcd://{endpoint.removeprefix('http://')}/residency"
        try:
            engines["e1"].prefill(tokens, block)
            engines["e2"].prefill(tokens[:args.tokens // 2], block)
            keys = prefix_hashes(tokens, block)
            for transport in ("auto", "tcp"):
                with KVStoreClient(url, replicas=1, transport=transport) as pool:
                    deadline = time.monotonic() + 60
                    while len([m for m in pool.members() if m.state == "serving"]) != 3:
                        if time.monotonic() > deadline:
                            raise SystemExit("the cluster never had 3 serving members")
                        time.sleep(0.05)
                    if transport == "auto":
                        for start in range(0, pages, 1024):
                            stored = pool.put(ns, keys[start:start + 1024], np.zeros((min(1024, pages - start),
                                                                                      PAGE_BYTES), np.uint8),
                                              parent=keys[start - 1] if start else None)
                            assert stored == min(1024, pages - start), stored
                    while True:   # until both engines' events reached their nodes
                        answer = pool.residency(ns, tokens=tokens, engine_ids=["e1", "e2"])
                        if (answer.engines["e1"].gpu_pages, answer.engines["e2"].gpu_pages) == (pages, pages // 2):
                            break
                        if time.monotonic() > deadline:
                            raise SystemExit(f"the engines' events never arrived: {answer.engines}")
                        time.sleep(0.1)
                    assert answer.pages == pages and len(answer.node_pages()) == 3, answer.node_pages()
                    control = "local socket" if transport == "auto" else "gRPC"
                    report[control] = {
                        "residency by tokens": timed(lambda: pool.residency(ns, tokens=tokens,
                                                                            engine_ids=["e1", "e2"]), args.calls),
                        "residency by keys": timed(lambda: pool.residency(ns, keys=keys, engine_ids=["e1", "e2"]),
                                                   args.calls),
                        "lookup by tokens": timed(lambda: pool.lookup(ns, tokens=tokens), args.calls),
                        "one-page residency": timed(lambda: pool.residency(ns, keys=keys[:1], engine_ids=["e1", "e2"]),
                                                    args.calls),
                        "node pages": answer.node_pages()}
        finally:
            for engine in engines.values():
                engine.close()
            for proc in [*nodes, etcd]:
                proc.send_signal(signal.SIGKILL)
    print(f"{args.tokens} tokens ({pages} pages of {block}), 3 nodes, 2 engines, {os.cpu_count()} CPUs, unpinned")
    for control in ("local socket", "gRPC"):
        print(f"control over {control}: pages per node {report[control]['node pages']}")
        for name, figures in report[control].items():
            if name != "node pages":
                print(f"  {name:22} median {figures['median_ms']:7.2f} ms   p90 {figures['p90_ms']:7.2f}   "
                      f"min {figures['min_ms']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
