"""Another host, for tests: a network namespace joined to this one by a veth pair (root and iproute2).

    with veth_namespace() as ns:      # ns.name, ns.host_ip (this side), ns.ns_ip (the namespace's side)
        subprocess.run([*ns.exec_prefix, sys.executable, ...])
        NetnsServer(workdir, settings, ns.name)   # a kvstore-server inside it

Addresses come from 10.231.0.0/16, a /30 per pair, picked from the pid so parallel runs differ.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from server_process import ServerProcess
from system_tools import require_tool


@dataclass(frozen=True)
class Namespace:
    name: str
    host_link: str
    host_ip: str
    ns_ip: str

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.name)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def veth_namespace(tag: int = 0, default_route: bool = False) -> Iterator[Namespace]:
    """A namespace with lo up and a veth to this one; with `default_route`, its default route goes back here."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace needs root")
    require_tool("ip")
    pid = os.getpid() + tag
    name, host_link, ns_link = f"kvs-{pid}", f"kvh{pid}", f"kvn{pid}"
    subnet = pid % 64 * 4
    octet = 16 + (pid // 64) % 200
    host_ip, ns_ip = f"10.231.{octet}.{subnet + 1}", f"10.231.{octet}.{subnet + 2}"
    try:
        ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
    try:
        ip("link", "add", host_link, "type", "veth", "peer", "name", ns_link)
        ip("link", "set", ns_link, "netns", name)
        ip("addr", "add", f"{host_ip}/30", "dev", host_link)
        ip("link", "set", host_link, "up")
        inside = ("netns", "exec", name, "ip")
        ip(*inside, "addr", "add", f"{ns_ip}/30", "dev", ns_link)
        ip(*inside, "link", "set", ns_link, "up")
        ip(*inside, "link", "set", "lo", "up")
        if default_route:
            ip(*inside, "route", "add", "default", "via", host_ip)
        yield Namespace(name, host_link, host_ip, ns_ip)
    finally:
        subprocess.run(["ip", "link", "del", host_link], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class NetnsServer(ServerProcess):
    """A kvstore-server started inside a network namespace (`ip netns exec`)."""

    def __init__(self, workdir: Path, settings: dict[str, object], netns_name: str):
        real_executable = sys.executable
        wrapper = workdir / "python-in-netns"
        wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {netns_name} {real_executable} "$@"\n')
        wrapper.chmod(0o755)
        sys.executable = str(wrapper)
        try:
            super().__init__(workdir, settings)
        finally:
            sys.executable = real_executable
