"""A client SIGKILLed mid-put never makes a page visible, and its slots come back to the pool."""

import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace

PAGE = 65536
NS = Namespace(model="fault", page_bytes=PAGE)

WRITER = textwrap.dedent("""
    import sys, numpy as np
    from kvstore_client import KVStoreClient, Namespace
    ns = Namespace(model="fault", page_bytes=65536)
    with KVStoreClient(sys.argv[1], transport=sys.argv[3]) as c:
        for chain in range(40):
            keys = [f"w{sys.argv[2]}-{chain}-{i}" for i in range(32)]
            data = np.stack([np.full(65536, (chain * 32 + i) % 251, np.uint8) for i in range(32)])
            c.put(ns, keys, data)
            print(chain, flush=True)
    import time; time.sleep(600)
""")

HOLDER = textwrap.dedent("""
    import sys
    from kvstore_client import KVStoreClient, Namespace
    from kvstore_client.proto import pb
    ns = Namespace(model="fault", page_bytes=65536)
    c = KVStoreClient(sys.argv[1], control=sys.argv[2], transport=sys.argv[4])
    ns_id = c._namespace_id(ns)
    r = c._control.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"held%d" % i for i in range(8)],
                                                     page_bytes=65536, lease_ttl_ms=int(sys.argv[3])))
    if sys.argv[4] == "shm":
        for offset in list(r.offsets)[:4]:
            c._arena.view[offset:offset + 65536] = b"\\x01" * 65536   # half the pages written, none committed
    print("reserved", flush=True)
    import time; time.sleep(600)
""")


def spawn(script, *args):
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)


def expected(chain, i):
    return (chain * 32 + i) % 251


@pytest.mark.parametrize("control, ttl_ms, transport", [("local", 60_000, "shm"), ("grpc", 500, "shm"),
                                                        ("local", 60_000, "tcp")])
def test_killed_between_copy_and_commit(start_server, control, ttl_ms, transport):
    server = start_server({"leases.reap_interval_ms": 20})
    holder = spawn(HOLDER, server.address, control, str(ttl_ms), transport)
    assert holder.stdout.readline().strip() == "reserved"
    with KVStoreClient(server.address) as c:
        assert c.stats().tiers[0].used_bytes == 8 * PAGE
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        # leases of the local channel and of a TCP call connection end with the connection; gRPC ones at their TTL
        deadline = time.monotonic() + 10
        while c.stats().leases_open and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = c.stats()
        assert stats.leases_open == 0
        assert stats.tiers[0].used_bytes == 0 and stats.tiers[0].pages == 0
        assert c.lookup(NS, [f"held{i}" for i in range(8)]) == 0
        assert c.put(NS, ["after"], np.zeros((1, PAGE), np.uint8)) == 1


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_writers_killed_at_random_points_leave_only_whole_pages(start_server, transport):
    server = start_server({"dram.arena_bytes": "512MiB", "dram.slab_bytes": "8MiB"})  # no eviction here
    rng = random.Random(7)
    for run in range(6):
        writer = spawn(WRITER, server.address, str(run), transport)
        writer.stdout.readline()  # at least one chain is in
        time.sleep(rng.uniform(0.0, 0.2))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    with KVStoreClient(server.address) as c:
        deadline = time.monotonic() + 10
        while c.stats().leases_open and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = c.stats()
        assert stats.leases_open == 0
        assert stats.tiers[0].used_bytes == stats.tiers[0].pages * PAGE
        seen = 0
        out = np.zeros((32, PAGE), np.uint8)
        for run in range(6):
            for chain in range(40):
                keys = [f"w{run}-{chain}-{i}" for i in range(32)]
                loaded = c.get(NS, keys, out, verify=True)
                seen += loaded
                for i in range(loaded):
                    assert (out[i] == expected(chain, i)).all(), f"page {keys[i]} is torn"
        assert seen == stats.tiers[0].pages
