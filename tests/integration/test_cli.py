"""The `kvstore` console script against a real node: tables for people, JSON for scripts,
lookups by tokens and keys, deletes, a drain that flips health and lets leases finish, and a
quick bench; bad arguments and unreachable nodes get one clear line and a non-zero exit."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, prefix_hashes
from kvstore_client.proto import pb

KVSTORE = str(Path(sys.executable).with_name("kvstore"))  # the console script pyproject installs
PAGE = 16 * 1024
NS = Namespace(model="cli-model", page_bytes=PAGE, page_tokens=4, tenant="acme")
TOKENS = list(range(100, 140))  # 10 pages of 4 tokens


def kvstore(server, *args, check=True):
    result = subprocess.run([KVSTORE, "--target", server.address, "--timeout", "5", *args],
                            capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def stored(server):
    keys = prefix_hashes(TOKENS, 4)
    with KVStoreClient(server.address) as client:
        assert client.put(NS, keys, np.ones((10, PAGE), np.uint8)) == 10
        assert client.get(NS, keys[:3], np.zeros((3, PAGE), np.uint8)) == 3
    return keys


def test_status_table_and_json(server, stored):
    table = kvstore(server, "status").stdout
    assert "health SERVING" in table and "namespaces 1" in table
    header, dram = table.splitlines()[1:3]
    assert header.split()[:3] == ["TIER", "CAPACITY", "USED"]
    assert dram.split()[:5] == ["dram", "64.0MiB", "160.0KiB", "0.2%", "10"]
    status = json.loads(kvstore(server, "--json", "status").stdout)
    assert status["health"] == "SERVING" and status["pages_committed"] == 10
    [dram] = status["tiers"]
    assert dram | {"tier": "dram", "capacity_bytes": 64 << 20, "used_bytes": 10 * PAGE, "pages": 10, "hits": 3,
                   "misses": 0, "evictions": 0} == dram
    assert {"promotions", "demotions"} <= set(dram), "every TierStats field reaches --json"


def test_namespaces(server, stored):
    rows = json.loads(kvstore(server, "--json", "namespaces").stdout)
    assert rows == [{"namespace_id": rows[0]["namespace_id"], "model": "cli-model", "tenant": "acme",
                     "page_bytes": PAGE, "pages": 10, "bytes": 10 * PAGE}]
    assert rows[0]["namespace_id"] in kvstore(server, "namespaces").stdout


def test_namespaces_pages_through_a_node_holding_more_than_one_stats_answer(start_server):
    server = start_server({"limits.stats_namespaces_max": 3})
    with KVStoreClient(server.address) as client:
        for i in range(7):
            client.lookup(Namespace(model=f"m{i}", page_bytes=PAGE), keys=[b"k"])
    rows = json.loads(kvstore(server, "--json", "namespaces").stdout)
    assert sorted(r["model"] for r in rows) == [f"m{i}" for i in range(7)]
    assert "namespaces 7" in kvstore(server, "status").stdout


def test_scrub_checks_every_page(server, stored):
    answer = json.loads(kvstore(server, "--json", "scrub").stdout)
    assert answer == {"pages_checked": 10, "pages_bad": 0}
    assert json.loads(kvstore(server, "--json", "status").stdout)["scrub_passes"] == 1


def test_lookup_by_tokens_and_by_keys(server, stored):
    longer = ",".join(map(str, TOKENS + [7, 8, 9, 10]))
    answer = json.loads(kvstore(server, "--json", "lookup", "-n", "cli-model", "--tokens", longer).stdout)
    assert answer["hit_pages"] == 10 and answer["tiers"] == ["dram"] * 10
    text = kvstore(server, "lookup", "-n", "cli-model", "--keys", *stored[:4], "not-cached").stdout
    assert text.strip() == "4 leading pages cached for 5 keys (4 in dram)"
    raw = [key.encode().hex() for key in stored[:2]]
    assert json.loads(kvstore(server, "--json", "lookup", "-n", "cli-model", "--hex", "--keys", *raw).stdout)[
        "hit_pages"] == 2


def test_delete_takes_the_extending_pages(server, stored):
    ns_id = json.loads(kvstore(server, "--json", "namespaces").stdout)[0]["namespace_id"]
    answer = json.loads(kvstore(server, "--json", "delete", "-n", ns_id, "--keys", stored[6]).stdout)
    assert answer["deleted_pages"] == 4
    with KVStoreClient(server.address) as client:
        assert client.lookup(NS, stored) == 6


def test_bench_reports_ratios_and_cleans_up(server):
    result = json.loads(kvstore(server, "--json", "bench", "--pages", "16", "--page-bytes", "65536",
                                "--rounds", "2").stdout)
    assert result["pages"] == 16 and result["working_set_bytes"] == 16 * 65536
    for name in ("memcpy_gbs", "put_gbs", "get_gbs", "put_vs_memcpy", "get_vs_memcpy", "lookup_us_median"):
        assert result[name] > 0, name
    bench_ns = [r for r in json.loads(kvstore(server, "--json", "namespaces").stdout) if r["model"] == "kvstore-bench"]
    assert bench_ns and bench_ns[0]["pages"] == 0
    table = kvstore(server, "bench", "--pages", "4", "--page-bytes", "65536", "--rounds", "1").stdout
    assert [line.split()[0] for line in table.splitlines()[2:5]] == ["memcpy", "put", "get"]


def test_drain_flips_health_and_lets_leases_finish(server):
    assert kvstore(server, "health").stdout.strip() == "SERVING"
    with KVStoreClient(server.address, control="grpc") as client:
        ns_id = client._namespace_id(NS)
        lease = client._grpc.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"k"], page_bytes=PAGE))
        drained = json.loads(kvstore(server, "--json", "drain").stdout)
        assert drained == {"pid": server.process.pid, "health": "NOT_SERVING", "stopped": False}
        assert server.process.poll() is None  # the open lease holds the node up
        health = kvstore(server, "health", check=False)
        assert health.returncode == 1 and health.stdout.strip() == "NOT_SERVING"
        client._grpc.call("Commit", pb.CommitRequest(lease_id=lease.lease_id))
    assert server.process.wait(10) == 0


def test_drain_wait_returns_once_the_node_exited(server):
    assert "stopped" in kvstore(server, "drain", "--wait").stdout
    assert server.process.poll() == 0


@pytest.mark.parametrize("args, code, words", [
    (["lookup", "-n", "nope", "--keys", "a"], 2, "namespace 'nope' is not open on this node"),
    (["lookup", "-n", "cli-model"], 2, "--keys or --tokens"),
    (["lookup", "-n", "cli-model", "--tokens", "1,x"], 2, "--tokens takes token ids"),
    (["bench", "--pages", "100000"], 1, "over half the arena"),
])
def test_bad_arguments(server, stored, args, code, words):
    result = kvstore(server, *args, check=False)
    assert result.returncode == code and words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 or code == 2 and "usage:" in result.stderr


def test_unreachable_node():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    result = subprocess.run([KVSTORE, "--target", target, "--timeout", "2", "status"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and result.stderr.startswith("kvstore status: Unavailable")
    health = subprocess.run([KVSTORE, "--target", target, "--timeout", "2", "health"],
                            capture_output=True, text=True, timeout=30)
    assert health.returncode == 1 and health.stdout.startswith("UNKNOWN")
