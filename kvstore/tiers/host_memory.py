"""What the host and the node's cgroup can give the DRAM arena, checked before the arena is allocated.

Allocating more than that does not fail where it should: `posix_fallocate` of the arena's memfd
goes on until the kernel's OOM killer ends processes, and the first it picks is seldom the node
(on an inference host it is the engine). So start-up compares the arena plus the node's own
memory with the smallest of what is available:

- the host's MemAvailable (/proc/meminfo), or its free huge pages when the arena takes them;
- each cgroup above the node (v2 `memory.max`, v1 `memory.limit_in_bytes`, up to the root) less
  what its tasks use, page cache aside (the kernel reclaims that before it kills);
- RLIMIT_MEMLOCK when the arena is pinned (the RDMA data plane registers it), unless the process
  may lock any amount (root, or CAP_IPC_LOCK).

and refuses with one line that names `dram.arena_bytes`, what is available and what to set.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

# The node's own memory beside the arena: the interpreter, gRPC and its threads, the page index of
# a small node (measured about 110 MiB of RSS before the arena, kvstore_native built).
NODE_OVERHEAD_BYTES = 192 << 20
_CAP_IPC_LOCK = 14


@dataclass(frozen=True)
class Limit:
    what: str          # "MemAvailable", "cgroup /system.slice/kvstore.service memory.max", ...
    bytes: int         # what is left under it for the node


def check_arena(arena_bytes: int, hugepages: bool, pinned: bool, proc: str = "/proc",
                cgroup_root: str = "/sys/fs/cgroup") -> None:
    """Raise OSError (one line) when the host cannot give the arena; return when it can."""
    need = arena_bytes + NODE_OVERHEAD_BYTES
    if hugepages:   # huge pages come from their own pool; only the overhead comes from MemAvailable
        pool = hugepages_free_bytes(proc)
        if arena_bytes > pool:
            advice = f"or set dram.arena_bytes to at most {_size(pool)}" if pool else "or set dram.hugepages = false"
            raise OSError(f"dram.arena_bytes={_size(arena_bytes)} with dram.hugepages = true needs that much in free "
                          f"huge pages and the host has {_size(pool)} (HugePages_Free in {proc}/meminfo): reserve "
                          f"more (vm.nr_hugepages) {advice}")
        need = NODE_OVERHEAD_BYTES
    limits = [Limit("MemAvailable", mem_available_bytes(proc)), *cgroup_limits(proc, cgroup_root)]
    if pinned:
        locked = memlock_bytes()
        if locked is not None:
            limits.append(Limit("RLIMIT_MEMLOCK (the RDMA data plane pins the arena; LimitMEMLOCK= in a unit)",
                                locked + NODE_OVERHEAD_BYTES))
    tightest = min(limits, key=lambda limit: limit.bytes)
    if need > tightest.bytes:
        room = tightest.bytes - NODE_OVERHEAD_BYTES
        advice = f"set dram.arena_bytes to at most {_size(room)}" if room > 0 else "free memory first"
        raise OSError(f"dram.arena_bytes={_size(arena_bytes)} plus {_size(NODE_OVERHEAD_BYTES)} for the node itself "
                      f"is more than this host can give: {tightest.what} leaves {_size(tightest.bytes)}; {advice}")


def mem_available_bytes(proc: str = "/proc") -> int:
    return _meminfo(proc)["MemAvailable"] * 1024


def hugepages_free_bytes(proc: str = "/proc") -> int:
    info = _meminfo(proc)
    return info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0) * 1024


def cgroup_limits(proc: str = "/proc", root: str = "/sys/fs/cgroup") -> list[Limit]:
    """What each memory-limited cgroup above this process leaves (v2, else v1); [] where none limits."""
    limits = []
    for directory, group in _cgroup_directories(proc, root):
        limit = _read_int(directory, "memory.max") or _read_int(directory, "memory.limit_in_bytes")
        if limit is None or limit >= 1 << 60:   # "max", or v1's page-rounded LONG_MAX
            continue
        used = _read_int(directory, "memory.current") or _read_int(directory, "memory.usage_in_bytes") or 0
        stat = _stat(directory)
        cache = (stat.get("active_file", stat.get("total_active_file", 0))
                 + stat.get("inactive_file", stat.get("total_inactive_file", 0)))
        name = "memory.max" if os.path.exists(os.path.join(directory, "memory.max")) else "memory.limit_in_bytes"
        limits.append(Limit(f"cgroup {group} {name} of {_size(limit)}", max(0, limit - max(0, used - cache))))
    return limits


def memlock_bytes() -> int | None:
    """How much the process may pin; None where there is no limit (unlimited, or CAP_IPC_LOCK)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _has_capability(_CAP_IPC_LOCK):
        return None
    return soft


def _cgroup_directories(proc: str, root: str) -> list[tuple[str, str]]:
    """(directory, cgroup path) of this process's memory cgroup and of each one above it, innermost first."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":   # v2: one unified hierarchy
            base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else os.path.join(root, "unified")
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory")
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            directory = os.path.join(base, *parts[:depth])
            if os.path.isdir(directory):
                found.append((directory, "/" + "/".join(parts[:depth])))
    return found


def _has_capability(number: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> number & 1)
    except OSError:
        pass
    return False


def _meminfo(proc: str) -> dict[str, int]:
    info = {}
    with open(os.path.join(proc, "meminfo")) as f:
        for line in f:
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0])
    return info


def _stat(directory: str) -> dict[str, int]:
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            return {name: int(value) for name, value in (line.split() for line in f if line.strip())}
    except (OSError, ValueError):
        return {}


def _read_int(directory: str, name: str) -> int | None:
    try:
        with open(os.path.join(directory, name)) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _size(nbytes: int) -> str:
    """A size as the settings take it, rounded down (what "at most" may quote): 21.5GiB, 512MiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            tenths = nbytes * 10 >> shift
            return f"{tenths // 10}{unit}" if tenths % 10 == 0 else f"{tenths // 10}.{tenths % 10}{unit}"
    return f"{nbytes}B"
