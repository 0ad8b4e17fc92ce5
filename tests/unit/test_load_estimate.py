"""Fetch or recompute's arithmetic: the node's per-tier costs decay toward recent reads, a client's plane rate
likewise, and the pages worth loading are the prefix that saves the most time against a prefill."""

import pytest

from kvstore.control.load_rates import LoadRates
from kvstore_client.load_estimate import NO_COSTS, LoadCosts, TransferRate, pages_worth_loading
from kvstore_client.proto import pb


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_tiers_cost_follows_recent_reads_and_old_ones_fade():
    clock = Clock()
    rates = LoadRates(half_life_s=10, clock=clock)
    assert rates.answer() == []                             # nothing read: no figure
    rates.observe(pb.DRAM, 10, 0.010)                       # 1 ms a page
    rates.observe(pb.NVME, 0, 5.0)                          # no page: nothing learned
    assert [(r.tier, r.seconds_per_page) for r in rates.answer()] == [(pb.DRAM, pytest.approx(0.001))]
    clock.now += 30                                         # three half-lives later: weight 10 -> 1.25
    rates.observe(pb.DRAM, 10, 0.100)                       # 10 ms a page now
    (dram,) = rates.answer()
    assert dram.seconds_per_page == pytest.approx((0.001 * 1.25 + 0.100) / 11.25)
    assert dram.pages == pytest.approx(11.25)


def test_a_planes_rate_is_bytes_over_seconds_recent_first():
    clock = Clock()
    rate = TransferRate(half_life_s=10, clock=clock)
    assert rate.bytes_per_s() == 0.0
    rate.moved(1000, 1.0)
    clock.now += 10
    rate.moved(4000, 1.0)
    assert rate.bytes_per_s() == pytest.approx((500 + 4000) / 1.5)


def test_the_pages_worth_loading_save_the_most_time():
    dram, nvme = bytes([pb.DRAM]), bytes([pb.NVME])
    costs = LoadCosts({pb.DRAM: 0.001, pb.NVME: 0.010}, plane_bytes_per_s=1e6, round_trip_s=0.0005)
    # A page: 1 ms pinned (+ 10 ms promoted on NVMe) + 1 ms moved (1000 bytes at 1 MB/s); a prefill of 16
    # tokens at 0.5 ms a token is 8 ms: DRAM pages (2 ms) pay, NVMe ones (12 ms) do not.
    tiers = dram * 3 + nvme * 4
    assert costs.cumulative(tiers, 1000)[-1] == pytest.approx(0.0005 + 3 * 0.002 + 4 * 0.012)
    assert pages_worth_loading(tiers, costs, 1000, 16, 0.0005) == 3
    assert pages_worth_loading(tiers, costs, 1000, 16, 0.01) == 7       # a slow prefill: load all
    assert pages_worth_loading(tiers, costs, 1000, 16, 0.00001) == 0    # a fast prefill: recompute
    assert pages_worth_loading(tiers, costs, 1000, 16, 0.0) == 7        # no prefill cost given: load all
    assert pages_worth_loading(b"", costs, 1000, 16, 0.001) == 0
    assert pages_worth_loading(tiers, NO_COSTS, 1000, 16, 0.00001) == 7  # nothing measured: loading is free
