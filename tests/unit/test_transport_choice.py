"""Which data planes a client tries and in what order; RDMA logic that runs without a device."""

import sys

import pytest

from kvstore_client import errors, rdma_transport
from kvstore_client.transport_choice import candidates


def test_auto_prefers_shm_then_rdma_then_tcp():
    assert candidates("auto", True, True, True, rdma_device_here=True) == ["shm", "rdma", "tcp"]
    assert candidates("auto", True, True, True, rdma_device_here=False) == ["shm", "tcp"]
    assert candidates("auto", False, False, True, rdma_device_here=True) == ["tcp"]


def test_a_named_transport_is_the_only_candidate_and_must_be_offered():
    assert candidates("tcp", True, False, True, rdma_device_here=False) == ["tcp"]
    with pytest.raises(errors.TransportUnavailable, match="rdma"):
        candidates("rdma", True, False, True, rdma_device_here=True)
    with pytest.raises(errors.TransportUnavailable, match="no data plane"):
        candidates("auto", False, False, False, rdma_device_here=False)
    with pytest.raises(ValueError, match="transport must be one of"):
        candidates("udp", True, True, True, rdma_device_here=True)


def test_rdma_work_requests_cover_each_page_with_bounded_scatter_gather():
    pages = [(0, 4096, [(1000, 100), (2000, 50), (3000, 10)]), (1, 8192, [(5000, 160)])]
    plan = rdma_transport.plan_work_requests(pages, arena_addr=1 << 40, max_sge=2)
    assert plan == [((1 << 40) + 4096, [(1000, 100), (2000, 50)]), ((1 << 40) + 4096 + 150, [(3000, 10)]),
                    ((1 << 40) + 8192, [(5000, 160)])]


def test_missing_pyverbs_is_named_with_how_to_install_it(monkeypatch):
    for name in [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(rdma_transport, "SYSTEM_PACKAGE_DIRS", ("/nonexistent",))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "dist-packages" not in p])
    with pytest.raises(errors.TransportUnavailable, match="apt install python3-pyverbs"):
        rdma_transport.load_pyverbs()
    assert rdma_transport.device_present() is False
