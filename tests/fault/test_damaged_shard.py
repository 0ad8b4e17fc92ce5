"""A damaged NVMe shard costs its pages, never the node: a truncated data.mdb, a broken B-tree page or
zeroed meta pages, found at start-up or mid-run, quarantine the shard (its file renamed aside, said in
Stats, metrics and the log) while every page of the other shards is served byte for byte and the
damaged shard's pages answer as misses."""

import os
import struct

import numpy as np
import pytest
import xxhash
from prometheus_client.parser import text_string_to_metric_families

from kvstore.tiers.nvme import LMDB_META, QUARANTINE_SUFFIX
from kvstore_client import KVStoreClient, Namespace, namespace_id

PAGE = 65536
NS = Namespace(model="damaged-shard", page_bytes=PAGE)
SHARDS = 3
CHAINS, LENGTH = 16, 6
DAMAGED = 1
LMDB_PAGE = 4096


def chain_data(chain):
    return np.stack([np.full(PAGE, (chain * 11 + i) % 256, np.uint8) for i in range(LENGTH)])


def keys_of(chain):
    return [f"d{chain}-{i}" for i in range(LENGTH)]


def shard_of(key):
    return xxhash.xxh3_64_intdigest(key.encode(), seed=namespace_id(NS)) % SHARDS


def leading_kept(chain):
    """Pages of the chain a node without the damaged shard still serves: those before its first page there."""
    shards = [shard_of(k) for k in keys_of(chain)]
    return shards.index(DAMAGED) if DAMAGED in shards else LENGTH


def settings(tmp_path):
    return {"nvme.enabled": "true", "nvme.paths": ",".join(f"{tmp_path}/shard{i}" for i in range(SHARDS)),
            "nvme.map_bytes": "64MiB"}


def data_file(tmp_path):
    return f"{tmp_path}/shard{DAMAGED}/data.mdb"


def scrape(server):
    return [s for family in text_string_to_metric_families(server.metrics_text()) for s in family.samples
            if s.name == "kvstore_nvme_shard_quarantined"]


def written_down(start_server, tmp_path):
    """A node that wrote every chain to NVMe and stopped; returns its settings."""
    assert sum(leading_kept(c) < LENGTH for c in range(CHAINS)) > 0, "some chains must cross the damaged shard"
    first = start_server(settings(tmp_path))
    with KVStoreClient(first.address) as c:
        for chain in range(CHAINS):
            assert c.put(NS, keys_of(chain), chain_data(chain), durable=True) == LENGTH
    assert first.terminate() == 0
    return settings(tmp_path)


def assert_served_without_damaged_shard(server, tmp_path, at_start):
    with KVStoreClient(server.address) as c:
        for chain in range(CHAINS):
            out = np.zeros((LENGTH, PAGE), np.uint8)
            kept = leading_kept(chain)
            assert c.get(NS, keys_of(chain), out, verify=True) == kept, chain
            assert np.array_equal(out[:kept], chain_data(chain)[:kept]), chain
        stats = c.stats()
        [quarantined] = stats.nvme_quarantined
        nvme = next(t for t in stats.tiers if t.tier == 3)
    assert nvme.corrupt_pages == 0   # the damaged shard's pages are misses, not corrupt pages
    assert quarantined.shard == DAMAGED and quarantined.at_start == at_start
    assert quarantined.path == f"{tmp_path}/shard{DAMAGED}"
    assert quarantined.moved_to.startswith(data_file(tmp_path) + QUARANTINE_SUFFIX)
    assert os.path.exists(quarantined.moved_to)   # kept for an operator, not deleted
    assert f"NVMe shard {data_file(tmp_path)} quarantined: " in server.log()
    [sample] = scrape(server)
    assert sample.value == 1 and sample.labels["shard"] == str(DAMAGED)
    assert sample.labels["path"] == quarantined.path
    return quarantined


def main_root(path):
    """The page number of the main B-tree's root, from the newer meta page."""
    with open(path, "rb") as f:
        raw = f.read(2 * LMDB_PAGE)
    newer = max((0, LMDB_PAGE), key=lambda at: LMDB_META.unpack_from(raw, at)[-1])
    return struct.unpack_from("<Q", raw, newer + 128)[0]   # MDB_meta's main DB md_root


@pytest.mark.parametrize("cut", ["64KiB", "1MiB", "half"])
def test_a_truncated_shard_is_quarantined_at_start_up(start_server, tmp_path, cut):
    node_settings = written_down(start_server, tmp_path)
    size = os.path.getsize(data_file(tmp_path))
    new_size = {"64KiB": size - (64 << 10), "1MiB": size - (1 << 20), "half": size // 2}[cut]
    assert new_size > 0
    os.truncate(data_file(tmp_path), new_size)
    server = start_server(node_settings)
    quarantined = assert_served_without_damaged_shard(server, tmp_path, at_start=True)
    assert "truncated" in quarantined.cause
    assert os.path.getsize(quarantined.moved_to) == new_size


@pytest.mark.parametrize("page", ["main root", "every other B-tree page"])
def test_a_damaged_index_page_is_quarantined_at_start_up(start_server, tmp_path, page):
    node_settings = written_down(start_server, tmp_path)
    root = main_root(data_file(tmp_path))
    with open(data_file(tmp_path), "r+b") as f:
        raw = f.read()
        targets = [root] if page == "main root" else [
            n for n in range(2, len(raw) // LMDB_PAGE) if n != root
            and struct.unpack_from("<H", raw, n * LMDB_PAGE + 10)[0] & 0x03]   # P_BRANCH | P_LEAF
        assert targets
        for n in targets:
            f.seek(n * LMDB_PAGE)
            f.write(b"\xff" * 16)   # the page header: number, flags, bounds
    server = start_server(node_settings)
    quarantined = assert_served_without_damaged_shard(server, tmp_path, at_start=True)
    assert "LMDB" in quarantined.cause


def test_a_zeroed_header_is_quarantined_at_start_up(start_server, tmp_path):
    node_settings = written_down(start_server, tmp_path)
    with open(data_file(tmp_path), "r+b") as f:
        f.write(bytes(2 * LMDB_PAGE))   # both meta pages
    server = start_server(node_settings)
    quarantined = assert_served_without_damaged_shard(server, tmp_path, at_start=True)
    assert "meta page" in quarantined.cause


def test_a_shard_cut_short_while_the_node_runs_is_quarantined_on_the_next_get(start_server, tmp_path):
    node_settings = written_down(start_server, tmp_path)
    server = start_server(node_settings)   # the pages are on NVMe only now
    os.truncate(data_file(tmp_path), os.path.getsize(data_file(tmp_path)) // 2)
    assert_served_without_damaged_shard(server, tmp_path, at_start=False)
    assert server.process.poll() is None
    assert server.terminate() == 0
    # The next start-up opens a fresh shard in its place and serves what the others hold.
    again = start_server(node_settings)
    with KVStoreClient(again.address) as c:
        assert not c.stats().nvme_quarantined
        for chain in range(CHAINS):
            out = np.zeros((LENGTH, PAGE), np.uint8)
            kept = leading_kept(chain)
            assert c.get(NS, keys_of(chain), out, verify=True) == kept
            assert np.array_equal(out[:kept], chain_data(chain)[:kept])
