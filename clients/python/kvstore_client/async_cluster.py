"""AsyncKVStoreCluster: KVStoreCluster's methods as coroutines, for asyncio engines.

AsyncKVStoreClient("etcd://host:2379/<cluster>") gives one. A cluster call already runs its
pieces on threads of its own (one per node asked), so each coroutine here hands the whole
call to a worker thread and awaits it: the event loop never blocks, and the call's semantics,
its errors included, are KVStoreCluster's. A cancelled call raises CancelledError only once
that thread has ended: until then it may still be copying into the caller's buffers.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable

from kvstore_client.cluster import KVStoreCluster
from kvstore_client.worker_thread import to_the_end

_CALLS = ("put", "get", "lookup", "held", "residency", "route", "delete", "clear", "list_keys", "list_pages", "events_run",
          "node_list_pages", "stats", "node_stats", "stage", "commit_group", "abort_staged", "put_group",
          "lookup_group", "get_group", "register_buffer")


class AsyncKVStoreCluster:
    def __init__(self, url: str, **options: Any):
        """Nothing is asked of etcd until the first call (or `await connect()`, or `async with`)."""
        self._url, self._options = url, options
        self._cluster: KVStoreCluster | None = None
        self._opening = asyncio.Lock()

    async def connect(self) -> "AsyncKVStoreCluster":
        await self._opened()
        return self

    @property
    def transport(self) -> str:
        return self._cluster.transport if self._cluster is not None else "none"

    async def close(self) -> None:
        if self._cluster is not None:
            await asyncio.to_thread(self._cluster.close)

    async def __aenter__(self) -> "AsyncKVStoreCluster":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _opened(self) -> KVStoreCluster:
        async with self._opening:
            if self._cluster is None:
                self._cluster = await asyncio.to_thread(functools.partial(KVStoreCluster, self._url, **self._options))
        return self._cluster


def _in_thread(name: str) -> Callable[..., Any]:
    method = getattr(KVStoreCluster, name)

    @functools.wraps(method)
    async def call(self: AsyncKVStoreCluster, *args: Any, **kwargs: Any) -> Any:
        cluster = await self._opened()
        return await to_the_end(functools.partial(getattr(cluster, name), *args, **kwargs))
    return call


for _name in _CALLS:
    setattr(AsyncKVStoreCluster, _name, _in_thread(_name))
