"""An NVMe shard refuses pages before LMDB's map is full, so a full shard can always evict; pages read
back whole, through the page cache or with O_DIRECT, with the checksum of the bytes that landed."""

import numpy as np
import pytest
import xxhash

from kvstore.tiers import nvme
from kvstore.tiers.nvme import HEADER, NvmeFull, NvmeTier, StoredPage, encode_header, record_key

PAGE = 64 << 10


def test_a_full_shard_still_deletes_and_takes_pages_again(tmp_path):
    tier = NvmeTier((str(tmp_path / "shard"),), map_bytes=4 << 20, io_threads=1)
    page = memoryview(bytes(PAGE))
    written = []
    with pytest.raises(NvmeFull):
        for i in range(1000):
            key = b"k%d" % i
            tier.write(0, [(StoredPage(1, key, b"", PAGE, 0), page)])
            written.append(key)
    assert written, "some pages fit before the shard is full"
    tier.delete([(1, key) for key in written])  # evicting everything at once must not fail
    assert not list(tier.scan())
    tier.write(0, [(StoredPage(1, b"again", b"", PAGE, 0), page)])
    assert [rkey[8:] for rkey, *_ in tier.scan()] == [b"again"]
    tier.close()


@pytest.mark.parametrize("copy", ["native", "python"])
def test_pages_of_every_size_read_back_whole_with_their_checksum(tmp_path, monkeypatch, copy):
    if copy == "python":
        monkeypatch.setattr(nvme.native, "module", None)
    elif nvme.native.module is None:
        pytest.skip("kvstore_native is not built")
    tier = NvmeTier((str(tmp_path / "shard"),), map_bytes=64 << 20, io_threads=4)
    # Below, at and above the O_DIRECT threshold; sizes that end mid-block and mid-page.
    sizes = [4096, nvme.DIRECT_READ_MIN_BYTES - 1, nvme.DIRECT_READ_MIN_BYTES, (1 << 20) + 5, 1 << 20, 3 << 20]
    rng = np.random.default_rng(7)
    pages = {b"k%d" % i: rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    tier.write(0, [(StoredPage(1, key, b"", len(data), 0), memoryview(data)) for key, data in pages.items()])
    direct = tier.shards[0].direct_fd is not None
    outs = {key: np.zeros(len(data), np.uint8) for key, data in pages.items()}
    for _ in range(2):  # the second time, each I/O thread's buffer is reused
        sums = tier.read_into([(1, key, memoryview(out)) for key, out in outs.items()])
        for (key, data), checksum in zip(pages.items(), sums):
            assert np.array_equal(outs[key], data), (len(data), direct)
            assert checksum == xxhash.xxh3_64_intdigest(data)
    # A header that records no place (as shards written before it did): found through LMDB. One
    # that records the wrong place: refused, never read as the page.
    shard = tier.shards[0]
    with shard.env.begin(write=True) as txn:
        rkey = record_key(1, b"k4")
        recorded = HEADER.unpack_from(txn.get(rkey, db=shard.meta))[2]
        assert recorded > 0 or not direct
        txn.put(rkey, encode_header(StoredPage(1, b"k4", b"", 1 << 20, 0)), db=shard.meta)
        txn.put(record_key(1, b"k5"), encode_header(StoredPage(1, b"k5", b"", 3 << 20, 0), recorded), db=shard.meta)
    out = np.zeros(1 << 20, np.uint8)
    assert tier.read_into([(1, b"k4", memoryview(out))]) == [xxhash.xxh3_64_intdigest(pages[b"k4"])]
    assert np.array_equal(out, pages[b"k4"])
    if direct:
        assert tier.read_into([(1, b"k5", memoryview(np.zeros(3 << 20, np.uint8)))]) == [None]
    wrong_size = np.zeros(1 << 20, np.uint8)
    assert tier.read_into([(1, b"absent", memoryview(wrong_size)), (1, b"k4", memoryview(wrong_size[:-1]))]) == [
        None, None]
    tier.close()


class _CommitDuringInfo:
    """A shard's LMDB environment whose info() lets another writer's commit land first: the moment a
    concurrent write-down (the controller, or an RPC thread making room) grows the file."""

    def __init__(self, env, commit):
        self._env, self._commit = env, commit

    def info(self):
        self._commit()
        return self._env.info()

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_a_commit_that_grows_the_file_during_the_size_check_is_not_a_truncation(tmp_path):
    """The check reads the meta page's last page, then the file's size: the file only grows, so a commit
    between the two cannot make a whole shard look cut short (and be quarantined with its pages)."""
    tier = NvmeTier((str(tmp_path / "shard"),), map_bytes=256 << 20, io_threads=1)
    shard, page, written = tier.shards[0], memoryview(bytes(PAGE)), []

    def grow():
        key = b"grown%d" % len(written)
        with shard.env._env.begin(write=True) as txn:
            txn.put(record_key(1, key), bytes(16 * PAGE), db=shard.data)
        written.append(key)

    shard.env = _CommitDuringInfo(shard.env, grow)
    try:
        for i in range(8):
            assert shard.size_fault() == ""
            tier.write(0, [(StoredPage(1, b"k%d" % i, b"", PAGE, 0), page)])
        assert len(written) >= 8 and not tier.quarantined()
    finally:
        shard.env = shard.env._env
        tier.close()
