"""Which processes hold TCP connections to a local port, read from /proc (named in a failure of a test that counts
a node's calls: a client of an earlier test that reconnects to a port reused by this test's node adds calls)."""

from __future__ import annotations

import os
import threading


def peers(port: int) -> list[str]:
    """One line per process connected to 127.0.0.1:`port`: its pid, command line and number of connections; for
    this process, its threads' names too."""
    inodes = _connected_inodes(port)
    holders: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        held = sum(1 for link in _fd_links(pid) if link.startswith("socket:[") and link[8:-1] in inodes)
        if held:
            holders[int(pid)] = held
    lines = []
    for pid, held in sorted(holders.items()):
        if pid == os.getpid():
            threads = sorted(t.name for t in threading.enumerate())
            lines.append(f"this test process ({pid}): {held} connection(s); threads {threads}")
        else:
            lines.append(f"pid {pid} {_command(pid)!r}: {held} connection(s)")
    return lines


def _connected_inodes(port: int) -> set[str]:
    """Socket inodes of established TCP connections whose remote end is `port` on this host."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01":   # ESTABLISHED
                inodes.add(fields[9])
    return inodes


def _fd_links(pid: str) -> list[str]:
    """What each open file of the process is (an fd closed meanwhile, or a process gone or not ours, is left out)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return links


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"
