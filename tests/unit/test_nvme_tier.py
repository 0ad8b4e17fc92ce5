"""An NVMe shard refuses pages before LMDB's map is full, so a full shard can always evict."""

import pytest

from kvstore.tiers.nvme import NvmeFull, NvmeTier, StoredPage

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
