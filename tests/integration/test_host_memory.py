"""A node refuses an arena the host or its cgroup cannot give, before allocating any of it, in one line naming dram.arena_bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvstore import config
from kvstore.tiers import host_memory

GiB = 1 << 30


def run_server(tmp_path: Path, *settings: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    # dram.prefault = false: were the check missing, the node would start rather than exhaust the host
    command = [*prefix, sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
               "--shm-socket", str(tmp_path / "kvstore.sock"), "--ready-file", str(tmp_path / "ready.json"),
               "--set", "nvme.enabled=false", "--set", "dram.prefault=false", "--set", "dram.slab_bytes=4MiB",
               "--set", "server.drain_timeout_s=0", *(f"--set={s}" for s in settings)]
    return subprocess.run(["timeout", "--preserve-status", "-s", "TERM", "20", *command],
                          capture_output=True, text=True, timeout=60)


def refusal(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert "dram.arena_bytes" in errors[0] and "set dram.arena_bytes to at most" in errors[0], errors[0]
    return errors[0]


def test_an_arena_above_mem_available_is_refused(tmp_path):
    available = host_memory.mem_available_bytes()
    line = refusal(run_server(tmp_path, f"dram.arena_bytes={available + GiB}"))
    assert "MemAvailable leaves" in line
    assert not (tmp_path / "ready.json").exists()


def test_the_largest_arena_it_names_reads_as_a_setting(tmp_path):
    """What the refusal says to set, the settings read. That the check then lets it through is test_arena_check's,
    on a host whose MemAvailable holds still: here it moves by hundreds of MiB between two starts."""
    available = host_memory.mem_available_bytes()
    line = refusal(run_server(tmp_path, f"dram.arena_bytes={available + GiB}"))
    advised = line.rsplit("at most ", 1)[1].split()[0]
    arena_bytes = config.load(environ={}, overrides=[f"dram.arena_bytes={advised}"]).dram.arena_bytes
    assert GiB < arena_bytes < available + GiB, (advised, available)


def test_an_arena_without_free_huge_pages_names_both_settings(tmp_path):
    if host_memory.hugepages_free_bytes() >= 64 << 20:
        pytest.skip("this host has free huge pages")
    result = run_server(tmp_path, "dram.arena_bytes=64MiB", "dram.hugepages=true")
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert "dram.hugepages" in errors[0] and "HugePages_Free" in errors[0] and "dram.arena_bytes" in errors[0]


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A new memory cgroup with a limit (v2 where the memory controller is there, else v1); None where not allowed."""
    name = f"kvstore-test-{uuid.uuid4().hex[:8]}"
    for base, limit_file in ((Path("/sys/fs/cgroup"), "memory.max"), (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")):
        if base == Path("/sys/fs/cgroup") and "memory" not in _read(base / "cgroup.subtree_control"):
            continue
        if not (base / "cgroup.procs").exists():
            continue
        group = base / name
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit_bytes))
        except OSError:
            if group.exists():
                group.rmdir()
            continue
        return group
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.fixture
def cgroup_of_512_mib():
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    group = _memory_cgroup(512 << 20)
    if group is None:
        pytest.skip("no writable memory cgroup hierarchy here")
    yield group
    group.rmdir()


def in_cgroup(group: Path) -> tuple[str, ...]:
    """A command prefix that runs the rest inside `group`."""
    return ("sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh")


def test_an_arena_above_the_cgroup_limit_is_refused(tmp_path, cgroup_of_512_mib):
    line = refusal(run_server(tmp_path, "dram.arena_bytes=1GiB", prefix=in_cgroup(cgroup_of_512_mib)))
    assert f"cgroup /{cgroup_of_512_mib.name}" in line and "of 512MiB" in line


def test_an_arena_within_the_cgroup_limit_serves(tmp_path, cgroup_of_512_mib):
    result = run_server(tmp_path, "dram.arena_bytes=128MiB", "dram.prefault=true", prefix=in_cgroup(cgroup_of_512_mib))
    assert (tmp_path / "ready.json").exists(), result.stderr
    assert " ERROR " not in result.stderr


def test_a_pinned_arena_above_rlimit_memlock_is_refused(tmp_path):
    """With the RDMA data plane the arena is pinned: RLIMIT_MEMLOCK must hold it (CAP_IPC_LOCK dropped here)."""
    prefix = ("prlimit", "--memlock=1048576:")   # a soft limit of 1 MiB: lowering it needs no privilege
    if os.geteuid() == 0:
        prefix = ("setpriv", "--bounding-set", "-ipc_lock", *prefix)
    line = refusal(run_server(tmp_path, "dram.arena_bytes=256MiB", "rdma.enabled=true", prefix=prefix))
    assert "RLIMIT_MEMLOCK" in line and "LimitMEMLOCK=" in line
