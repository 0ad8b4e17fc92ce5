"""In-process node parts for unit tests: a page store over a real arena, a manual clock, the service."""

from __future__ import annotations

from kvstore import config
from kvstore.control.data_plane import SlotGrants
from kvstore.control.service import KVStoreService
from kvstore.control.store import PageStore
from kvstore.tiers.dram import Arena


class ManualClock:
    """The store's clock seam: time moves only when a test says so, so lease tests never sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_service(overrides: list[str], clock: ManualClock) -> KVStoreService:
    cfg = config.load(environ={}, overrides=overrides)
    service = KVStoreService(PageStore(cfg, Arena(cfg.dram.arena_bytes), clock))
    service.grants = SlotGrants(service.store)
    return service
