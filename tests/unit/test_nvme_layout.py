"""Each NVMe path holds the shard count it was laid out with, and a start-up with another count is refused."""

from __future__ import annotations

import pytest

from kvstore.tiers import nvme_layout
from kvstore.tiers.nvme import NvmeTier, StoredPage


def test_a_fresh_path_is_laid_out_and_read_back_the_same(tmp_path):
    paths = (str(tmp_path / "a"), str(tmp_path / "b"))
    shards = nvme_layout.shard_directories(paths, 3)
    assert shards == tuple(f"{p}/shard-{i}" for p in paths for i in range(3))
    assert (tmp_path / "a" / nvme_layout.LAYOUT_FILE).read_text() == "3\n"
    assert nvme_layout.shard_directories(paths, 3) == shards


def test_one_shard_is_the_path_itself(tmp_path):
    assert nvme_layout.shard_directories((str(tmp_path / "a"),), 1) == (str(tmp_path / "a"),)


def test_a_path_written_before_the_layout_record_is_one_shard(tmp_path):
    """A shard from before nvme.shards_per_path: data.mdb in the path, no record."""
    path = str(tmp_path / "old")
    tier = NvmeTier((path,), 4 << 20, io_threads=1)
    tier.write(0, [(StoredPage(1, b"k", b"", 4096, 0), memoryview(bytes(4096)))])
    tier.close()
    assert nvme_layout.shard_directories((path,), 1) == (path,)
    with pytest.raises(OSError, match=rf"NVMe path {path} holds 1 shard and nvme.shards_per_path is 4: "
                                      r"set nvme.shards_per_path = 1, or empty"):
        nvme_layout.shard_directories((path,), 4)


@pytest.mark.parametrize("laid_out, asked", [(4, 2), (2, 4), (4, 1)])
def test_another_count_is_refused_naming_both(tmp_path, laid_out, asked):
    path = str(tmp_path / "p")
    nvme_layout.shard_directories((path,), laid_out)
    with pytest.raises(OSError, match=rf"holds {laid_out} shards and nvme.shards_per_path is {asked}: "
                                      rf"set nvme.shards_per_path = {laid_out}"):
        nvme_layout.shard_directories((path,), asked)


def test_an_unreadable_record_is_refused(tmp_path):
    (tmp_path / nvme_layout.LAYOUT_FILE).write_text("four\n")
    with pytest.raises(OSError, match="is unreadable .*'four"):
        nvme_layout.shard_directories((str(tmp_path),), 4)


def test_a_path_that_cannot_be_made_names_the_setting(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"a-file/p/shards \(nvme.paths\): .*Not a directory"):
        nvme_layout.shard_directories((str(blocker / "p"),), 2)
