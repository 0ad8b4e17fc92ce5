"""The arena check reads MemAvailable, free huge pages and every memory cgroup above the node (v1 and v2) as the kernel counts them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore import config
from kvstore.tiers import host_memory

GiB, MiB = 1 << 30, 1 << 20


def fake_host(tmp_path: Path, available_kib: int, cgroup_line: str, files: dict[str, str],
              hugepages_free: int = 0) -> tuple[str, str]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n"
                                  f"HugePages_Free: {hugepages_free}\nHugepagesize: 2048 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(proc), str(root)


def test_mem_available_limits_the_arena(tmp_path):
    proc, root = fake_host(tmp_path, 4 * GiB // 1024, "0::/", {"cgroup.controllers": "memory"})
    host_memory.check_arena(3 * GiB, False, False, proc, root)
    with pytest.raises(OSError, match=r"dram.arena_bytes=4GiB .* MemAvailable leaves 4GiB; "
                                      r"set dram.arena_bytes to at most 3.8GiB"):
        host_memory.check_arena(4 * GiB, False, False, proc, root)


def test_a_v2_cgroup_limit_counts_its_usage_but_not_its_page_cache(tmp_path):
    proc, root = fake_host(tmp_path, 64 * GiB // 1024, "0::/system.slice/kvstore.service", {
        "cgroup.controllers": "memory",
        "system.slice/kvstore.service/memory.max": str(2 * GiB),
        "system.slice/kvstore.service/memory.current": str(GiB),
        "system.slice/kvstore.service/memory.stat": f"anon 1\nactive_file {512 * MiB}\ninactive_file {256 * MiB}\n",
        "system.slice/memory.max": "max",
    })
    [limit] = host_memory.cgroup_limits(proc, root)
    assert limit.bytes == 2 * GiB - (GiB - 768 * MiB)
    assert limit.what == "cgroup /system.slice/kvstore.service memory.max of 2GiB"
    with pytest.raises(OSError, match="cgroup /system.slice/kvstore.service memory.max of 2GiB leaves 1.7GiB"):
        host_memory.check_arena(2 * GiB, False, False, proc, root)


def test_a_v1_parent_cgroup_can_be_the_tightest(tmp_path):
    proc, root = fake_host(tmp_path, 64 * GiB // 1024, "4:memory:/pods/node", {
        "memory/pods/memory.limit_in_bytes": str(GiB),
        "memory/pods/memory.usage_in_bytes": "0",
        "memory/pods/node/memory.limit_in_bytes": "9223372036854771712",   # v1's "no limit"
        "memory/memory.limit_in_bytes": "9223372036854771712",
    })
    assert [limit.what for limit in host_memory.cgroup_limits(proc, root)] == ["cgroup /pods memory.limit_in_bytes of 1GiB"]
    with pytest.raises(OSError, match="cgroup /pods memory.limit_in_bytes of 1GiB leaves 1GiB"):
        host_memory.check_arena(GiB, False, False, proc, root)


def test_huge_pages_come_from_their_own_pool(tmp_path):
    proc, root = fake_host(tmp_path, GiB // 1024, "0::/", {"cgroup.controllers": "memory"}, hugepages_free=1024)
    host_memory.check_arena(2 * GiB, True, False, proc, root)      # 2 GiB of huge pages, MemAvailable only for the node
    with pytest.raises(OSError, match=r"dram.hugepages = true .* has 2GiB \(HugePages_Free"):
        host_memory.check_arena(4 * GiB, True, False, proc, root)


@pytest.mark.parametrize("nbytes, text", [(3 * GiB + 900 * MiB, "3.8GiB"), (512 * MiB, "512MiB"), (5 << 40, "5TiB"),
                                          (1023, "1023B")])
def test_sizes_round_down_in_the_form_settings_take(nbytes, text):
    assert host_memory._size(nbytes) == text


@pytest.mark.parametrize("available", [4 * GiB, 22 * GiB + 100 * MiB, 22 * GiB + 300 * MiB, 700 * MiB, 5 << 40])
def test_the_largest_arena_a_refusal_names_reads_as_a_setting_and_passes(tmp_path, available):
    proc, root = fake_host(tmp_path, available // 1024, "0::/", {"cgroup.controllers": "memory"})
    with pytest.raises(OSError, match="at most") as refused:
        host_memory.check_arena(available + GiB, False, False, proc, root)
    advised = str(refused.value).rsplit("at most ", 1)[1]
    arena_bytes = config.load(environ={}, overrides=[f"dram.arena_bytes={advised}"]).dram.arena_bytes
    host_memory.check_arena(arena_bytes, False, False, proc, root)
    assert arena_bytes > available - host_memory.NODE_OVERHEAD_BYTES - available // 50    # rounded down by little
