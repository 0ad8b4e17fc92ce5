"""An NVMe shard is held by one open tier at a time; close() gives it back, and a failed open holds nothing."""

import os

import pytest

from kvstore.tiers.nvme import NvmeTier


def test_a_shard_is_refused_while_held_and_taken_again_after_close(tmp_path):
    shard = str(tmp_path / "shard")
    tier = NvmeTier((shard,), map_bytes=4 << 20, io_threads=1)
    # flock conflicts between two open files even in one process, so this stands in for a second node
    with pytest.raises(OSError, match=f"NVMe shard directory {shard} is in use by another kvstore-server "
                                      rf"\(pid {os.getpid()}\): give this node its own nvme.paths"):
        NvmeTier((shard,), map_bytes=4 << 20, io_threads=1)
    tier.close()
    NvmeTier((shard,), map_bytes=4 << 20, io_threads=1).close()


def test_a_refused_open_gives_back_the_shards_it_had_taken(tmp_path):
    free, held = str(tmp_path / "free"), str(tmp_path / "held")
    holder = NvmeTier((held,), map_bytes=4 << 20, io_threads=1)
    with pytest.raises(OSError, match="in use by another kvstore-server"):
        NvmeTier((free, held), map_bytes=4 << 20, io_threads=1)
    NvmeTier((free,), map_bytes=4 << 20, io_threads=1).close()  # `free` was released on the way out
    holder.close()
