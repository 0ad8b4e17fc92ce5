"""A blocking face on aetcd, the asyncio etcd v3 client: one event loop thread per session.

Why aetcd: it is maintained, speaks etcd's v3 gRPC API (leases, transactions, watches)
and runs on the grpcio and protobuf this project already uses (python-etcd3 pins a
protobuf three major versions old; etcd3gw goes through the JSON gateway and cannot
stream a watch as cheaply). kvstore's callers are threads, so the loop lives in its own
daemon thread and every call is handed to it with a deadline.

aetcd talks to one endpoint at a time; a session tries the configured endpoints in
order and moves to the next when one fails.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Sequence, TypeVar
from urllib.parse import urlsplit

from kvstore_client.errors import InvalidArgument

T = TypeVar("T")


class EtcdUnavailable(Exception):
    """No configured etcd endpoint answered within the deadline; the message names them."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """'http://10.0.0.1:2379', '10.0.0.1:2379' or '10.0.0.1' -> (host, port)."""
    parts = urlsplit(text if "://" in text else f"http://{text}")
    if not parts.hostname:
        raise InvalidArgument(f"etcd endpoint {text!r} must look like host:port or http://host:port")
    return parts.hostname, parts.port or 2379


class EtcdSession:
    def __init__(self, endpoints: Sequence[str], timeout_s: float):
        try:
            import aetcd  # imported here: only clustered nodes and cluster clients need it
        except ImportError as exc:
            raise ImportError(f"etcd needs its client, aetcd ({exc}): pip install 'kvstore-client[cluster]'") from None

        if not endpoints:
            raise InvalidArgument("no etcd endpoint given")
        self._aetcd = aetcd
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        self.timeout_s = timeout_s
        self._current = 0
        self._client: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd-loop", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._current]
        return f"{host}:{port}"

    def describe(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.endpoints)

    def call(self, action: Callable[[Any], Awaitable[T]], timeout_s: float | None = None) -> T:
        """Run `action(aetcd_client)` on the loop; EtcdUnavailable if no endpoint answers in time."""
        future = asyncio.run_coroutine_threadsafe(self.run(action, timeout_s), self._loop)
        return future.result()

    def submit(self, coroutine: Awaitable[Any]) -> "asyncio.Future[Any]":
        """Start a long-running coroutine (a watch) on the loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]

    async def run(self, action: Callable[[Any], Awaitable[T]], timeout_s: float | None = None) -> T:
        """On the loop: try each endpoint once, starting from the one that last worked."""
        timeout_s = timeout_s or self.timeout_s
        problems = []
        for attempt in range(len(self.endpoints)):
            try:
                client = await self._connected()
                return await asyncio.wait_for(action(client), timeout_s)
            except (self._aetcd.ClientError, asyncio.TimeoutError, OSError) as exc:
                if isinstance(exc, self._aetcd.PreconditionFailedError):
                    raise
                problems.append(f"{self.endpoint}: {type(exc).__name__} {exc}".strip())
                await self._drop()
                self._current = (self._current + 1) % len(self.endpoints)
        raise EtcdUnavailable(f"etcd unreachable at {self.describe()} ({'; '.join(problems)})")

    async def run_watch(self, watch: Callable[[Any, int], Awaitable[None]], start_revision: int) -> None:
        """On the loop: follow a watch on the endpoint that last answered, until it ends or fails."""
        await watch(await self._connected(), start_revision)

    async def _connected(self) -> Any:
        if self._client is None:
            host, port = self.endpoints[self._current]
            self._client = self._aetcd.Client(host=host, port=port, timeout=max(1, round(self.timeout_s)))
        return self._client

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception:  # a broken channel may fail to close; it is dropped either way
                pass

    def close(self) -> None:
        if not self._loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._drop(), self._loop).result(self.timeout_s)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s)
