"""The Prometheus endpoint of a real node, scraped over HTTP: tier, namespace, lease, RPC and
data-plane metrics are there and move with real traffic over both carriers."""

import json
import logging
import socket
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.proto import pb

PAGE = 64 * 1024
NS = Namespace(model="metrics-model", page_bytes=PAGE, tenant="tests")   # private_server's tenant


def scrape(server) -> dict[tuple[str, frozenset], float]:
    text = server.metrics_text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_move_with_real_traffic(private_server, caplog):
    server = private_server
    caplog.set_level(logging.INFO, logger="kvstore_client")   # a call made again on a new connection shows in a failure
    before = scrape(server)
    assert value(before, "kvstore_tier_capacity_bytes", tier="dram") == 64 << 20
    assert value(before, "kvstore_tier_pages", tier="dram") == 0
    assert value(before, "kvstore_build_info", version="0.1.0") == 1
    pages = np.random.default_rng(1).integers(0, 256, (8, PAGE), dtype=np.uint8)
    keys = [f"m{i}" for i in range(8)]
    with KVStoreClient(server.address, token=server.token) as local:
        assert local.put(NS, keys, pages) == 8
        assert local.get(NS, keys, np.zeros_like(pages)) == 8
        assert local.get(NS, ["missing"], np.zeros((1, PAGE), np.uint8)) == 0
    with KVStoreClient(server.address, control="grpc", token=server.token) as remote:
        assert remote.get(NS, keys[:4], np.zeros((4, PAGE), np.uint8)) == 4
    after = scrape(server)
    ns_labels = {"model": "metrics-model", "tenant": "tests", "namespace_id": _ns_id(after)}
    assert value(after, "kvstore_tier_pages", tier="dram") == 8
    assert value(after, "kvstore_tier_used_bytes", tier="dram") == 8 * PAGE
    assert value(after, "kvstore_tier_hits_total", tier="dram") == 12
    assert value(after, "kvstore_tier_misses_total", tier="dram") == 1
    assert value(after, "kvstore_namespace_pages", **ns_labels) == 8
    assert value(after, "kvstore_namespace_bytes", **ns_labels) == 8 * PAGE
    assert value(after, "kvstore_pages_committed_total") == 8
    assert value(after, "kvstore_dataplane_bytes_total", transport="shm", direction="write") == 8 * PAGE
    assert value(after, "kvstore_dataplane_bytes_total", transport="shm", direction="read") == 12 * PAGE
    assert value(after, "kvstore_rpc_duration_seconds_count", method="Reserve", carrier="local") >= 1
    assert value(after, "kvstore_rpc_duration_seconds_count", method="Commit", carrier="local") >= 1
    calls = _calls_and_errors(after)   # named in a failure: which call was extra, and what it was refused with
    assert value(after, "kvstore_rpc_duration_seconds_count", method="Acquire", carrier="local") == 2, \
        _why(calls, server)
    assert value(after, "kvstore_rpc_duration_seconds_count", method="Acquire", carrier="grpc") == 1, \
        _why(calls, server)
    assert value(after, "kvstore_rpc_duration_seconds_count", method="Hello", carrier="grpc") == 2, \
        _why(calls, server)
    reserve_local = {"method": "Reserve", "carrier": "local"}
    assert value(after, "kvstore_rpc_duration_seconds_bucket", le="+Inf", **reserve_local) == \
        value(after, "kvstore_rpc_duration_seconds_count", **reserve_local)
    assert value(after, "kvstore_rpc_duration_seconds_sum", **reserve_local) > 0
    assert value(after, "process_resident_memory_bytes") > 0


def _why(calls: dict, server) -> str:
    """A counting assertion's message: every call and error counted, and who is connected to the node. A str,
    which pytest prints whole (it cuts any other message to one short line)."""
    return f"calls and errors counted: {calls}; connected to the node now: {server.connected()}"


def _calls_and_errors(samples) -> dict:
    return {(name, *sorted(dict(labels).items())): v for (name, labels), v in samples.items()
            if name in ("kvstore_rpc_duration_seconds_count", "kvstore_rpc_errors_total")}


def _ns_id(samples):
    ids = {dict(labels)["namespace_id"] for name, labels in samples if name == "kvstore_namespace_pages"}
    assert len(ids) == 1
    return ids.pop()


