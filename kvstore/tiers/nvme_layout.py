"""How each NVMe path is divided into shards (nvme.shards_per_path).

A disk commits several LMDB transactions in flight in less time than it takes for the same
transactions one after another: its queue takes their syncs together. One LMDB environment has
one writer at a time, so a path holds several shards, and write-down writes them at once
(controller.py). With one shard the path is the shard's directory (the layout of every path
before this setting); with N, its shards are path/shard-0 .. path/shard-<N-1>.

Keys hash to a shard by the node's total count, so a path laid out for one count cannot be read
with another: its pages would be looked for in the wrong shards, and a Delete would miss them,
to come back at the next start-up. The count is recorded in the path (LAYOUT_FILE, written and
synced before any shard is made) and a start-up with another count is refused, naming both.
"""

from __future__ import annotations

import os

from kvstore.tiers.nvme import DATA_FILE

LAYOUT_FILE = "shards"


def shard_directories(paths: tuple[str, ...], per_path: int) -> tuple[str, ...]:
    """The shard directories of `paths`, each path's in order, each path's count checked or recorded."""
    return tuple(directory for path in paths for directory in _path_shards(path, per_path))


def _path_shards(path: str, per_path: int) -> list[str]:
    laid_out = _laid_out(path)
    if laid_out is None:
        _record(path, per_path)
    elif laid_out != per_path:
        raise OSError(f"NVMe path {path} holds {laid_out} shard{'s' if laid_out > 1 else ''} and nvme.shards_per_path "
                      f"is {per_path}: set nvme.shards_per_path = {laid_out}, or empty {path} to lay it out again "
                      f"(its pages are a cache; they are lost)")
    return [path] if per_path == 1 else [os.path.join(path, f"shard-{i}") for i in range(per_path)]


def _laid_out(path: str) -> int | None:
    """The path's recorded shard count; 1 for a shard from before the record (data.mdb in the path itself);
    None for a path that holds no shard yet."""
    record = os.path.join(path, LAYOUT_FILE)
    try:
        with open(record) as f:
            text = f.read()
    except FileNotFoundError:
        return 1 if os.path.exists(os.path.join(path, DATA_FILE)) else None
    except OSError as exc:
        raise OSError(f"cannot read NVMe path layout {record} (nvme.paths): {exc}") from None
    if not text.strip().isdigit() or int(text) < 1:
        raise OSError(f"NVMe path layout {record} is unreadable ({text[:40]!r}): it should hold the path's shard "
                      f"count; empty {path} to lay it out again (its pages are a cache; they are lost)")
    return int(text)


def _record(path: str, per_path: int) -> None:
    """Write the count (a new file renamed into place, both synced) before any shard exists."""
    record = os.path.join(path, LAYOUT_FILE)
    written = f"{record}.new"
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, f"{per_path}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(written, record)
        directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        raise OSError(f"cannot open NVMe path {path} (nvme.paths): {exc}") from None
