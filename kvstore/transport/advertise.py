"""Which host a node tells other hosts to dial: the data plane's in Hello, gRPC's in its cluster record.

A listener bound to one address advertises that address. One bound to every interface (0.0.0.0
or ::) has no single answer, so the node advertises the IPv4 address of the interface that
carries its default route: on a host with one network that is the address other hosts reach,
and where it is not (several networks, NAT, a container's published port), `tcp.advertise_host`
and `cluster.advertise_host` say it outright. A loopback address is advertised only by a node
that serves loopback alone: one that serves other hosts and would tell them to dial 127.0.0.1
refuses to start (see `check_reachable`).
"""

from __future__ import annotations

import fcntl
import socket
import struct

from kvstore.config import loopback_host

_SIOCGIFADDR = 0x8915
WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")


def advertised_host(bound_host: str, advertise_host: str, setting: str, proc: str = "/proc") -> str:
    """The host to advertise for a listener on `bound_host`; OSError naming `setting` where none can be derived."""
    if advertise_host:
        return advertise_host
    if bound_host not in WILDCARDS:
        return bound_host
    address = default_route_address(proc)
    if not address:
        raise OSError(f"the listener binds every interface and this host has no IPv4 default route to derive "
                      f"the address other hosts dial: set {setting}")
    return address


def default_route_address(proc: str = "/proc") -> str:
    """The IPv4 address of the interface of the default route; "" where there is none."""
    try:
        with open(f"{proc}/net/route") as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return ""
    for row in rows:
        if len(row) > 7 and row[1] == "00000000" and row[7] == "00000000":   # destination and mask 0: default
            return interface_address(row[0])
    return ""


def interface_address(name: str) -> str:
    """The interface's IPv4 address; "" where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return ""
    return socket.inet_ntoa(answer[20:24])


def check_reachable(grpc_host: str, advertised: str, setting: str) -> None:
    """Refuse to tell other hosts to dial loopback: gRPC serves them, the advertised endpoint would not."""
    if loopback_host(advertised) and not loopback_host(grpc_host):
        raise OSError(f"server.grpc_address serves other hosts ({grpc_host or '*'}) but {setting} would advertise "
                      f"{advertised}, which a client on another host dials on itself: bind the data plane where "
                      f"they reach it (tcp.address, by default the host of server.grpc_address) or set "
                      f"tcp.advertise_host")


def endpoint(host: str, port: int) -> str:
    """host:port, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