def test_a_node_keeps_its_metrics_its_own_where_the_environment_names_a_multiprocess_dir(start_server, tmp_path):
    """LMCache sets PROMETHEUS_MULTIPROC_DIR in its process, so a node an engine starts inherits it: the node must not
    keep its counts in that directory's per-pid files, where they would add to an earlier process's of its pid."""
    shared = tmp_path / "engine-prometheus"
    shared.mkdir()
    server = start_server(env={"PROMETHEUS_MULTIPROC_DIR": str(shared)})
    with KVStoreClient(server.address) as client:
        assert client.put(Namespace(model="multiproc", page_bytes=PAGE), ["a", "b"], np.ones((2, PAGE), np.uint8)) == 2
    samples = scrape(server)
    assert value(samples, "kvstore_rpc_duration_seconds_count", method="Reserve", carrier="local") == 1
    assert value(samples, "kvstore_rpc_duration_seconds_count", method="Commit", carrier="local") == 1
    assert list(shared.iterdir()) == []
    assert "PROMETHEUS_MULTIPROC_DIR is set" in server.log()


def test_errors_evictions_and_expired_leases_are_counted(start_server):
    server = start_server({"dram.arena_bytes": "8MiB", "leases.reap_interval_ms": 10})
    big = Namespace(model="evict", page_bytes=1 << 20)
    with KVStoreClient(server.address) as client:
        for round_ in range(3):  # 3 x 6 MiB through an 8 MiB arena
            keys = [f"r{round_}-{i}" for i in range(6)]
            assert client.put(big, keys, np.ones((6, 1 << 20), np.uint8)) == 6
        with pytest.raises(errors.NamespaceNotFound):
            client._local.call("Acquire", pb.AcquireRequest(namespace_id=12345, keys=[b"k"]))
        ns_id = client._namespace_id(big)
        client._local.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"late"], page_bytes=1 << 20,
                                                        lease_ttl_ms=50))
        deadline = time.monotonic() + 10
        while value(scrape(server), "kvstore_leases_expired_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    samples = scrape(server)
    assert value(samples, "kvstore_leases_expired_total") == 1
    assert value(samples, "kvstore_leases_open") == 0
    assert value(samples, "kvstore_tier_evictions_total", tier="dram") >= 10
    assert value(samples, "kvstore_rpc_errors_total", method="Acquire", carrier="local",
                 error="NamespaceNotFound") == 1


def test_metrics_can_be_turned_off(start_server):
    server = start_server({"ops.metrics_address": ""})
    assert json.loads(server.ready_file.read_text())["metrics_port"] == 0
    with KVStoreClient(server.address) as client:
        assert client.put(NS, ["a"], np.zeros((1, PAGE), np.uint8)) == 1


def test_metrics_port_in_use_stops_start_up(start_server):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=r"exited with 1") as info:
            start_server({"ops.metrics_address": f"127.0.0.1:{port}"})
    finally:
        taken.close()
    assert f"cannot bind metrics to 127.0.0.1:{port} (ops.metrics_address): Address already in use" in str(info.value)


def test_nvme_tier_moves_are_exported_per_tier(start_server, tmp_path):
    server = start_server({"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/shard0", "nvme.map_bytes": "256MiB",
                           "dram.arena_bytes": "8MiB"})
    big = Namespace(model="tiers", page_bytes=1 << 20)
    chains = [[f"c{chain}-{i}" for i in range(6)] for chain in range(3)]
    with KVStoreClient(server.address) as client:
        for written, keys in enumerate(chains, 1):  # 18 MiB through an 8 MiB arena: the first chain goes down
            assert client.put(big, keys, np.ones((6, 1 << 20), np.uint8)) == 6
            deadline = time.monotonic() + 20  # write-through runs in the background
            while value(scrape(server), "kvstore_tier_pages", tier="nvme") < 6 * written:
                assert time.monotonic() < deadline, "pages never reached the NVMe tier"
                time.sleep(0.05)
        assert client.get(big, chains[0], np.zeros((6, 1 << 20), np.uint8)) == 6  # promoted back up
    samples = scrape(server)
    assert value(samples, "kvstore_tier_demotions_total", tier="dram") == 18
    assert value(samples, "kvstore_tier_promotions_total", tier="dram") >= 1
    assert value(samples, "kvstore_tier_bytes_in_total", tier="nvme") == 18 << 20
    assert value(samples, "kvstore_tier_evictions_total", tier="dram") >= 10
    assert value(samples, "kvstore_tier_capacity_bytes", tier="nvme") == 256 << 20
