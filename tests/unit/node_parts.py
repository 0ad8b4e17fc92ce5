"""In-process node parts for unit tests: a page store over a real arena, a manual clock, the service."""

from __future__ import annotations

from kvstore import config
from kvstore.control.data_plane import SlotGrants
from kvstore.control.service import KVStoreService
from kvstore.control.store import PageStore
from kvstore.tiers.dram import Arena

# Settings every node here is built with; the index_kind fixture (conftest.py) names the page index.
BASE_SETTINGS: list[str] = []


class ManualClock:
    """The store's clock seam: time moves only when a test says so, so lease tests never sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def arena_for(cfg: config.Config) -> Arena:
    """The node's arena for this config; tenants get memfds of their own, as with authentication."""
    return Arena(cfg.dram.arena_bytes, cfg.dram.slab_bytes, tenants_apart=True)


def make_service(overrides: list[str], clock: ManualClock) -> KVStoreService:
    cfg = config.load(environ={}, overrides=[*BASE_SETTINGS, *overrides])
    service = KVStoreService(PageStore(cfg, arena_for(cfg), clock))
    service.grants = SlotGrants(service.store)
    return service


def make_node(tmp_path, overrides: list[str], clock: ManualClock | None = None) -> KVStoreService:
    """A service with an NVMe tier on real LMDB files under tmp_path and its controller (not started:
    tests drive write-down and promotion themselves, so nothing moves behind their back)."""
    from kvstore.control.controller import CacheController
    from kvstore.control.scrubber import Scrubber
    from kvstore.tiers.nvme import NvmeTier

    cfg = config.load(environ={}, overrides=[*BASE_SETTINGS, *overrides])
    store = PageStore(cfg, arena_for(cfg), clock or ManualClock())
    nvme = NvmeTier((str(tmp_path / "s0"), str(tmp_path / "s1")), cfg.nvme.map_bytes)
    controller = CacheController(store, nvme, cfg.controller)
    service = KVStoreService(store, controller, Scrubber(store, nvme, 0))
    service.grants = SlotGrants(store)
    service.nvme = nvme
    return service


def close_node(svc: KVStoreService) -> None:
    """Close what make_node opened: the LMDB shards and the arena."""
    svc.nvme.close()
    svc.store.arena.close()


def write_all_down(svc: KVStoreService) -> None:
    """Write every DRAM-only page down (the controller's thread is not running in these tests)."""
    svc.controller.make_durable(list(svc.store.index.records()), deadline=float("inf"))


def drop_dram_copies(svc: KVStoreService) -> None:
    """Evict every DRAM copy of a page that is on NVMe (as pressure would)."""
    with svc.store._lock:
        for size in {r.slot_bytes for r in svc.store.index.records()}:
            while svc.store.index.evict_dram(size, clean_only=True) is not None:
                pass
