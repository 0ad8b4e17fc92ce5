"""The server SIGKILLed at random points while it writes pages down and promotes them, 50 times:
after each restart every page served matches its checksum and its bytes, and every chain is a prefix."""

import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from kvstore_client import KVStoreClient, Namespace

PAGE = 16384
LENGTH = 4
RUNS = 50
NS = Namespace(model="crash", page_bytes=PAGE)

WORKLOAD = textwrap.dedent("""
    import random, sys, numpy as np
    from kvstore_client import KVStoreClient, Namespace
    ns = Namespace(model="crash", page_bytes=16384)
    run, rng = int(sys.argv[2]), random.Random(int(sys.argv[2]))
    def data(chain):
        return np.stack([np.full(16384, (chain * 5 + i) % 256, np.uint8) for i in range(4)])
    with KVStoreClient(sys.argv[1]) as c:
        for j in range(1000):
            chain = run * 1000 + j
            c.put(ns, [f"k{chain}-{i}" for i in range(4)], data(chain))
            if j == 0:
                print("stored", flush=True)   # the kill comes after this, however slow the start
            old = rng.randrange(0, chain + 1)   # reads of older chains: promotions from NVMe
            c.get(ns, [f"k{old}-{i}" for i in range(4)], np.zeros((4, 16384), np.uint8), verify=True)
""")


def expected(chain):
    return np.stack([np.full(PAGE, (chain * 5 + i) % 256, np.uint8) for i in range(LENGTH)])


def check(client, chains):
    out = np.zeros((LENGTH, PAGE), np.uint8)
    served = 0
    for chain in chains:
        keys = [f"k{chain}-{i}" for i in range(LENGTH)]
        present = [client.lookup(NS, [k]) for k in keys]
        assert present == sorted(present, reverse=True), f"chain {chain} is not a prefix: {present}"
        loaded = client.get(NS, keys, out, verify=True)
        assert np.array_equal(out[:loaded], expected(chain)[:loaded]), f"chain {chain} served wrong bytes"
        served += loaded
    return served


def test_sigkill_during_write_back_and_promotion(start_server, tmp_path):
    settings = {"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/s0,{tmp_path}/s1", "nvme.map_bytes": "64MiB",
                "controller.write_policy": "write_back", "controller.high_watermark": 0.5,
                "dram.arena_bytes": "2MiB", "dram.slab_bytes": "256KiB"}
    rng = random.Random(2026)
    written: list[int] = []
    served_total = 0
    for run in range(RUNS):
        server = start_server(settings)
        with KVStoreClient(server.address) as client:
            recent = [c for c in written if c // 1000 == run - 1]
            older = rng.sample(written, min(10, len(written)))
            served_total += check(client, recent + older)
        worker = subprocess.Popen([sys.executable, "-c", WORKLOAD, server.address, str(run)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        worker.stdout.readline()   # its first put is in (or it died: then the node is killed at once)
        time.sleep(rng.uniform(0.1, 0.6))
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        worker.kill()
        worker.wait()
        worker.stdout.close()
        written += [run * 1000 + j for j in range(200)]
        server.kill()
    final = start_server(settings)
    with KVStoreClient(final.address) as client:
        served_total += check(client, [c for c in written if c // 1000 == RUNS - 1])
        assert client.stats().recovered_pages > 0
    assert served_total > 0, "no page ever survived a crash: the test would prove nothing"
