"""The host a node advertises: the bound one, an explicit one, or the default route's; never loopback to other hosts."""

from __future__ import annotations

import pytest

from kvstore.transport import advertise

ROUTES = ("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
          "lo\t0000007F\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0\n"
          "{default}")


def routes(tmp_path, default: str) -> str:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "route").write_text(ROUTES.format(default=default))
    return str(tmp_path)


def test_the_bound_or_the_explicit_host_is_advertised(tmp_path):
    assert advertise.advertised_host("10.0.0.5", "", "tcp.advertise_host") == "10.0.0.5"
    assert advertise.advertised_host("0.0.0.0", "kv.example", "tcp.advertise_host") == "kv.example"


def test_every_interface_advertises_the_default_routes_address(tmp_path):
    proc = routes(tmp_path, "lo\t00000000\t0100007F\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    assert advertise.advertised_host("0.0.0.0", "", "tcp.advertise_host", proc) == "127.0.0.1"   # lo's address


def test_every_interface_without_a_default_route_names_the_setting(tmp_path):
    with pytest.raises(OSError, match="no IPv4 default route .* set cluster.advertise_host"):
        advertise.advertised_host("::", "", "cluster.advertise_host", routes(tmp_path, ""))


def test_loopback_is_never_advertised_to_other_hosts():
    advertise.check_reachable("127.0.0.1", "127.0.0.1", "tcp.address")
    advertise.check_reachable("0.0.0.0", "10.0.0.5", "tcp.address")
    with pytest.raises(OSError, match="tcp.address would advertise 127.0.0.1"):
        advertise.check_reachable("0.0.0.0", "127.0.0.1", "tcp.address")


def test_ipv6_endpoints_are_bracketed():
    assert advertise.endpoint("fd00::5", 7000) == "[fd00::5]:7000"
    assert advertise.endpoint("10.0.0.5", 7000) == "10.0.0.5:7000"
