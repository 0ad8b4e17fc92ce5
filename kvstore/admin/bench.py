"""`kvstore bench`: a quick throughput check against a running node.

Puts and gets fresh pages through the node's shared-memory data plane, next to a plain
memcpy of the same pages in the same process, so the answer is a ratio to what this
machine can do right now, not a bare number. It stores pages under its own namespace
(model "kvstore-bench") and deletes them afterwards. For careful measurements use
bench/ in the repository (pinned cores, larger working sets, JSON results).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.proto import pb

BENCH_MODEL = "kvstore-bench"
LOOKUPS = 200


def run(target: str, hello: pb.HelloResponse, pages: int, page_bytes: int, rounds: int,
        timeout_s: float) -> dict[str, Any]:
    namespace = Namespace(model=BENCH_MODEL, page_bytes=page_bytes, tenant="kvstore-bench")
    working_set = pages * page_bytes
    arena_bytes = hello.arena_bytes
    with KVStoreClient(target, timeout_s=timeout_s, client_name="kvstore-bench") as client:
        if working_set > arena_bytes // 2:
            raise errors.InvalidArgument(
                f"{pages} pages of {page_bytes} bytes need {working_set} bytes, over half the arena "
                f"({arena_bytes}); lower --pages or --page-bytes")
        data = np.random.default_rng().integers(0, 256, (pages, page_bytes), dtype=np.uint8)
        out = np.zeros_like(data)
        memcpy_s, put_s, get_s, lookup_s = [], [], [], []
        run_id = f"{os.getpid():x}{time.monotonic_ns():x}"
        for r in range(rounds):
            keys = [f"{run_id}-{r}-{i}" for i in range(pages)]
            started = time.perf_counter()
            np.copyto(out, data)
            memcpy_s.append(time.perf_counter() - started)
            out.fill(0)
            try:
                started = time.perf_counter()
                stored = client.put(namespace, keys, data)
                put_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                loaded = client.get(namespace, keys, out)
                get_s.append(time.perf_counter() - started)
                if stored != pages or loaded != pages or not np.array_equal(out, data):
                    raise errors.Internal(f"round {r}: stored {stored}, loaded {loaded} of {pages} pages, "
                                          "or the loaded bytes differ")
                for _ in range(LOOKUPS // rounds or 1):
                    started = time.perf_counter()
                    client.lookup(namespace, keys)
                    lookup_s.append(time.perf_counter() - started)
            finally:
                client.delete(namespace, keys[:1])  # the first page takes its chain with it
    memcpy_gbs = working_set / min(memcpy_s) / 1e9
    put_gbs = working_set / min(put_s) / 1e9
    get_gbs = working_set / min(get_s) / 1e9
    return {
        "pages": pages, "page_bytes": page_bytes, "rounds": rounds, "working_set_bytes": working_set,
        "memcpy_gbs": memcpy_gbs, "put_gbs": put_gbs, "get_gbs": get_gbs,
        "put_vs_memcpy": put_gbs / memcpy_gbs, "get_vs_memcpy": get_gbs / memcpy_gbs,
        "lookup_us_median": statistics.median(lookup_s) * 1e6,
        "lookup_us_max": max(lookup_s) * 1e6, "lookups": len(lookup_s),
    }
