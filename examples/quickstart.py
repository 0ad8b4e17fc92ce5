"""Quick start: run a kvstore node on the embedded default, store a prompt's KV pages, load them back.

    python examples/quickstart.py

Starts `kvstore-server` on the embedded default (DRAM tier + LMDB shards, here in a temp
dir; gRPC on a free loopback port, its Unix socket beside it), then acts as an engine would: hashes a long prompt into page keys, stores each page's
KV bytes, asks how much of a follow-up prompt is cached, loads those pages back and checks
them. Prints hits and GB/s, then stops the node with SIGTERM.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvstore_client import KVStoreClient, Namespace, prefix_hashes

# A Llama-3-8B-shaped page: 32 layers x (K, V) x 8 KV heads x 128 dims x 16 tokens, bf16.
LAYERS, KV_HEADS, HEAD_DIM, PAGE_TOKENS = 32, 8, 128, 16
PAGE_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * PAGE_TOKENS * 2


def host_pool(pages: int) -> np.ndarray:
    """Page-aligned and already in memory, as an engine's pinned host KV pool is."""
    pool = np.frombuffer(mmap.mmap(-1, pages * PAGE_BYTES), dtype=np.uint8).reshape(pages, PAGE_BYTES)
    pool.fill(0)
    return pool


def start_node(workdir: str, *settings: str) -> tuple[subprocess.Popen, str]:
    """A node on loopback (each of `settings`, "section.key=value", set on its command line)."""
    ready = os.path.join(workdir, "ready.json")
    extra = [arg for setting in settings for arg in ("--set", setting)]
    node = subprocess.Popen([sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
                             "--shm-socket", os.path.join(workdir, "kvstore.sock"), "--ready-file", ready,
                             "--arena-bytes", "1GiB", "--set", "server.log_level=WARNING",
                             "--set", f"nvme.paths={os.path.join(workdir, 'nvme-0')}",
                             "--set", "ops.metrics_address=127.0.0.1:0", *extra])
    while not os.path.exists(ready):
        if node.poll() is not None:
            raise SystemExit("kvstore-server failed to start")
        time.sleep(0.05)
    with open(ready) as f:
        return node, json.load(f)["grpc_address"]


def main() -> None:
    rng = np.random.default_rng(0)
    system_prompt = rng.integers(0, 128_000, 4096).tolist()          # 256 pages, shared by every chat
    question = rng.integers(0, 128_000, 200).tolist()
    namespace = Namespace(model="meta-llama/Meta-Llama-3-8B", page_bytes=PAGE_BYTES, page_tokens=PAGE_TOKENS,
                          kv_dtype="bfloat16", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          layout="page_first")
    with tempfile.TemporaryDirectory(prefix="kvstore-quickstart-") as workdir:
        node, address = start_node(workdir)
        try:
            with KVStoreClient(address) as client:
                keys = prefix_hashes(system_prompt, PAGE_TOKENS)
                kv = host_pool(len(keys))
                kv[:] = rng.integers(0, 256, kv.shape, dtype=np.uint8)  # the prefill's KV pages
                started = time.perf_counter()
                stored = client.put(namespace, keys, kv)
                put_s = time.perf_counter() - started

                follow_up = system_prompt + question
                hits = client.lookup(namespace, tokens=follow_up)
                wanted = prefix_hashes(follow_up, PAGE_TOKENS)
                loaded_kv = host_pool(len(wanted))
                started = time.perf_counter()
                loaded = client.get(namespace, wanted, loaded_kv)
                get_s = time.perf_counter() - started
                assert np.array_equal(loaded_kv[:loaded], kv[:loaded]), "loaded pages differ from stored ones"

                page_mib = PAGE_BYTES / 2**20
                sys.stdout.write(
                    f"stored   {stored} pages x {page_mib:.0f} MiB of a {len(system_prompt)}-token prompt "
                    f"at {stored * PAGE_BYTES / put_s / 1e9:.1f} GB/s\n"
                    f"lookup   follow-up prompt of {len(follow_up)} tokens: {hits} of {len(wanted)} pages cached "
                    f"({hits * PAGE_TOKENS} tokens need no prefill)\n"
                    f"loaded   {loaded} pages at {loaded * PAGE_BYTES / get_s / 1e9:.1f} GB/s, byte-identical\n")
                stats = client.stats().tiers[0]
                sys.stdout.write(f"node     DRAM {stats.used_bytes / 2**20:.0f} of {stats.capacity_bytes / 2**20:.0f} MiB "
                                 f"used, {stats.hits} page hits, {stats.misses} misses\n")
        finally:
            node.send_signal(signal.SIGTERM)
            node.wait(30)


if __name__ == "__main__":
    main()
